"""The gradient reducers of data parallelism: the `GradSync` handles and their buckets.

A step calls `no_sync()` around every micro-batch's backward but the last and `finish()`
after the last, before clipping. `NaiveAllReduce` does all its work in `finish()`;
`OverlappedAllReduce` starts during the backward:

* **Buckets.** Flat buffers of at most `bucket_elems` elements (`assign_buckets`) in
  reverse registration order, the order the backward produces gradients. A
  post-accumulate-grad hook marks a parameter ready; a bucket's all-reduce starts
  (``async_op=True``, on CUDA from a side stream) when its last parameter is ready. One
  huge bucket starts only after the backward; tiny ones pay 2·(W−1) latencies each.
  DDP puts a small first bucket before its 25 MB ones (`first_bucket_elems`) so that
  communication starts early.
* **Order.** Every rank must issue collectives in the same order (gloo and NCCL match
  them by order), so buckets launch strictly in bucket order. After the first backward
  they are rebuilt in the order the gradients became ready, rank 0's order for all.
* **Gradients as bucket views** (DDP's ``gradient_as_bucket_view``) when the reduction
  dtype is the gradient's: no copy back. With ``reduce_dtype=torch.bfloat16`` the
  buffer holds a cast copy, half the bytes, cast back at `finish()`.
* **Averaging.** Each buffer is divided by W *before* a SUM all-reduce (gloo has no AVG;
  a fp16 sum of W unscaled gradients could overflow). A parameter without a gradient on
  a rank counts as zero there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colossal_lab.parallel import distributed

DEFAULT_BUCKET_ELEMS = 12 * 1024 * 1024
"""ColossalAI's bucket: ``reduce_bucket_size_in_m=12`` million elements (48 MB fp32)."""


def assign_buckets(numels: Sequence[int], cap: int, order: Sequence[int] | None = None,
                   keys: Sequence | None = None, first_cap: int | None = None
                   ) -> list[list[int]]:
    """Group parameters (by index, sizes `numels`) into buckets, walking `order`
    (default: reverse registration) and closing a bucket when the next parameter would
    take it past `cap` elements (`first_cap` for the first bucket) or has another key
    (dtype, device: one buffer holds one kind). A parameter larger than the cap gets a
    bucket of its own. Every parameter lands in exactly one bucket."""
    if cap < 1 or (first_cap is not None and first_cap < 1):
        raise ValueError(f"bucket caps must be >= 1 element, not {cap} / {first_cap}")
    order = list(range(len(numels)))[::-1] if order is None else list(order)
    if sorted(order) != list(range(len(numels))):
        raise ValueError("order must list every parameter index exactly once")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in order:
        limit = first_cap if first_cap is not None and not buckets else cap
        if current and (size + numels[i] > limit
                        or (keys is not None and keys[i] != keys[current[0]])):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numels[i]
    if current:
        buckets.append(current)
    return buckets


# ------------------------------------------------------------------------ the handles


class GradSync:
    """What a training step asks of data parallelism: `no_sync()` around every
    micro-batch's backward but the last, `finish()` after the last backward, before
    clipping and the optimizer. This one does nothing (a single process)."""

    backend: str | None = None

    def finish(self) -> None:
        """Make every rank's gradients the mean over the data-parallel ranks."""

    def no_sync(self):
        """A context in which backward passes accumulate locally, unreduced."""
        return contextlib.nullcontext()

    def detach(self) -> None:
        """Remove what this handle attached to the model (hooks)."""

    def describe(self) -> list[dict]:
        """One row per bucket: index, parameters, elements (empty: no buckets here)."""
        return []


NO_SYNC = GradSync()
"""The handle of a model without data parallelism."""


