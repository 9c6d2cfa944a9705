"""Gradient checks of the parallel switches against one process, run on every rank of a group.

Each check builds the same plain fp32 model on every rank and a copy as the reference,
parallelises the model (switch 5's `tensor_parallel.apply` or switch 8's
`data_parallel.apply`), runs the same batch through both and compares the gradients
parameter by parameter with the rule of `correctness`: ``max|g − g_ref| <= atol +
rtol · max|g_ref|`` in fp32, and for a low-precision reduction twice the error of the
same mean computed in that precision. The tests and chapters 05 and 08 call them
through `distributed.spawn`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Sequence

import torch
import torch.nn as nn

from colossal_lab.config import tiny
from colossal_lab.model import build_model
from colossal_lab.ops.projections import FUSIONS
from colossal_lab.ops.swiglu import qkv_sizes
from colossal_lab.parallel import data_parallel, distributed, tensor_parallel
from colossal_lab.switches import projections
from colossal_lab.testing.correctness import max_abs_err


def hf_split(name: str, tensor: torch.Tensor, cfg) -> dict[str, torch.Tensor]:
    """A full parameter (or gradient) under Hugging Face's names: a fused
    `qkv_proj` / `gate_up_proj` weight split into its parts (views)."""
    for fused, parts in FUSIONS.items():
        if name.endswith(f"{fused}.weight"):
            sizes = (qkv_sizes(cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.head_dim) if fused == "qkv_proj"
                     else (cfg.intermediate_size,) * 2)
            prefix = name[:-len(f"{fused}.weight")]
            return {f"{prefix}{p}.weight": t for p, t in zip(parts, tensor.split(sizes))}
    return {name: tensor}


def full_named(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient: None where it has none) of `model`, whole, under
    Hugging Face's names; the same on every rank (a collective under TP)."""
    tp = tensor_parallel.of(model)
    group = tp.group if tp is not None else None
    out = {}
    for n, p in model.named_parameters():
        if grads:
            if p.grad is None:
                out.update({k: None for k in hf_split(n, p.detach(), model.cfg)})
                continue
            full = tensor_parallel.full_tensor(p, p.grad, group) if tp is not None \
                else p.grad
        else:
            full = tensor_parallel.full_tensor(p, None, group) if tp is not None \
                else p.detach()
        out.update(hf_split(n, full, model.cfg))
    return out


