"""Tensor parallelism's modules: column- and row-parallel linears, a vocabulary-split embedding.

Each holds one rank's block of a weight (`tp_shards`) and calls the autograd function
of its mode (`tp_ops`): "all_reduce" is plain TP, "split_gather", "ring" and
"symm_mem" are sequence parallel, their activations (B, S/t, d) between the blocks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.ops import autocast_state
from colossal_lab.parallel import tp_ops
from colossal_lab.parallel.tp_collectives import reduce_from_tp, scatter_seq, size_and_rank
from colossal_lab.parallel.tp_shards import check_sequence


def _compute_dtype(x: torch.Tensor, w: torch.Tensor):
    """Operands in autocast's dtype (cast here, differentiably), so that the autograd
    functions below run their own GEMMs with autocast off."""
    dtype = autocast_state.current_dtype(x.device.type)
    if dtype is None:
        return x, w
    return x.to(dtype), w.to(dtype)


class _ParallelLinear(nn.Module):
    """A linear layer holding one rank's block of a bias-free weight.

    ``wgrad_store``: set by a zero-bubble pipeline (`pipeline.runtime.
    defer_weight_grads`) to defer this linear's weight gradient, communication included,
    to the schedule's W (`tp_ops.deferral`); None: computed in the backward."""

    wgrad_store = None

    def _operands(self, x: torch.Tensor):
        """(x, w, defer): the operands in autocast's dtype, the weight detached when its
        gradient is deferred (W adds it), and the deferral for the autograd function."""
        defer = tp_ops.deferral(self, x)
        x, w = _compute_dtype(x, self.weight.detach() if defer else self.weight)
        return x, w, defer

    def __init__(self, weight: torch.Tensor, mode: str, group, symm_name=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.out_features, self.in_features = weight.shape
        self.mode, self.group, self.symm_name = mode, group, symm_name

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local), mode={self.mode!r}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x Wᵀ with W this rank's rows (output features). Input: the replicated
    (B, S, k) ("all_reduce") or this rank's (B, S/t, k) shard (the sequence-parallel
    modes); output (B, S, n/t)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w, defer = self._operands(x)
        with autocast_state.off(x.device.type):
            if self.mode == "all_reduce":
                return tp_ops.LinearAllReduceBackward.apply(x, w, self.group, defer)
            if self.mode == "split_gather":
                return tp_ops.GatherLinear.apply(x, w, self.group, defer)
            if self.mode == "ring":
                return tp_ops.RingGatherLinear.apply(x, w, self.group, defer)
            return tp_ops.SymmMemGatherLinear.apply(x, w, self.group, self.symm_name,
                                                    defer)


class RowParallelLinear(_ParallelLinear):
    """y = Σ_ranks h_r W_rᵀ with W_r this rank's columns (input features). Input
    (B, S, k/t); output the replicated (B, S, n) ("all_reduce", an all-reduce) or this
    rank's (B, S/t, n) shard (a reduce-scatter)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h, w, defer = self._operands(h)
        with autocast_state.off(h.device.type):
            if self.mode == "all_reduce":
                y = F.linear(h, w) if defer is None else \
                    tp_ops.LinearDeferredGrad.apply(h, w, defer)
                return reduce_from_tp(y, self.group)
            if self.mode == "split_gather":
                return tp_ops.LinearReduceScatter.apply(h, w, self.group, defer)
            if self.mode == "ring":
                return tp_ops.RingLinearReduceScatter.apply(h, w, self.group, defer)
            return tp_ops.SymmMemLinearReduceScatter.apply(h, w, self.group,
                                                           self.symm_name, defer)


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/t) of the embedding. Each rank looks up the
    tokens it owns (zeros for the others); the partial sums are all-reduced (plain TP)
    or reduce-scattered along the sequence (SP: the layers start on shards)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, mode: str, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.vocab_start, self.mode, self.group = vocab_start, mode, group
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t, _ = size_and_rank(self.group)
        if self.mode != "all_reduce":
            check_sequence(ids.shape[1], t)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)  # (B, S, d)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        if self.mode == "all_reduce":
            return reduce_from_tp(out, self.group)
        return scatter_seq(out, self.group)  # (B, S/t, d)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local, from {self.vocab_start}), "
                f"{self.embedding_dim}, mode={self.mode!r}")
