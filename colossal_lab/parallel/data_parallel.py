"""Switch 8, ColossalAI's `overlap_communication`: average the gradients across data-parallel ranks.

**Data parallelism.** W ranks hold the same model; each runs forward and backward on its
own 1/W of the global batch, so each has the gradient of its shard's mean loss, g_r.
The gradient of the global batch's mean loss is their mean, ḡ = (1/W) Σ_r g_r (for equal
shards), and every rank must apply the same ḡ to stay a replica. A ring all-reduce of n
bytes moves 2·(W−1)/W · n bytes through every link (bandwidth-optimal, Patarasuk & Yuan
2009) and pays 2·(W−1) latencies per call.

**The backends** (`BACKENDS`; the reducers are in `grad_sync`). "naive" all-reduces one
flat buffer after the backward: T_fwd + T_bwd + T_comm, nothing overlaps. "overlap",
ours, all-reduces buckets of gradients *while* the backward still runs, so only what is
in flight when the backward ends is exposed. "ddp" is torch's `DistributedDataParallel`
(C++ buckets, the same idea). "fsdp2" is `fully_shard` on every decoder layer, then the
root (ZeRO-3: each rank keeps 1/W of parameters, gradients and optimizer state;
parameters are all-gathered before each layer, gradients reduce-scattered).

**ColossalAI.** `overlap_communication` (on by default in the LowLevelZero and
HybridParallel plugins, for their ZeRO-1/2 optimizer) overlaps the bucketed gradient
reduction (``reduce_bucket_size_in_m=12``) with the backward on a side stream, in
`communication_dtype` when set (our `reduce_dtype`); Gemini's `enable_async_reduce`
makes the reduction of its gradient chunks asynchronous. "overlap" is the replicated
(ZeRO-0) form of the same mechanism, "fsdp2" the sharded one.

References: Li et al. 2020, "PyTorch Distributed: experiences on accelerating data
parallel training", arXiv:2006.15704 (buckets, overlap, rebuild); Sergeev & Del Balso
2018, "Horovod", arXiv:1802.05799 (tensor fusion); Rajbhandari et al. 2020, "ZeRO",
arXiv:1910.02054; Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277; Patarasuk & Yuan
2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from colossal_lab.model import layer_lists
from colossal_lab.parallel import distributed
from colossal_lab.parallel.grad_sync import (
    DEFAULT_BUCKET_ELEMS,
    NO_SYNC,
    DDPSync,
    FSDP2Sync,
    GradSync,
    NaiveAllReduce,
    OverlappedAllReduce,
    assign_buckets,
)

__all__ = ["BACKENDS", "DDP_BUCKET_BYTES", "DEFAULT_BUCKET_ELEMS", "NO_SYNC", "GradSync",
           "NaiveAllReduce", "OverlappedAllReduce", "apply", "assign_buckets", "full_grad",
           "full_param", "of", "resolve", "unwrap"]

BACKENDS = ("naive", "overlap", "ddp", "fsdp2")
"""`apply` values besides True ("overlap", ours) and False / None (no wrapper on one
process, "naive" on several: replicas that never average would silently diverge)."""

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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP's and torch.compile's wrappers: what holds the parameters,
    `switches` and `grad_sync` (the wrapper is only for calling forward)."""
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


def _broadcast_module(model: torch.nn.Module, group) -> None:
    """Every rank starts from rank 0's parameters and buffers (DDP does the same at
    construction): replicas initialised with different seeds would never agree."""
    if distributed.world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad(), distributed.collective("broadcast of the initial parameters"):
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)


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
    return [layer for layers in layer_lists(model) for layer in layers]


def apply(model: torch.nn.Module, value, mesh=None, *,
          bucket_elems: int = DEFAULT_BUCKET_ELEMS, reduce_dtype: torch.dtype | None = None,
          first_bucket_elems: int | None = None) -> torch.nn.Module:
    """Switch 8 on `model`: attach the reduction `value` picks (`resolve`) over the
    mesh's "dp" group (`mesh=None`: the world) as ``model.grad_sync`` (`of(model)` finds
    it), and return the model to call: `model`, or for "ddp" the
    `DistributedDataParallel` wrapping it (`unwrap` gives `model` back).

    Apply it last (the other switches replace what the reduction hooks or wraps) and
    build the optimizer afterwards (FSDP2 shards the parameters); applying again
    detaches the previous hooks. Every backend starts from rank 0's parameters.
    `bucket_elems` sizes the buckets of "overlap" and, in bytes of the gradient dtype,
    DDP's; `reduce_dtype` (torch.bfloat16) reduces in that dtype."""
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


# ------------------------------------------------------------------- whole tensors


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p`'s whole gradient on this rank (gathered from the shards of a FSDP2 `DTensor`)."""
    g = p.grad
    if g is not None and hasattr(g, "full_tensor"):
        g = g.full_tensor()
    return g


def full_param(p: torch.Tensor) -> torch.Tensor:
    """`p` whole on this rank (gathered from the shards of a FSDP2 `DTensor`)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p
