"""What a model's switches resolve to on its device, after any fallback.

A results row records these next to the switch values it asked for: a label says what
was requested, `backends_in_use` what actually ran.
"""

from __future__ import annotations

import torch

from colossal_lab import precision
from colossal_lab.model import MLP, Attention, LlamaForCausalLM, LlamaModel
from colossal_lab.ops import attention, cross_entropy, embedding, fp8, norm, rope, swiglu


def backends_in_use(model: torch.nn.Module) -> dict:
    """The backend each switch of `model` resolves to on its device and compute dtype,
    after any fallback: what a results row should record next to the switch values.

    Keys: "attention_backend" (`attention.BACKENDS`), "norm_backend"
    (`norm.BACKENDS`), "swiglu_backend" ("eager" also for unfused projections, which
    run silu(gate)·up eagerly), "fp8_backend" ("scaled_mm", "emulate", or None when no
    linear is fp8), "rope_backend" (`rope.BACKENDS`), "loss_backend"
    (`cross_entropy.BACKENDS`), "embedding_backend" (`embedding.BACKENDS`). Read from the
    modules themselves, so a switch applied to just some of them is seen; layers
    that disagree are listed joined by "+"."""
    param = next(model.parameters())
    device = param.device
    dtype = precision.policy(precision.of(model)).autocast_dtype or param.dtype  # q, k, v
    head_dim = getattr(getattr(model, "cfg", None), "head_dim", None)
    found: dict[str, list[str]] = {k: [] for k in ("attention_backend", "norm_backend",
                                                   "swiglu_backend", "fp8_backend",
                                                   "rope_backend", "loss_backend",
                                                   "embedding_backend")}

    def add(key, name):
        if name not in found[key]:
            found[key].append(name)

    for m in model.modules():
        if isinstance(m, Attention):
            add("attention_backend", attention.resolve_backend(
                m.attention_backend, device, dtype=dtype, head_dim=head_dim))
            add("rope_backend", rope.resolve_backend(m.rope_backend, device))
        elif isinstance(m, LlamaForCausalLM):
            add("loss_backend", cross_entropy.resolve_backend(m.loss_backend, device))
        elif isinstance(m, LlamaModel):
            add("embedding_backend", embedding.resolve_backend(m.embedding_backend, device))
        elif isinstance(m, (norm.RMSNorm, norm.LayerNorm)):
            add("norm_backend", norm.resolve_backend(m.backend, device))
        elif isinstance(m, MLP):
            fused = m.fused and swiglu.is_fused(m.activation)
            add("swiglu_backend", swiglu.resolve_activation(m.activation, device)
                if fused else "eager")
        elif isinstance(m, fp8.Fp8Linear):
            add("fp8_backend", fp8.resolve_backend(m.fp8_config.backend, device))
    return {k: "+".join(v) if v else None for k, v in found.items()}
