"""The token embedding's lookup, with torch's backward or ours (`kernels.embedding`).

The forward is the same gather either way; only the weight's gradient differs. Torch's
CUDA backward sorts the ids, sums runs of equal ids in fp32 partial segments and
zero-fills the unused rows in eight launches. Ours reads dy once and writes every row of
dW once, zeros included, with a sort and a search over the ids before it. The sums are in
fp32 in token order: deterministic, and equal to torch's up to the order of the additions
within a row. No ColossalAI or Liger counterpart; `switches.embedding` sets it on a model
(`Switches.enable_fused_embedding`). Under tensor parallelism the embedding is row-sharded
by torch's `RowwiseParallel`, which needs the module's own call, so the switch is refused
there (`switches.apply`).
"""

from __future__ import annotations

import torch

from colossal_lab.kernels.embedding import embedding_triton
from colossal_lab.ops import kernel_switch

BACKENDS = ("eager", "triton")


def resolve_backend(value, device=None) -> str:
    """"eager" or "triton" for the switch value on `device` (`kernel_switch.resolve`:
    "triton" without a GPU or the interpreter falls back to "eager")."""
    return kernel_switch.resolve(value, device, names=BACKENDS,
                                 field="enable_fused_embedding", what="embedding")


def lookup(ids: torch.Tensor, embed: torch.nn.Module, backend="eager") -> torch.Tensor:
    """embed(ids) with the backward `backend` picks. Anything but a plain
    `nn.Embedding` (one with `max_norm`, `scale_grad_by_freq` or sparse gradients, whose
    backward is torch's only, or another module: tensor parallelism's vocabulary-
    parallel one) runs its own call."""
    if resolve_backend(backend, ids.device) == "triton" and type(embed) is torch.nn.Embedding \
            and embed.max_norm is None and not embed.scale_grad_by_freq and not embed.sparse:
        return embedding_triton(ids, embed.weight, embed.padding_idx)
    return embed(ids)


