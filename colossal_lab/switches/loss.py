"""`enable_fused_cross_entropy` (no ColossalAI flag): sets how the causal-LM head computes its loss.

Values: False (full fp32 logits, then cross-entropy), True ("triton" on a GPU, "chunked"
on the CPU) or a name in `ops.cross_entropy.BACKENDS` ("eager", "chunked", "triton").
On the model it sets `loss_backend` of the causal-LM head; the op, chunked so that the
(N, V) logits are never whole, is `ops.cross_entropy`.
"""

from __future__ import annotations

import torch.nn as nn

from colossal_lab.ops import kernel_switch
from colossal_lab.ops.cross_entropy import _validate


def apply(model: nn.Module, value) -> int:
    """The loss switch on `model`, in place: every module whose class has a
    `loss_backend` attribute (the causal-LM head) computes its loss with `value` from
    its next call; returns how many modules were set. The value is checked now; whether
    "triton" runs on this device is decided per call (`resolve_backend`)."""
    _validate(value)
    return kernel_switch.set_on_modules(model, "loss_backend", value)
