"""Switch 1, ColossalAI's `enable_flash_attention`: sets the attention kernel on a model.

Values: False (naive attention, the (S, S) scores materialised), True (the best backend
on the device: cuDNN attention where it runs, else PyTorch SDPA) or a name in
`ops.attention.BACKENDS` ("sdpa", "cudnn", "triton" for ours, "flash_attn", ...). On the
model it sets `attention_backend` of every attention module (`model.Attention`); the op
itself, its reference and its fallback live in `ops.attention`.
"""

from __future__ import annotations

import torch

from colossal_lab.ops import kernel_switch
from colossal_lab.ops.attention import BACKENDS


def apply(model: torch.nn.Module, backend) -> int:
    """Switch 1 on `model`, in place: every attention module (one whose class has an
    `attention_backend`, like `model.Attention`) runs `backend` from its next call;
    returns how many modules were set.
    The name is checked now; whether it runs on this device is decided per call
    (`resolve_backend`), where the dtype and head dim are known."""
    if not (backend is True or backend is False or backend is None or backend in BACKENDS):
        raise ValueError(f"enable_flash_attention={backend!r}; choose False (naive), True "
                         f"(best available) or one of {BACKENDS}")
    return kernel_switch.set_on_modules(model, "attention_backend", backend)
