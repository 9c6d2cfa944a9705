"""The linears of tensor and sequence parallelism, as autograd functions (switch 5).

A rank holds a block of rows of an (out, in) weight (column-parallel: its output
features) or of columns (row-parallel: its input features). One autograd function per
placement of the communication (the collectives are in `tp_collectives`):

- `LinearAllReduceBackward` (plain TP, column): the backward all-reduces dX
  asynchronously while it computes dW = dYᵀX (Megatron's async all-reduce).
- `GatherLinear` / `LinearReduceScatter` ("split_gather"): the column linear keeps only
  its input *shard*; its backward re-gathers it while computing dX = dY·W, then
  reduce-scatters dX while computing dW (Megatron's two backward overlaps).
- `RingGatherLinear` / `RingLinearReduceScatter` ("ring"): the collective cut into t
  point-to-point steps, each step's GEMM on the shard that has arrived while the next
  one travels (Wang et al. 2023). For GEMM + reduce-scatter, at step s rank r computes
  the partial of chunk c = (r + s + 1) mod t, adds what rank r + 1 sent and passes the
  sum to rank r − 1; after t steps it holds the full sum of chunk r.
- `SymmMemGatherLinear` / `SymmMemLinearReduceScatter` ("symm_mem"): the same fused
  collectives from PyTorch's symmetric memory (CUDA and NCCL).

NCCL runs communication on its own stream: ``work.wait()`` makes the compute stream
wait, not the host, so a GEMM issued between launch and wait overlaps the transfer. In a
zero-bubble pipeline each backward's weight-gradient half (its GEMM and the
communication only it needs) is filed for the schedule's W (`deferral`).

Shapes: B batch, S sequence, s = S/t a shard, k and n a linear's input and (local)
output width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossal_lab.parallel.tp_collectives import (
    SEQ_DIM,
    all_gather_seq,
    reduce_scatter_seq,
    size_and_rank,
    stacked_to_seq,
)

# ------------------------------------------------------------------- GEMM helpers


def _wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ X over every token: (.., n), (.., k) -> (n, k)."""
    return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Chunked weight gradients accumulate in fp32 unless they are fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _file(defer, job) -> None:
    """Hand the weight gradient to a zero-bubble pipeline's W: `defer` is (store, key,
    weight) from `deferral`; `job()` computes dW (its communication included) when the
    schedule runs W, and the store adds it to `weight` through autograd."""
    store, key, weight = defer
    store.put(key, lambda: [(weight, job().to(weight.dtype))])


def deferral(module, x: torch.Tensor):
    """(store, key, weight) when `module`'s weight gradient goes to a zero-bubble
    pipeline's W (`pipeline.runtime.defer_weight_grads` set ``module.wgrad_store`` and a
    step's forward runs now), else None: then the linear computes dW in its backward.

    With a store the weight comes *detached* (its hooks fire when W adds the gradient,
    not in B), and the autograd function files its weight-gradient half, communication
    included; the ranks of a tp group run the same program and meet in W."""
    store = getattr(module, "wgrad_store", None)
    if store is None or store.key is None or not x.requires_grad \
            or not module.weight.requires_grad:
        return None
    return store, store.key, module.weight


# ------------------------------------------------------------- plain TP (all-reduce)


class LinearAllReduceBackward(torch.autograd.Function):
    """Plain TP's column-parallel linear on a replicated input: y = x Wᵀ, and in the
    backward dX = dY·W is all-reduced asynchronously while dW = dYᵀX is computed."""

    @staticmethod
    def forward(ctx, x, weight, group, defer=None):
        ctx.group, ctx.defer = group, defer
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)  # (B, S, n)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = None
        work = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight  # (B, S, k) partial: this rank's n/t features
            work = dist.all_reduce(dx, group=ctx.group, async_op=True)
        if ctx.defer is not None:
            _file(ctx.defer, lambda: _wgrad(dy, x))
        elif ctx.needs_input_grad[1]:
            dw = _wgrad(dy, x)  # runs while dX travels
        if work is not None:
            work.wait()
        return dx, dw, None, None


class LinearDeferredGrad(torch.autograd.Function):
    """Plain TP's row-parallel GEMM, y = h Wᵀ (the all-reduce follows outside), when its
    weight gradient is deferred (`deferral`): dH now, dW = dYᵀH filed for W."""

    @staticmethod
    def forward(ctx, h, weight, defer):
        ctx.defer = defer
        ctx.save_for_backward(h, weight)
        return F.linear(h, weight)

    @staticmethod
    def backward(ctx, dy):
        h, weight = ctx.saved_tensors
        _file(ctx.defer, lambda: _wgrad(dy, h))
        return (dy @ weight if ctx.needs_input_grad[0] else None), None, None


