"""The gradient norm of a model split over ranks, for clipping (`train.make_step`).

Clipping scales every gradient by c = min(1, max_norm / ‖g‖), ‖g‖ the 2-norm of the
*whole* model's gradient, which no rank holds once the model is split. Under tensor
parallelism a sharded weight's squares add over the tp group, while a replicated
parameter (the norms' scales) counts once, 1/t on each rank, and so does a key/value
head replicated on several ranks (`tp_shards.Shard`). Under pipeline parallelism the
squares add over the pp group. After data parallelism's reduction every rank holds the
same gradient: nothing to add. Clipping by each rank's own norm would give the replicas
of a parameter different coefficients, and they would drift apart; Megatron-LM and
ColossalAI reduce the squares the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colossal_lab.parallel import distributed, tensor_parallel


def _tp_state(model):
    """Switch 5's state of `model` or of its pipeline stages (None without TP)."""
    tp = tensor_parallel.of(model)
    if tp is None and hasattr(model, "stages"):  # a PipelineModel: its stages know
        tp = next((st.tp for st in model.stages.values() if getattr(st, "tp", None)),
                  None)
    return tp if tp is not None and tp.size > 1 else None


def _pp_group(model):
    """The pipeline group of a `PipelineModel` with more than one rank, else None."""
    runtime = getattr(model, "runtime", None)
    if runtime is None or runtime.schedule.num_ranks == 1:
        return None
    return runtime.group


def is_split(model) -> bool:
    """Does `model`'s gradient norm need the other ranks (TP or PP; not a DTensor
    plan, whose gradients `torch.nn.utils.clip_grad_norm_` handles itself)?"""
    tp = _tp_state(model)
    if tp is not None and tp.mode == "dtensor":
        return False
    return tp is not None or _pp_group(model) is not None


def _weighted(model, tp) -> list[tuple[torch.Tensor, float]]:
    """(gradient or a slice of it, weight) for this rank's share of Σ g²."""
    out = []
    t, r = (tp.size, tp.rank) if tp is not None else (1, 0)
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        shard = getattr(p, "_tp_shard", None)
        if t == 1:
            out.append((g, 1.0))
        elif shard is None:  # replicated over the tp group: the same on every rank
            out.append((g, 1.0 / t))
        else:
            off = 0
            for piece in shard.pieces[r]:
                holders = sum(piece in shard.pieces[q] for q in range(t))
                n = piece[1] - piece[0]
                out.append((g.narrow(shard.dim, off, n), 1.0 / holders))
                off += n
    return out


@torch.no_grad()
def total_norm(model) -> torch.Tensor:
    """‖g‖₂ of the whole model's gradient (a 0-dim fp32 tensor on the gradients'
    device), the same on every rank: this rank's share of Σ g² (`_weighted`),
    all-reduced over the tp group and the pp group. A collective: every rank of both
    groups must call it, after the backward (and after data parallelism's reduction)."""
    tp = _tp_state(model)
    parts = _weighted(model, tp)
    device = next(model.parameters()).device
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for w in sorted({w for _, w in parts}):
        gs = [g for g, wg in parts if wg == w]
        norms = torch._foreach_norm(gs, 2, dtype=torch.float32)
        sq = sq + w * torch.stack(norms).pow(2).sum()
    for group in (tp.group if tp is not None else None, _pp_group(model)):
        if group is not None and dist.get_world_size(group) > 1:
            with distributed.collective("gradient norm"):
                dist.all_reduce(sq, group=group)
    return sq.sqrt()


@torch.no_grad()
def clip_(model, optimizer, max_norm: float) -> torch.Tensor:
    """Clip `model`'s gradients to `max_norm` by the whole model's norm; returns it.
    Our fused AdamW takes the coefficient for its next step (`set_clip_coefficient`);
    other optimizers get the gradients scaled here."""
    total = total_norm(model) if is_split(model) else None
    if total is None:
        if hasattr(optimizer, "clip_grad_norm_"):
            return optimizer.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if hasattr(optimizer, "set_clip_coefficient"):
        optimizer.set_clip_coefficient(coef)
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
