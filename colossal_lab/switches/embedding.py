"""`enable_fused_embedding` (no ColossalAI flag): sets the token embedding's backward kernel.

Values: False or "eager" (torch's backward), True ("triton" on a GPU, "eager" on the
CPU) or "triton" (ours, `ops.embedding`). On the model it sets `embedding_backend` of
the decoder stack; the forward gather is the same either way.
"""

from __future__ import annotations

import torch

from colossal_lab.ops import kernel_switch
from colossal_lab.ops.embedding import BACKENDS


def apply(model: torch.nn.Module, value) -> int:
    """The embedding switch on `model`, in place: every module whose class has an
    `embedding_backend` attribute (the decoder stack) looks its tokens up with `value`
    from its next call; returns how many modules were set."""
    kernel_switch.check_value(value, BACKENDS, "enable_fused_embedding")
    return kernel_switch.set_on_modules(model, "embedding_backend", value)
