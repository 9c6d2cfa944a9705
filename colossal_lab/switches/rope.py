"""`enable_fused_rope` (no ColossalAI flag; a kernel of the finale): sets the RoPE kernel.

Values: False (the element-wise chain), True ("triton" on a GPU, "eager" on the CPU) or
a name in `ops.rope.BACKENDS` ("eager", "compile", "triton"). On the model it sets
`rope_backend` of every attention module; the op is `ops.rope`.
"""

from __future__ import annotations

import torch

from colossal_lab.ops import kernel_switch
from colossal_lab.ops.rope import _validate


def apply(model: torch.nn.Module, value) -> int:
    """The RoPE switch on `model`, in place: every module whose class has a
    `rope_backend` attribute (the attention) runs `value` from its next call; returns
    how many modules were set. The value is checked now; whether it runs on this
    device is decided per call (`resolve_backend`)."""
    _validate(value)
    return kernel_switch.set_on_modules(model, "rope_backend", value)