# ------------------------------------------------------ sequence parallel (split_gather)


class GatherLinear(torch.autograd.Function):
    """Sequence-parallel column linear: all-gather the (B, s, k) shard, y = x Wᵀ on the
    whole (B, S, k). Saves the *shard* only; the backward re-gathers it while dX = dY·W
    runs, then reduce-scatters dX while dW = dYᵀX runs. Deferred (`deferral`): B only
    computes and reduce-scatters dX; W re-gathers x and computes dW."""

    @staticmethod
    def forward(ctx, x_shard, weight, group, defer=None):
        ctx.group, ctx.defer = group, defer
        ctx.save_for_backward(x_shard, weight)
        return F.linear(all_gather_seq(x_shard, group), weight)  # (B, S, n)

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.defer is not None:
            _file(ctx.defer, lambda: _wgrad(dy, all_gather_seq(x_shard, group)))
            return reduce_scatter_seq(dy @ weight, group), None, None, None
        buf, gather = all_gather_seq(x_shard, group, async_op=True)  # (1) re-gather x
        dx_full = dy @ weight  # (2) dgrad (B, S, k) while x travels
        gather.wait()
        x_full = stacked_to_seq(buf)
        dx, scatter = reduce_scatter_seq(dx_full, group, async_op=True)  # (3)
        dw = _wgrad(dy, x_full) if ctx.needs_input_grad[1] else None  # (4) while dX travels
        scatter.wait()
        return dx, dw, None, None


class LinearReduceScatter(torch.autograd.Function):
    """Sequence-parallel row linear: partial y = h Wᵀ on (B, S, k/t), reduce-scattered
    to this rank's (B, s, n). Backward: all-gather dY, then dH = dY·W and dW = dYᵀH
    (deferred: dW in W, from the gathered dY kept until then)."""

    @staticmethod
    def forward(ctx, h, weight, group, defer=None):
        ctx.group, ctx.defer = group, defer
        ctx.save_for_backward(h, weight)
        return reduce_scatter_seq(F.linear(h, weight), group)

    @staticmethod
    def backward(ctx, dy_shard):
        h, weight = ctx.saved_tensors
        dy = all_gather_seq(dy_shard, ctx.group)  # (B, S, n): both GEMMs need all of it
        dh = dy @ weight if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.defer is not None:
            _file(ctx.defer, lambda: _wgrad(dy, h))
        elif ctx.needs_input_grad[1]:
            dw = _wgrad(dy, h)
        return dh, dw, None, None


# ------------------------------------------------------------------ the ring (chunked)


def _peers(group) -> tuple[int, int, int, int]:
    """(t, r, next, prev): global ranks of the ring's neighbours r + 1 and r − 1."""
    t, r = size_and_rank(group)
    glob = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
    return t, r, glob((r + 1) % t), glob((r - 1) % t)


def _send_recv(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int, group) -> list:
    """Launch one ring step: `send` to rank `to`, `recv` from rank `frm` (global)."""
    ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return dist.batch_isend_irecv(ops)


def ring_all_gather(x: torch.Tensor, group, consume) -> None:
    """All-gather through the ring, computing as it goes: ``consume(j, x_j)`` is called
    for every rank j's shard (own first), each while the next shard is in flight."""
    t, r, nxt, prv = _peers(group)
    cur = x.contiguous()
    for step in range(t):
        works = []
        if step < t - 1:  # pass the shard on before computing on it
            incoming = torch.empty_like(cur)
            works = _send_recv(cur, nxt, incoming, prv, group)
        consume((r - step) % t, cur)
        for w in works:
            w.wait()
        if works:
            cur = incoming


def ring_reduce_scatter(produce, group) -> torch.Tensor:
    """Reduce-scatter through the ring, computing as it goes: ``produce(c)`` makes this
    rank's partial of chunk c; the partial of the next chunk is computed while the
    running sum of the previous one travels. Returns the full sum of chunk r."""
    t, r, nxt, prv = _peers(group)
    acc = produce((r + 1) % t)
    for step in range(1, t):
        incoming = torch.empty_like(acc)
        works = _send_recv(acc, prv, incoming, nxt, group)  # running sum to r − 1
        part = produce((r + step + 1) % t)  # computed while the sum travels
        for w in works:
            w.wait()
        acc = part.add_(incoming)
    return acc


