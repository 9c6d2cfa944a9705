"""Switch 8, ColossalAI's `overlap_communication` (`enable_async_reduce` in Gemini):
average the gradients across data-parallel ranks *while* the backward still runs.

**Data parallelism.** W ranks hold the same model; each runs forward and backward on its
own 1/W of the global batch, so each has the gradient of its shard's mean loss, g_r.
The gradient of the global batch's mean loss is their mean, ḡ = (1/W) Σ_r g_r (for equal
shards), and every rank must apply the same ḡ to stay a replica. One all-reduce of all
the gradients per step makes it: a ring all-reduce of n bytes moves 2·(W−1)/W · n bytes
through every link (bandwidth-optimal, Patarasuk & Yuan 2009) and pays 2·(W−1) latencies
per call.

**naive** (`NaiveAllReduce`): after the backward, flatten every gradient into one
buffer, all-reduce it, copy the mean back. Simple, one call, but nothing overlaps: the
step is T_fwd + T_bwd + T_comm, and a full flat copy of the gradients exists for a moment.

**ours, overlapped** (`OverlappedAllReduce`): the gradient of the last layers is final
long before the backward reaches the first ones. Parameters are grouped into *buckets*
(flat buffers of at most `bucket_elems` elements, in reverse registration order: the
order the backward produces them, lm_head first). A post-accumulate-grad hook on each
parameter marks it ready; when a bucket's last parameter is ready its all-reduce is
launched asynchronously (`async_op=True`; on CUDA from a side stream) and the backward
goes on computing the earlier layers. `finish()` waits for the buckets in flight before
clipping and the optimizer. Communication starts when the first bucket fills (t_1 into
the backward) and the last bucket cannot start before the backward ends, so the step
is about T_fwd + max(T_bwd + T_comm(last bucket), t_1 + T_comm): only what is still
in flight when the backward ends is exposed.

* **Bucket size** trades overlap against per-call cost: one huge bucket starts only at
  the end of the backward (no overlap, = naive); tiny buckets pay 2·(W−1) latencies
  each. ColossalAI reduces 12M-element buckets (`reduce_bucket_size_in_m=12`), torch
  DDP 25 MB ones (`bucket_cap_mb=25`). A bucket launches when its *last* parameter is
  ready, so the first bucket decides when communication starts: DDP makes its first
  bucket small (1 MB) for that reason; `first_bucket_elems` does the same here.
* **Order.** Collectives must be issued in the same order on every rank (gloo and NCCL
  match them by order: a mismatch hangs or mixes buffers), so buckets launch strictly
  in bucket order, a ready bucket waiting for the ones before it. The reverse
  registration order is only a guess at the backward's order (q/k/v, gate/up come out
  in the order autograd visits them): after the first backward the buckets are rebuilt
  from the order the gradients actually became ready, rank 0's order broadcast to all
  (DDP's "bucket rebuild" does the same).
* **no_sync** for gradient accumulation: inside `no_sync()` the hooks record but launch
  nothing; gradients accumulate locally; the last micro-batch's backward launches the
  buckets. With m micro-batches this reduces once instead of m times.
* **Where gradients live.** When the reduction dtype is the gradient's, a gradient is a
  *view* into its bucket's buffer (DDP's ``gradient_as_bucket_view=True``): the hook
  copies a fresh gradient in once and re-points ``param.grad`` at its slice, later
  micro-batches accumulate straight into the buffer, and the reduced mean needs no copy
  back; the gradients cost no memory beyond the buffers. After the optimizer's
  ``zero_grad(set_to_none=True)`` the next backward makes a fresh gradient, copied in
  once again (one copy per step; ``set_to_none=False`` keeps the views). With another
  reduction dtype (`reduce_dtype=torch.bfloat16`) the buffer holds a cast copy, reduced
  in bf16 (half the bytes), and the mean is cast back into the gradients at `finish()`.
* **Averaging.** Each buffer is divided by W *before* a SUM all-reduce (gloo has no
  AVG; a fp16 sum of W unscaled gradients could overflow), as DDP's default hook does.
* A parameter that received no gradient on a rank counts as zero there; after
  `finish()` every parameter has a gradient, the same on every rank.

**Peers, wired in as backends:** torch `DistributedDataParallel` ("ddp": C++ buckets,
the same idea, `bucket_cap_mb`, gradients as bucket views) and FSDP2 ("fsdp2":
`fully_shard` on every decoder layer, then the root; ZeRO-3: parameters sharded,
all-gathered before each layer (prefetching the next), gradients reduce-scattered,
each rank keeps 1/W of parameters, gradients and optimizer state).

**ColossalAI.** `overlap_communication` (on by default in the LowLevelZero and
HybridParallel plugins, for their ZeRO-1/2 optimizer) overlaps the bucketed gradient
reduction (``reduce_bucket_size_in_m=12``) with the backward on a side stream, in
`communication_dtype` when set (our `reduce_dtype`); `enable_async_reduce` (Gemini)
makes the reduction of gradient chunks asynchronous. Ours is the replicated (ZeRO-0)
form of the same mechanism; "fsdp2" is the sharded one.

References: Li et al. 2020, "PyTorch Distributed: experiences on accelerating data
parallel training", arXiv:2006.15704 (buckets, overlap, rebuild); Sergeev & Del Balso
2018, "Horovod", arXiv:1802.05799 (tensor fusion); Rajbhandari et al. 2020, "ZeRO",
arXiv:1910.02054; Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277; Patarasuk & Yuan
2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colossal_lab.parallel import distributed

BACKENDS = ("naive", "overlap", "ddp", "fsdp2")
"""`apply` values besides True ("overlap", ours) and False / None (no wrapper on one
process, "naive" on several: replicas that never average would silently diverge)."""

DEFAULT_BUCKET_ELEMS = 12 * 1024 * 1024
"""ColossalAI's bucket: ``reduce_bucket_size_in_m=12`` million elements (48 MB fp32)."""

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""torch DDP's default ``bucket_cap_mb=25``, for comparison."""


