"""Switch 3, `enable_fused_projections`: stacks q/k/v and gate/up into one linear each.

The tutorial ties this switch to ColossalAI's `enable_jit_fused`, which fuses bias + GeLU and
bias + dropout + add instead; ours is named for what it does. Values: False (separate
linears, eager SwiGLU), True ("triton" on a GPU, "eager" on the CPU) or a SwiGLU backend
of `ops.swiglu.ACTIVATIONS` ("eager", "compile", "triton"). On the model it replaces the
`nn.Linear` children (`ops.projections`: new Parameters, the state dict keeps Hugging
Face's names) and sets `activation` of every MLP.
"""

from __future__ import annotations

import torch.nn as nn

from colossal_lab.ops.projections import FUSIONS, fuse_linears, register_hf_layout, split_linear
from colossal_lab.ops.swiglu import is_fused


def apply(model: nn.Module, value) -> int:
    """Switch 3 on `model`, in place: stack every q/k/v and gate/up trio or pair of
    plain `nn.Linear` children into one (values kept, new Parameters: make the optimizer
    afterwards), or split them back for False; modules with an `activation` (the MLP)
    run the SwiGLU kernel `value` picks. The state dict keeps the separate names.
    Returns how many fused linears the model holds afterwards."""
    fused = is_fused(value)  # validates
    count = 0
    for m in list(model.modules()):
        for name, parts in FUSIONS.items():
            if fused and all(p in m._modules for p in parts):
                sizes = [m._modules[p].out_features for p in parts]
                fuse_linears(m, list(parts), name)
                register_hf_layout(m, name, parts, sizes)
            elif not fused and name in m._modules:
                split_linear(m, name, list(parts), m._fused_sizes[name])
            count += name in m._modules
        if hasattr(type(m), "activation"):
            m.activation = value
    return count
