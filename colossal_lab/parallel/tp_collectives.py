"""The collectives of tensor and sequence parallelism, as autograd functions (switch 5).

Activations are batch-first, (B, S, d); a *sequence shard* is (B, S/t, d): rank r of a
tensor-parallel group of t ranks holds tokens [r·S/t, (r+1)·S/t). The four collectives
and their adjoints (Megatron-LM's f and g, Shoeybi et al. 2019, and their
sequence-parallel pair, Korthikanti et al. 2022)::

    op                      forward              backward
    copy_to_tp     (f)      identity             all-reduce
    reduce_from_tp (g)      all-reduce           identity
    gather_seq              all-gather  (seq)    reduce-scatter (seq)
    scatter_seq             reduce-scatter (seq) all-gather  (seq)

An all-reduce *is* a reduce-scatter followed by an all-gather (that is how a ring
all-reduce runs), so replacing each g by a reduce-scatter and each f by an all-gather
moves the same bytes; what changes is what lies between them: a sequence shard instead
of a replicated tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1
"""The sequence dim of a (B, S, d) activation."""

# torch 2.13's names for all_gather_into_tensor / reduce_scatter_tensor, else the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def size_and_rank(group) -> tuple[int, int]:
    """(ranks in `group`, this rank's index in it); (1, 0) without torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)



def stacked_to_seq(buf: torch.Tensor) -> torch.Tensor:
    """(t, B, s, ...) -> (B, t·s, ...): a view for B = 1, a copy otherwise."""
    return buf.movedim(0, 1).flatten(1, 2)


def _seq_to_stacked(y: torch.Tensor, t: int) -> torch.Tensor:
    """(B, S, ...) -> (t, B, S/t, ...), contiguous: chunk r is rank r's."""
    return y.unflatten(SEQ_DIM, (t, y.shape[SEQ_DIM] // t)).movedim(1, 0).contiguous()


def all_gather_seq(x: torch.Tensor, group, async_op: bool = False):
    """Every rank's (B, s, ...) shard -> (B, t·s, ...) in rank order. With `async_op`
    returns (the (t, B, s, ...) buffer, the work): `stacked_to_seq` after the wait."""
    t, _ = size_and_rank(group)
    buf = x.new_empty((t * x.shape[0], *x.shape[1:]))  # ranks along dim 0 (gloo wants it)
    work = _all_gather(buf, x.contiguous(), group=group, async_op=async_op)
    buf = buf.view(t, *x.shape)
    if async_op:
        return buf, work
    return stacked_to_seq(buf)


def reduce_scatter_seq(y: torch.Tensor, group, async_op: bool = False):
    """(B, S, ...) partial sums on every rank -> this rank's (B, S/t, ...) chunk of the
    sum. With `async_op` returns (out, work)."""
    t, _ = size_and_rank(group)
    if y.shape[SEQ_DIM] % t:
        raise ValueError(f"sequence length {y.shape[SEQ_DIM]} is not divisible by the "
                         f"tensor-parallel size {t}")
    stacked = _seq_to_stacked(y, t)
    out = y.new_empty(stacked.shape[1:])
    work = _reduce_scatter(out, stacked.flatten(0, 1), group=group, async_op=async_op)
    return (out, work) if async_op else out


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's (B, S/t, ...) chunk of a (B, S, ...) tensor every rank holds."""
    t, r = size_and_rank(group)
    return x.chunk(t, dim=SEQ_DIM)[r].contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (the input of a column-parallel linear
    is used by every rank; its gradient is the sum of theirs)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous().clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (a row-parallel linear's partial sums), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_seq(dy, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_seq(dy, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    """Column-parallel outputs (..., n/t) -> (..., n) forward; backward keeps this
    rank's slice (for full logits at inference, not used in training)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, _ = size_and_rank(group)
        buf = x.new_empty((t * x.shape[0], *x.shape[1:]))
        _all_gather(buf, x.contiguous(), group=group)
        return buf.view(t, *x.shape).movedim(0, -2).flatten(-2, -1)

    @staticmethod
    def backward(ctx, dy):
        t, r = size_and_rank(ctx.group)
        return dy.chunk(t, dim=-1)[r].contiguous(), None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_seq(x, group):
    return _GatherSeq.apply(x, group)


def scatter_seq(x, group):
    return _ScatterSeq.apply(x, group)


def gather_last_dim(x, group):
    return _GatherLastDim.apply(x, group)