def resolve(value, world: int) -> str | None:
    """The backend `value` means on a data-parallel group of `world` ranks: None (no
    reduction: one rank), or one of `BACKENDS`."""
    if value is True:
        return "overlap"
    if value is False or value is None:
        return None if world == 1 else "naive"
    if value in BACKENDS:
        return value
    raise ValueError(f"data parallelism={value!r}; choose True, False or one of {BACKENDS}")


# ---------------------------------------------------------------------- bucket layout


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


# ------------------------------------------------------------------- the handles


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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP's and torch.compile's wrappers: what holds the parameters,
    `switches` and `grad_sync` (the wrapper is only for calling forward)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def of(model: torch.nn.Module) -> GradSync:
    """The `GradSync` applied to `model` or to the model it wraps (`apply`), `NO_SYNC`
    for a plain model."""
    return getattr(unwrap(model), "grad_sync", None) or NO_SYNC


def _trainable(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: once
    return [n for n, _ in named], [p for _, p in named]


def _broadcast_module(model: torch.nn.Module, group) -> None:
    """Every rank starts from rank 0's parameters and buffers (DDP does the same at
    construction): replicas initialised with different seeds would never agree."""
    if distributed.world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad(), distributed.collective("broadcast of the initial parameters"):
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)


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


# ------------------------------------------------------------------------ the switch


def _dp_group(mesh):
    """The data-parallel process group: the mesh's "dp" dim, else the whole world."""
    if mesh is None:
        return None
    if "dp" not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"the mesh has dims {mesh.mesh_dim_names}; data parallelism needs "
                         "a 'dp' dim (distributed.make_mesh makes one)")
    return mesh.get_group("dp")


def _reduce_in_dtype(state, bucket):
    """A DDP communication hook, `state` = (group, dtype): the bucket reduced in
    `dtype`, the mean written back. (torch's own `bf16_compress_hook` does this too,
    but refuses every backend but NCCL.)"""
    group, dtype = state
    buffer = bucket.buffer()
    low = buffer.div_(dist.get_world_size(group)).to(dtype)  # divided, then rounded once
    fut = dist.all_reduce(low, group=group, async_op=True).get_future()

    def back(fut):
        return buffer.copy_(fut.value()[0])

    return fut.then(back)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from colossal_lab.model import layer_lists

    return [layer for layers in layer_lists(model) for layer in layers]


