"""Switch 2, `enable_fused_normalization`: pick the kernel of every norm module."""

from __future__ import annotations

import torch.nn as nn

from colossal_lab.ops import kernel_switch
from colossal_lab.ops.norm import BACKENDS, FUSES_ADD, LayerNorm, RMSNorm


def apply(model: nn.Module, backend) -> int:
    """Switch 2 on `model`, in place: every `RMSNorm` and `LayerNorm` runs `backend`
    from its next call (checked now; fallback decided per call, `resolve_backend`);
    returns how many modules were set."""
    if not (backend is True or backend is False or backend is None or backend in BACKENDS):
        raise ValueError(f"enable_fused_normalization={backend!r}; choose False (eager), "
                         f"True (best available) or one of {BACKENDS}")
    count = 0
    for m in model.modules():
        if isinstance(m, (RMSNorm, LayerNorm)):
            m.backend = backend
            count += 1
    # a fusing backend also takes each layer's last residual add (`LlamaModel`)
    kernel_switch.set_on_modules(model, "defer_residual", backend in FUSES_ADD)
    return count
