"""Triton kernels with their launchers and autograd Functions.

Without a GPU the kernels run under Triton's interpreter. `TRITON_INTERPRET` must be set
before a kernel is *defined* (decorated), so importing this package sets it when no CUDA
device is present, unless the user chose otherwise.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""True when Triton kernels run on the CPU interpreter (tests, CI)."""


def runs_on(device) -> bool:
    """Can our Triton kernels take tensors on `device`? CUDA tensors always; CPU tensors
    only under the interpreter (where Triton reads them directly, exact and slow)."""
    return torch.device(device).type == "cuda" or INTERPRET