def _trainable(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: once
    return [n for n, _ in named], [p for _, p in named]


class NaiveAllReduce(GradSync):
    """The reference: after the backward, every gradient in one flat buffer (one per
    dtype), one blocking all-reduce, the mean copied back. `no_sync` needs nothing:
    nothing is reduced before `finish()`."""

    backend = "naive"

    def __init__(self, model: torch.nn.Module, group=None,
                 reduce_dtype: torch.dtype | None = None):
        self.group, self.reduce_dtype = group, reduce_dtype
        self.names, self.params = _trainable(model)
        self.world = distributed.world_size(group)

    def finish(self) -> None:
        kinds: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.params):
            kinds.setdefault(p.dtype, []).append(i)
        for dtype, idx in kinds.items():
            rd = self.reduce_dtype or dtype
            flat = torch.cat([(self.params[i].grad if self.params[i].grad is not None
                               else torch.zeros_like(self.params[i])).reshape(-1)
                              for i in idx])
            flat = flat.div_(self.world).to(rd)  # divided first: one rounding to rd
            if self.world > 1:
                with distributed.collective(f"naive all-reduce of {flat.numel():,} "
                                            "gradient elements"):
                    dist.all_reduce(flat, group=self.group)
            for i, chunk in zip(idx, flat.split([self.params[i].numel() for i in idx])):
                p = self.params[i]
                mean = chunk.view(p.shape).to(p.dtype)
                if p.grad is None:
                    p.grad = mean
                else:
                    p.grad.copy_(mean)

    def describe(self) -> list[dict]:
        return [{"bucket": 0, "params": list(self.names),
                 "elements": sum(p.numel() for p in self.params)}]


@dataclass
class Bucket:
    """One flat buffer of gradients reduced by one all-reduce."""

    params: list[int]
    """Indices of its parameters, in buffer order."""
    buffer: torch.Tensor
    """(elements,) in the reduction dtype."""
    views: bool
    """Are the parameters' gradients views into `buffer` (same dtype)?"""
    pending: int = 0
    """Parameters not yet ready in the current synchronised backward."""
    work: object = None
    """The all-reduce in flight (`async_op=True`), None when not launched."""
    launched: bool = field(default=False)


