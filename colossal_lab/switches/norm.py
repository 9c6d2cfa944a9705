"""Switch 2, ColossalAI's `enable_fused_normalization`: sets the kernel of every norm.

ColossalAI swaps in apex's fused RMSNorm; here the values are False (eager PyTorch ops),
True ("triton" on a GPU, "torch" on the CPU) or a name in `ops.norm.BACKENDS` ("torch",
"compile", "triton", "liger", "apex"). On the model it sets `backend` of every `RMSNorm`
and `LayerNorm`, and `defer_residual` of the decoder stack, so that a backend that fuses
the residual add (`ops.norm.FUSES_ADD`) takes each layer's last add into the next norm.
"""

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
