"""`enable_fused_embedding`: pick the token embedding's backward kernel."""

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