def _ring_wgrad(dy: torch.Tensor, x_shard: torch.Tensor, weight: torch.Tensor,
                group) -> torch.Tensor:
    """dW = Σ_j dY[j]ᵀ x_j, x gathered through the ring, each shard's GEMM while the
    next one travels (fp32 accumulation)."""
    s = x_shard.shape[SEQ_DIM]
    acc = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device)

    def wgrad(j, xj):
        acc.add_(_wgrad(dy[:, j * s:(j + 1) * s], xj).to(acc.dtype))

    ring_all_gather(x_shard, group, wgrad)
    return acc.to(weight.dtype)


class RingGatherLinear(torch.autograd.Function):
    """Column linear, ring all-gather + GEMM: y[j] = x_j Wᵀ as shard j arrives.
    Backward: dX by a ring GEMM + reduce-scatter (dY[c]·W per chunk), dW = Σ_j dY[j]ᵀx_j
    by a ring all-gather of x (deferred: that second ring runs in W)."""

    @staticmethod
    def forward(ctx, x_shard, weight, group, defer=None):
        ctx.group, ctx.defer = group, defer
        ctx.save_for_backward(x_shard, weight)
        t, _ = size_and_rank(group)
        b, s, _ = x_shard.shape
        out = x_shard.new_empty((t, b, s, weight.shape[0]))  # (t, B, s, n)

        def gemm(j, xj):
            torch.mm(xj.reshape(b * s, -1), weight.t(), out=out[j].view(b * s, -1))

        ring_all_gather(x_shard, group, gemm)
        return stacked_to_seq(out)  # (B, S, n)

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        group = ctx.group
        s = x_shard.shape[SEQ_DIM]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = ring_reduce_scatter(lambda c: dy[:, c * s:(c + 1) * s] @ weight, group)
        if ctx.defer is not None:
            _file(ctx.defer, lambda: _ring_wgrad(dy, x_shard, weight, group))
        elif ctx.needs_input_grad[1]:
            dw = _ring_wgrad(dy, x_shard, weight, group)
        return dx, dw, None, None


class RingLinearReduceScatter(torch.autograd.Function):
    """Row linear, ring GEMM + reduce-scatter: the partial of each sequence chunk,
    h[c] Wᵀ, computed while the running sum of the previous chunk travels.
    Backward: dY all-gathered through the ring, dH[j] = dY_j·W and dW += dY_jᵀ h[j] as
    each shard arrives (deferred: the shards are kept, and W computes dW from them)."""

    @staticmethod
    def forward(ctx, h, weight, group, defer=None):
        ctx.group, ctx.defer = group, defer
        ctx.save_for_backward(h, weight)
        t, _ = size_and_rank(group)
        s = h.shape[SEQ_DIM] // t
        return ring_reduce_scatter(lambda c: F.linear(h[:, c * s:(c + 1) * s], weight),
                                   group)

    @staticmethod
    def backward(ctx, dy_shard):
        h, weight = ctx.saved_tensors
        s = dy_shard.shape[SEQ_DIM]
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        defer = ctx.defer
        acc = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype),
                          device=weight.device) \
            if ctx.needs_input_grad[1] and defer is None else None
        dy = dy_shard.new_empty(h.shape[:-1] + dy_shard.shape[-1:]) \
            if defer is not None else None  # (B, S, n), kept for W

        def consume(j, dyj):
            hj = h[:, j * s:(j + 1) * s]
            if dh is not None:
                dh[:, j * s:(j + 1) * s] = dyj @ weight
            if acc is not None:
                acc.add_(_wgrad(dyj, hj).to(acc.dtype))
            if dy is not None:
                dy[:, j * s:(j + 1) * s] = dyj

        ring_all_gather(dy_shard, ctx.group, consume)
        if defer is not None:
            _file(defer, lambda: _wgrad(dy, h))
        return dh, None if acc is None else acc.to(weight.dtype), None, None


# ------------------------------------------------------- torch's symmetric memory


def symm_mem_available(group) -> bool:
    """Can this group run torch's fused symmetric-memory ops? CUDA, NCCL, and a torch
    that has them (2.5+); never gloo."""
    if not (dist.is_initialized() and torch.cuda.is_available()):
        return False
    if dist.get_backend(group) != "nccl":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return hasattr(torch.ops, "symm_mem") and hasattr(
            torch.ops.symm_mem, "fused_all_gather_matmul") and symm_mem is not None
    except ImportError:
        return False


def enable_symm_mem(group) -> str:
    """Enable symmetric memory on `group` (once); returns its name for the fused ops."""
    import torch.distributed._symmetric_memory as symm_mem

    name = (group or dist.group.WORLD).group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # newer torch enables on first use and deprecates this
        enable(name)
    return name