class OverlappedAllReduce(GradSync):
    """Ours: buckets in reverse-layer order, each all-reduced asynchronously as soon as
    its last gradient is ready in the backward; rebuilt from the first backward's real
    order; `no_sync` for accumulation; optional bf16 reduction. See the module
    docstring for the design."""

    backend = "overlap"

    def __init__(self, model: torch.nn.Module, group=None,
                 bucket_elems: int = DEFAULT_BUCKET_ELEMS,
                 reduce_dtype: torch.dtype | None = None,
                 first_bucket_elems: int | None = None, rebuild: bool = True):
        self.group, self.reduce_dtype = group, reduce_dtype
        self.bucket_elems, self.first_bucket_elems = bucket_elems, first_bucket_elems
        self.names, self.params = _trainable(model)
        if not self.params:
            raise ValueError("the model has no parameter that requires grad")
        self.world = distributed.world_size(group)
        device = self.params[0].device
        # on CUDA the predivide, the cast copies and the launch go to a side stream, so
        # the compute stream runs the next layer's backward without waiting behind them
        # (NCCL's kernels run on NCCL's own stream in any case)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.rebuilt = not rebuild
        self.ready_order: list[str] = []
        """Names in the order their gradients became ready in the last synced step."""
        self._syncing = True
        self._seen: set[int] = set()
        self._order: list[int] = []
        self._next = 0
        self._build(list(range(len(self.params)))[::-1])
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                       for i, p in enumerate(self.params)]

    # -- layout

    def _build(self, order: list[int]) -> None:
        keys = [(p.dtype, p.device) for p in self.params]
        numels = [p.numel() for p in self.params]
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, tuple[int, int]] = {}  # param -> (bucket, offset)
        for b, idx in enumerate(assign_buckets(numels, self.bucket_elems, order, keys,
                                               self.first_bucket_elems)):
            p0 = self.params[idx[0]]
            rd = self.reduce_dtype or p0.dtype
            n = 0
            for i in idx:
                self.bucket_of[i] = (b, n)
                n += numels[i]
            self.buckets.append(Bucket(idx, torch.zeros(n, dtype=rd, device=p0.device),
                                       views=rd == p0.dtype, pending=len(idx)))

    def _slot(self, i: int) -> torch.Tensor:
        b, off = self.bucket_of[i]
        p = self.params[i]
        return self.buckets[b].buffer[off:off + p.numel()].view(p.shape)

    def describe(self) -> list[dict]:
        return [{"bucket": b, "params": [self.names[i] for i in k.params],
                 "elements": k.buffer.numel(), "dtype": str(k.buffer.dtype).split(".")[-1]}
                for b, k in enumerate(self.buckets)]

    def bucket_order(self) -> list[str]:
        """Parameter names in bucket order (the order the all-reduces cover them)."""
        return [self.names[i] for k in self.buckets for i in k.params]

    # -- the backward

    def _ready(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter `i`: its gradient for this backward is
        final."""
        if i not in self._seen:
            self._seen.add(i)
            self._order.append(i)
        b, _ = self.bucket_of[i]
        bucket = self.buckets[b]
        if bucket.launched:
            raise RuntimeError(
                f"{self.names[i]} got a gradient after its bucket's all-reduce was launched: "
                "accumulating over several backward passes needs no_sync() around all but "
                "the last one, and finish() after the last")
        if bucket.views:
            slot = self._slot(i)
            if param.grad is not None and param.grad.data_ptr() != slot.data_ptr():
                slot.copy_(param.grad)  # a fresh gradient: into the bucket, once
                param.grad = slot
        if not self._syncing:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the ready buckets in bucket order: every rank issues the same
        collectives in the same order."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        ctx = contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            ctx = torch.cuda.stream(self.stream)
        with ctx:
            for i in bucket.params:
                p, slot = self.params[i], self._slot(i)
                if p.grad is None:  # no gradient on this rank: a zero contribution
                    slot.zero_()
                    if bucket.views:
                        p.grad = slot
                elif not bucket.views:  # divided in the gradient's dtype, rounded once
                    torch.div(p.grad, self.world, out=slot)
                elif p.grad.data_ptr() != slot.data_ptr():
                    slot.copy_(p.grad)
                    if self.stream is not None:  # freed below, still read by the copy
                        p.grad.record_stream(self.stream)
                    p.grad = slot
            bucket.launched = True
            if self.world > 1:
                if bucket.views:
                    bucket.buffer.div_(self.world)
                with distributed.collective(f"all-reduce of gradient bucket {b}"):
                    bucket.work = dist.all_reduce(bucket.buffer, group=self.group,
                                                  async_op=True)

    def finish(self) -> None:
        """Launch what the backward did not (buckets with a parameter that got no
        gradient), wait for every all-reduce, write the means back (bf16 reduction),
        and after the first step rebuild the buckets in the order the gradients came."""
        if not self._syncing:
            raise RuntimeError("finish() inside no_sync(): leave no_sync for the last "
                               "micro-batch, then call finish()")
        for k in self.buckets[self._next:]:
            k.pending = 0
        self._launch_ready()
        for b, k in enumerate(self.buckets):
            if k.work is not None:
                with distributed.collective(f"all-reduce of gradient bucket {b}"):
                    k.work.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        for k in self.buckets:
            if not k.views:
                for i in k.params:
                    p, mean = self.params[i], self._slot(i)
                    if p.grad is None:
                        p.grad = mean.to(p.dtype)
                    else:
                        p.grad.copy_(mean)
            k.work, k.launched, k.pending = None, False, len(k.params)
        self._next = 0
        self.ready_order = [self.names[i] for i in self._order]
        if not self.rebuilt:
            self._rebuild()
        self._seen, self._order = set(), []

    def _rebuild(self) -> None:
        """Buckets in the order this first step's gradients became ready (parameters
        that got none last), rank 0's order on every rank."""
        seen = set(self._order)
        order = self._order + [i for k in self.buckets for i in k.params if i not in seen]
        if self.world > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.buckets[0].buffer.device)
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            with distributed.collective("broadcast of the bucket order"):
                dist.broadcast(t, src=src, group=self.group)
            order = t.tolist()
        self._build(order)
        self.rebuilt = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate into the gradients (the bucket views) and
        launch nothing; the next backward outside launches every bucket."""
        was, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = was

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class DDPSync(GradSync):
    """torch `DistributedDataParallel`: its reducer waits for the last bucket at the end
    of the backward (an autograd callback), so `finish()` has nothing left to do."""

    backend = "ddp"

    def __init__(self, ddp):
        self.module = ddp

    def no_sync(self):
        return self.module.no_sync()


class FSDP2Sync(GradSync):
    """FSDP2 (`fully_shard`): gradients are reduce-scattered in the backward and waited
    for at its end; each rank holds its shard (a `DTensor`; ``.full_tensor()`` gathers
    it). `no_sync` turns the reduction off (`set_requires_gradient_sync(False)`)."""

    backend = "fsdp2"

    def __init__(self, module):
        self.module = module

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