def tensor_parallel_gradient_check(mode: str, *, cfg=None, batch: int = 2,
                                   seq_len: int = 16, fused: bool = False,
                                   atol: float = 1e-6, rtol: float = 1e-5,
                                   seed: int = 0) -> dict:
    """Do the TP model's loss, logits and gradients equal one process's? Run on every
    rank of a group: ``distributed.spawn(tensor_parallel_gradient_check, 2, "ring")``.

    Every rank builds the same plain fp32 model (`cfg`, default `config.tiny()`; with
    `fused`, switch 3's fused projections first) and a copy as the reference;
    `tensor_parallel.apply` shards the model over the whole world in `mode`; both
    compute the loss of one batch (the same tokens on every rank) and its backward. The
    TP gradients are gathered to full shapes (`full_named`) and compared per parameter
    (the fp32 rule above); the loss and the logits (a forward without labels) likewise.

    Returns {"ok", "mode" (the one that ran), "loss", "loss_ref", "loss_err",
    "logits_err", "worst" (parameter), "err", "bound", "params" (how many compared),
    "local_numel" (this rank's parameters), "full_numel"}."""
    e = distributed.env()
    cfg = cfg or tiny()
    torch.manual_seed(seed)
    model = build_model(cfg, e.device)
    if fused:
        projections.apply(model, "eager")
    ref = copy.deepcopy(model)
    tensor_parallel.apply(model, mode)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen).to(e.device)
    x, y = ids[:, :-1], ids[:, 1:]
    loss = model(x, y)
    loss.backward()
    loss_ref = ref(x, y)
    loss_ref.backward()
    with torch.no_grad():
        logits_err = max_abs_err(model(x), ref(x))
    out = {"mode": model.tp.mode, "loss": loss.item(), "loss_ref": loss_ref.item(),
           "loss_err": abs(loss.item() - loss_ref.item()), "logits_err": logits_err,
           "local_numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                              for p in model.parameters())}
    ok = out["loss_err"] <= atol + rtol * abs(loss_ref.item())
    got, want = full_named(model, grads=True), full_named(ref, grads=True)
    out["full_numel"] = sum(t.numel() for t in full_named(ref).values())
    worst_ratio = -1.0
    for name, r in want.items():
        g = got[name]
        err = max_abs_err(g, r)
        bound = atol + rtol * r.abs().max().item()
        ok = ok and err <= bound  # NaN fails
        ratio = err / bound if err == err else float("inf")
        if ratio > worst_ratio:
            worst_ratio = ratio
            out.update(worst=name, err=err, bound=bound)
    out["ok"] = bool(ok and set(got) == set(want))
    out["params"] = len(want)
    return out


def tensor_parallel_gradient_checks(cases: dict) -> dict:
    """`tensor_parallel_gradient_check` for each case ``{name: (mode, keywords)}`` in one
    group of processes (each costs seconds to start): for the tests and chapter 05."""
    return {name: tensor_parallel_gradient_check(mode, **kw)
            for name, (mode, kw) in cases.items()}


def _summation_orders(world: int) -> list[tuple[int, ...]]:
    """The orders in which an all-reduce may add W contributions: every one for W <= 4,
    else the W rotations of a ring and their reverses."""
    if world <= 4:
        return list(itertools.permutations(range(world)))
    ring = [tuple((s + k) % world for k in range(world)) for s in range(world)]
    return ring + [o[::-1] for o in ring]


def _sum_in_order(parts: list[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    acc = parts[order[0]]
    for k in order[1:]:
        acc = acc + parts[k]  # rounded to the parts' dtype at every addition
    return acc


def data_parallel_gradient_check(backend, *, cfg=None, global_batch: int | None = None,
                                 seq_len: int = 16, micro_batches: int = 1, steps: int = 2,
                                 bucket_elems: int = 4096,
                                 first_bucket_elems: int | None = None,
                                 reduce_dtype: torch.dtype | None = None,
                                 atol: float = 1e-6, rtol: float = 1e-5,
                                 seed: int = 0) -> dict:
    """Are the data-parallel gradients those of one process on the whole batch? Run on
    every rank of a group: ``distributed.spawn(data_parallel_gradient_check, 2,
    "overlap")``.

    The reference computes the gradient of the global batch's mean loss, the
    data-parallel model that of this rank's 1/W shard (in `micro_batches` slices, all
    but the last under `no_sync`), then `finish()`; over `steps` steps (the second after
    the buckets are rebuilt), new data each step, no optimizer step. A low-precision
    `reduce_dtype`'s reference error is the largest over the summation orders the
    all-reduce may use (a ring adds each chunk in another order, each rounding
    differently).

    Returns this rank's verdict: {"ok", "worst" (parameter), "err", "bound",
    "err_lowp", "backend", "buckets", "ready_order", "bucket_order"}. Keywords go
    through `functools.partial`, which pickles:
    ``spawn(partial(data_parallel_gradient_check, reduce_dtype=torch.bfloat16), 2,
    "overlap")``."""
    e = distributed.env()
    world = e.world_size
    global_batch = global_batch or 2 * world
    if global_batch % (world * micro_batches):
        raise ValueError(f"global_batch={global_batch} must split into {world} ranks × "
                         f"{micro_batches} micro-batches")
    cfg = cfg or tiny()
    torch.manual_seed(seed)
    model = build_model(cfg, e.device)
    ref = copy.deepcopy(model)
    dp = data_parallel.apply(model, backend, bucket_elems=bucket_elems,
                             reduce_dtype=reduce_dtype, first_bucket_elems=first_bucket_elems)
    sync = data_parallel.of(model)
    gen = torch.Generator().manual_seed(seed + 1)
    out = {"ok": True, "worst": None, "err": 0.0, "bound": 0.0, "err_lowp": None}
    worst_ratio = -1.0
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (global_batch, seq_len + 1), generator=gen)
        ids = ids.to(e.device)
        x, y = ids[:, :-1], ids[:, 1:]
        shard_x, shard_y = x.chunk(world)[e.rank], y.chunk(world)[e.rank]
        pairs = list(zip(shard_x.chunk(micro_batches), shard_y.chunk(micro_batches)))
        for j, (mx, my) in enumerate(pairs):
            ctx = sync.no_sync() if j < len(pairs) - 1 else contextlib.nullcontext()
            with ctx:
                (dp(mx, my) / micro_batches).backward()
        sync.finish()
        ref.zero_grad(set_to_none=True)
        ref(x, y).backward()
        parts = None
        if reduce_dtype is not None and reduce_dtype != torch.float32:
            parts = {}  # each shard's gradient / W, rounded to the reduction dtype
            for xs, ys in zip(x.chunk(world), y.chunk(world)):
                shard = copy.deepcopy(ref)
                shard.zero_grad(set_to_none=True)
                shard(xs, ys).backward()
                for n, p in shard.named_parameters():
                    parts.setdefault(n, []).append((p.grad / world).to(reduce_dtype))
        got = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            g, r = data_parallel.full_grad(got[n]), p.grad
            err = max_abs_err(g, r)
            if parts is not None:
                err_lowp = max(max_abs_err(_sum_in_order(parts[n], o).float(), r)
                               for o in _summation_orders(world))
                bound = 2.0 * err_lowp + atol
            else:
                err_lowp, bound = None, atol + rtol * r.abs().max().item()
            ok = err <= bound  # NaN fails
            out["ok"] = out["ok"] and ok
            ratio = err / bound if ok or err == err else float("inf")
            if ratio > worst_ratio:
                worst_ratio = ratio
                out.update(worst=n, err=err, bound=bound, err_lowp=err_lowp)
        model.zero_grad(set_to_none=True)
    out["buckets"] = sync.describe()
    out["ready_order"] = list(getattr(sync, "ready_order", []))
    out["bucket_order"] = sync.bucket_order() if hasattr(sync, "bucket_order") else []
    out["backend"] = sync.backend
    return out