class SymmMemGatherLinear(torch.autograd.Function):
    """Column linear with torch's ``fused_all_gather_matmul`` (async TP); backward:
    dX by ``fused_matmul_reduce_scatter``, dW from a re-gathered x (deferred: in W)."""

    @staticmethod
    def forward(ctx, x_shard, weight, group, name, defer=None):
        ctx.group, ctx.name, ctx.defer = group, name, defer
        ctx.save_for_backward(x_shard, weight)
        _, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
            x_shard.contiguous(), [weight.t()], SEQ_DIM, name)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        group = ctx.group
        dx = torch.ops.symm_mem.fused_matmul_reduce_scatter(
            dy.contiguous(), weight, "sum", SEQ_DIM, ctx.name)
        dw = None
        if ctx.defer is not None:
            _file(ctx.defer, lambda: _wgrad(dy, all_gather_seq(x_shard, group)))
        elif ctx.needs_input_grad[1]:
            dw = _wgrad(dy, all_gather_seq(x_shard, group))
        return dx, dw, None, None, None


class SymmMemLinearReduceScatter(torch.autograd.Function):
    """Row linear with torch's ``fused_matmul_reduce_scatter``; backward: dY gathered by
    ``fused_all_gather_matmul``, which also computes dH = dY·W (dW deferred: in W)."""

    @staticmethod
    def forward(ctx, h, weight, group, name, defer=None):
        ctx.group, ctx.name, ctx.defer = group, name, defer
        ctx.save_for_backward(h, weight)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            h.contiguous(), weight.t(), "sum", SEQ_DIM, name)

    @staticmethod
    def backward(ctx, dy_shard):
        h, weight = ctx.saved_tensors
        dy, (dh,) = torch.ops.symm_mem.fused_all_gather_matmul(
            dy_shard.contiguous(), [weight], SEQ_DIM, ctx.name)
        dw = None
        if ctx.defer is not None:
            _file(ctx.defer, lambda: _wgrad(dy, h))
        elif ctx.needs_input_grad[1]:
            dw = _wgrad(dy, h)
        return dh, dw, None, None, None


# ------------------------------------------------------- vocab-parallel cross-entropy


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split over the vocabulary: rank r holds columns
    [start, start + V/t) of every token's logits, and no rank ever holds a whole row.

    Per token, with the local logits z_r (N, V/t):

        m   = max over ranks of max(z_r)            all-reduce MAX   (N,) floats
        Σ   = Σ over ranks of Σ exp(z_r − m)        all-reduce SUM   (N,)
        z_y = the label's logit, from its owner     same all-reduce  (N,)
        loss = mean(log Σ − (z_y − m))

    and the gradient is softmax − onehot on the local columns, divided by the number
    of tokens that count (labels ≠ ignore_index), kept from the forward (Megatron-LM's
    ``_VocabParallelCrossEntropy``)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, ignore_index):
        # (N, V/t) in fp32 (fp64 stays fp64, for tests), a copy we may overwrite
        z = logits.clone() if logits.dtype in (torch.float32, torch.float64) \
            else logits.float()
        v_local = z.shape[-1]
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z.sub_(m[:, None])
        valid = labels != ignore_index
        mine = valid & (labels >= vocab_start) & (labels < vocab_start + v_local)
        idx = torch.where(mine, labels - vocab_start, 0).long()
        target = torch.where(mine, z.gather(1, idx[:, None]).squeeze(1), 0.0)
        e = z.exp_()  # in place: z is no longer needed
        sums = torch.stack([e.sum(dim=-1), target])  # one all-reduce for both
        dist.all_reduce(sums, group=group)
        total, target = sums[0], sums[1]
        n_valid = valid.sum().clamp(min=1)
        loss = torch.where(valid, total.log() - target, 0.0).sum() / n_valid
        e.div_(total[:, None])  # softmax, kept for the backward
        ctx.save_for_backward(e, idx, mine, valid, n_valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        p, idx, mine, valid, n_valid = ctx.saved_tensors
        g = p.clone()
        rows = torch.arange(len(idx), device=idx.device)
        g[rows, idx] -= mine.to(g.dtype)
        g.mul_((valid.to(g.dtype) * (grad / n_valid))[:, None])
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 vocab_start: int, group, ignore_index: int = -100
                                 ) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not `ignore_index`.

    Args:
        logits: (..., V/t) this rank's vocabulary columns, any float dtype (fp32 math;
            fp64 stays fp64).
        labels: (...) the full labels (the same on every rank), in [0, V).
        vocab_start: the first vocabulary id this rank's columns hold.
        group: the tensor-parallel group.
    Returns:
        0-d fp32 loss, the same on every rank (0 when every label is ignored).
    """
    return VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1), vocab_start, group,
                                           ignore_index)