def apply(model: torch.nn.Module, value, mesh=None, *,
          bucket_elems: int = DEFAULT_BUCKET_ELEMS, reduce_dtype: torch.dtype | None = None,
          first_bucket_elems: int | None = None) -> torch.nn.Module:
    """Switch 8 on `model`: attach the gradient reduction `value` picks (`resolve`) over
    the mesh's "dp" group (`mesh=None`: every rank of the world) as ``model.grad_sync``
    (a `GradSync`: `finish()`, `no_sync()`; `of(model)` finds it), and return the
    model to call in the step: `model` itself, or for "ddp" the
    `DistributedDataParallel` wrapping it (its forward prepares DDP's reducer; `unwrap`
    gives back `model`, which keeps the parameters, ``switches`` and ``grad_sync``).

    Apply it last, after every other switch (they replace parameters and modules that
    the reduction hooks or wraps), and build the optimizer afterwards (FSDP2 replaces
    the parameters by sharded ones). Applying again detaches the previous hooks.
    "naive", "overlap" and "fsdp2" first broadcast rank 0's parameters (DDP does it
    itself). `bucket_elems` sizes the buckets of "overlap" and, in bytes of the
    gradient dtype, DDP's `bucket_cap_mb`; `reduce_dtype` (torch.bfloat16) reduces in
    that dtype ("fsdp2": `MixedPrecisionPolicy(reduce_dtype=...)`, "ddp": a
    communication hook, `_reduce_in_dtype`)."""
    if isinstance(of(model), DDPSync):  # applied again: the plain model, unwrapped
        model = unwrap(model)
    inner = unwrap(model)
    group = _dp_group(mesh)
    world = distributed.world_size(group)
    backend = resolve(value, world)
    if reduce_dtype is not None and reduce_dtype not in (torch.bfloat16, torch.float16,
                                                        torch.float32):
        raise ValueError(f"reduce_dtype={reduce_dtype}; choose torch.bfloat16, "
                         "torch.float16, torch.float32 or None (the gradient's dtype)")
    if isinstance(bucket_elems, bool) or not isinstance(bucket_elems, int) \
            or bucket_elems < 1:
        raise ValueError(f"bucket_elems={bucket_elems!r} must be a whole number >= 1")
    previous = getattr(inner, "grad_sync", None)
    if isinstance(previous, FSDP2Sync):
        raise RuntimeError("fully_shard turned this model's parameters into shards; build "
                           "a fresh model to apply another data-parallel backend")
    if previous is not None:
        previous.detach()
        inner.grad_sync = None
    if backend is None:
        return model
    if backend in ("ddp", "fsdp2") and not dist.is_initialized():
        raise RuntimeError(f"{backend!r} needs torch.distributed, even on one process: "
                           "launch with torchrun and call colossal_lab.parallel.distributed.init()")
    if backend != "ddp":
        _broadcast_module(inner, group)
    if backend == "naive":
        inner.grad_sync = NaiveAllReduce(inner, group, reduce_dtype)
        return model
    if backend == "overlap":
        inner.grad_sync = OverlappedAllReduce(inner, group, bucket_elems, reduce_dtype,
                                              first_bucket_elems)
        return model
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device = next(inner.parameters()).device
        elem = next(inner.parameters()).element_size()
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group, bucket_cap_mb=bucket_elems * elem / 2**20,
            gradient_as_bucket_view=True)
        if reduce_dtype is not None and reduce_dtype != next(inner.parameters()).dtype:
            ddp.register_comm_hook((group or dist.group.WORLD, reduce_dtype),
                                   _reduce_in_dtype)
        inner.grad_sync = DDPSync(ddp)
        return ddp
    # fsdp2: every decoder layer is a unit (all-gathered before it runs, resharded after,
    # the next one prefetched), the root holds the rest (embeddings, final norm, head)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh["dp"] if mesh is not None else distributed.make_mesh()["dp"]
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in _decoder_layers(inner):
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(inner, mesh=dp_mesh, mp_policy=policy)
    inner.grad_sync = FSDP2Sync(inner)
    return model


# ---------------------------------------------------------------- correctness check


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p`'s whole gradient on this rank (gathered from the shards of a FSDP2 `DTensor`)."""
    g = p.grad
    if g is not None and hasattr(g, "full_tensor"):
        g = g.full_tensor()
    return g


def full_param(p: torch.Tensor) -> torch.Tensor:
    """`p` whole on this rank (gathered from the shards of a FSDP2 `DTensor`)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


