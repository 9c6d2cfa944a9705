"""`enable_fused_cross_entropy`: pick how the causal-LM head computes its loss."""

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
