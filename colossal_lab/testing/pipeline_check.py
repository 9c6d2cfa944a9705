"""Pipeline checks: loss and gradients against one process and against torch's own schedules.

Our runtime (`ours`), torch.distributed.pipelining's schedules on the same model, stages
and batch (`torch_peer`), and the library's own path on a pp × dp × tp mesh
(`through_switches`) all run on every rank of a group
(``distributed.spawn(check_schedules, p, cases)``, one process per pipeline rank, gloo on
a CPU) and return this rank's verdict; the tests and chapter 07 call them.

**The rule** (`colossal_lab.testing.correctness`, fp32): per parameter,
``max|g − g_ref| <= atol + rtol · max|g_ref|`` with rtol = 1e-5, atol = 1e-6, and the
same for the loss. The pipeline computes the same sums as one process in another order
(each micro-batch's mean loss, then their mean; the gradient accumulated over m
backwards instead of one), a few units in the last place apart (2^-24 ≈ 6e-8
relative); a missing micro-batch, a gradient sent to the wrong stage, a W run twice or
a loss not divided by m is off by O(|g|).
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.distributed as dist

from colossal_lab.config import ModelConfig, Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.parallel import data_parallel, distributed, grad_norm, tensor_parallel
from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.runtime import PipelineRuntime
from colossal_lab.parallel.pipeline.simulate import Span, Timeline
from colossal_lab.parallel.pipeline.stages import build_stages
from colossal_lab.parallel.pipeline.validate import peak_activations
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.pipeline_parallel import make_schedule
from colossal_lab.testing.correctness import max_abs_err
from colossal_lab.testing.gradient_checks import hf_split

RTOL, ATOL = 1e-5, 1e-6

TORCH_PEERS = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
               "interleaved-zb": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble"}
"""Our name -> torch.distributed.pipelining's schedule class. "interleaved-zb" (torch's
ZB-1P on the interleaved placement, B and W split) has no schedule of ours; the others
are the same algorithms as ours, though not necessarily the same orders."""


def config_for(stages: int, base: ModelConfig | None = None) -> ModelConfig:
    """The tiny model with one decoder layer per virtual stage."""
    return (base or tiny()).replace(num_hidden_layers=stages)


def batch(cfg: ModelConfig, size: int, seq_len: int, seed: int = 1):
    """(input_ids, labels) of random tokens, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (size, seq_len + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _compare(named_grads: dict[str, torch.Tensor | None], ref: torch.nn.Module,
             rtol: float, atol: float) -> dict:
    """The worst parameter of `named_grads` (full-model names) against `ref`'s grads."""
    refs = dict(ref.named_parameters())
    out = {"ok": True, "worst": None, "err": 0.0, "bound": 0.0, "params": 0}
    worst = -1.0
    for name, g in named_grads.items():
        r = refs[name].grad
        if g is None:
            out.update(ok=False, worst=name, err=float("inf"), bound=0.0)
            return out
        err = max_abs_err(g, r)
        bound = atol + rtol * r.abs().max().item()
        ok = err <= bound  # NaN fails
        out["ok"] = out["ok"] and ok
        out["params"] += 1
        ratio = err / bound if err == err else float("inf")
        if ratio > worst:
            worst = ratio
            out.update(worst=name, err=err, bound=bound)
    return out


def _reference(cfg, x, y, seed):
    torch.manual_seed(seed)
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    ref_loss = ref(x, y)
    ref_loss.backward()
    return model, ref, ref_loss.detach()


def ours(name: str, *, p: int, m: int = 4, chunks: int = 2, cfg: ModelConfig | None = None,
         micro_batch: int = 1, seq_len: int = 16, overlap_p2p: bool = True,
         rtol: float = RTOL, atol: float = ATOL, seed: int = 0) -> dict:
    """Our runtime on schedule `name` (`schedules.make`) against one process: this
    rank's verdict {"ok", "worst", "err", "bound", "loss", "ref_loss", "loss_ok",
    "counts", "stages", "params", "trace" (the runtime's, actions as text), "t0" (its
    `step_start`)}."""
    schedule = sch.make(name, p, m, chunks)
    cfg = cfg or config_for(schedule.num_stages)
    x, y = batch(cfg, m * micro_batch, seq_len)
    model, ref, ref_loss = _reference(cfg, x, y, seed)
    rank = distributed.rank()
    stages = build_stages(model, schedule.placement, rank)
    rt = PipelineRuntime(stages, schedule, overlap_p2p=overlap_p2p)
    loss = rt.step(x, y)
    grads = {names[n]: prm.grad for st in stages.values()
             for names in [st.model_names()] for n, prm in st.named_parameters()}
    out = _compare(grads, ref, rtol, atol)
    loss_err = abs(loss.item() - ref_loss.item())
    out.update(name=schedule.name, loss=loss.item(), ref_loss=ref_loss.item(),
               loss_err=loss_err, loss_ok=loss_err <= atol + rtol * abs(ref_loss.item()),
               counts=dict(rt.counts), stages=sorted(stages), rank=rank,
               trace=[(str(a), t0, t1) for a, t0, t1 in rt.trace], t0=rt.step_start,
               grads=grads)
    return out


def _skip_self_warmup(pipe) -> None:
    """torch 2.11's schedules open each stage's links with a dummy send and receive to
    its neighbours, its own rank too when both V stages sit on it (ZB-V), which gloo
    cannot do; later torch replaced that warm-up. Drop the sends and receives to self."""
    warmup = getattr(pipe, "_get_init_p2p_neighbors_ops", None)
    if warmup is not None:
        pipe._get_init_p2p_neighbors_ops = lambda: [
            op for op in warmup() if getattr(op, "group_peer", None) != pipe.group_rank]


def torch_peer(name: str, *, p: int, m: int = 4, cfg: ModelConfig | None = None,
               micro_batch: int = 1, seq_len: int = 16, rtol: float = RTOL,
               atol: float = ATOL, seed: int = 0) -> dict:
    """torch.distributed.pipelining's schedule for our `name` (`TORCH_PEERS`) on the
    same model, stages (`stages.Stage`) and batch: this rank's verdict as `ours`, with
    "counts" of its F, B (full backward), I (input gradient) and W steps, or
    {"skipped": why} when the installed torch lacks the class."""
    from torch.distributed import pipelining  # seconds to import: only for this peer

    cls = getattr(pipelining, TORCH_PEERS[name], None)
    if cls is None:
        return {"skipped": f"torch {torch.__version__} has no {TORCH_PEERS[name]}"}
    chunks = 1 if name == "1f1b" else 2
    S = p * chunks
    placement = sch.v_placement(p) if name == "zbv" else sch.interleaved_placement(
        p, chunks) if chunks > 1 else sch.linear_placement(p)
    cfg = cfg or config_for(S)
    x, y = batch(cfg, m * micro_batch, seq_len)
    model, ref, ref_loss = _reference(cfg, x, y, seed)
    rank = distributed.rank()
    mine = build_stages(model, placement, rank)
    counts: Counter = Counter()
    pipes = []
    for s, st in mine.items():
        pipe = pipelining.PipelineStage(st, s, S, torch.device("cpu"))
        _skip_self_warmup(pipe)
        _count(pipe, counts)
        pipes.append(pipe)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 target.flatten().long())

    sched = cls(pipes[0] if chunks == 1 else pipes, m, loss_fn=loss_fn)
    losses: list = []
    has_first, has_last = 0 in mine, S - 1 in mine
    args = (x,) if has_first else ()
    kw = {"target": y, "losses": losses} if has_last else {}
    sched.step(*args, **kw)
    loss = torch.stack(losses).mean() if has_last else torch.zeros(())
    owner = placement[S - 1]
    dist.broadcast(loss, src=owner)
    grads = {names[n]: prm.grad for st in mine.values()
             for names in [st.model_names()] for n, prm in st.named_parameters()}
    out = _compare(grads, ref, rtol, atol)
    loss_err = abs(loss.item() - ref_loss.item())
    out.update(name=TORCH_PEERS[name], loss=loss.item(), ref_loss=ref_loss.item(),
               loss_err=loss_err, loss_ok=loss_err <= atol + rtol * abs(ref_loss.item()),
               counts=dict(counts), stages=sorted(mine), rank=rank, grads=grads)
    return out


def through_switches(style: str, *, pp: int, dp: int = 1, tp: int = 1,
                     tp_mode: str = "split_gather", m: int = 4,
                     chunks: int | None = None, cfg: ModelConfig | None = None,
                     micro_batch: int = 1, seq_len: int = 16, overlap_p2p: bool = True,
                     dp_backend="naive", rtol: float = RTOL, atol: float = ATOL,
                     seed: int = 0) -> dict:
    """The library's own path on a pp × dp × tp mesh (`distributed.make_mesh`):
    `apply_switches` with ``pp_style=style`` (data parallelism `dp_backend` when dp > 1,
    tensor parallelism in `tp_mode` when tp > 1: "all_reduce" is plain TP, the others
    sequence parallelism), ``model.step`` on this dp rank's shard of the global batch,
    then ``data_parallel.of(model).finish()``; against one process on the global batch,
    the tensor-parallel gradients gathered whole (`tensor_parallel.full_tensor`).
    Returns this rank's verdict as `ours`."""
    mesh = distributed.make_mesh(dp=dp, pp=pp, tp=tp)
    sp = tp > 1 and tp_mode != "all_reduce"
    sw = Switches.naive("fp32").replace(
        pp_style=style, num_microbatches=m, num_model_chunks=chunks,
        overlap_p2p=overlap_p2p, overlap_communication=dp_backend if dp > 1 else False,
        enable_sequence_parallelism=sp, sequence_parallelism_mode=tp_mode if sp else None)
    cfg = cfg or config_for(make_schedule(sw, pp).num_stages)
    x, y = batch(cfg, dp * m * micro_batch, seq_len)
    model, ref, ref_loss = _reference(cfg, x, y, seed)
    piped = apply_switches(model, sw, mesh)
    d = mesh["dp"].get_local_rank()
    loss = piped.step(x.chunk(dp)[d], y.chunk(dp)[d])
    data_parallel.of(piped).finish()
    (loss_mean,) = distributed.all_mean([loss.item()], group=mesh.get_group("dp"))
    names = piped.model_names()
    if tp > 1:  # each rank's shards, gathered whole (a collective over the tp group)
        group = mesh.get_group("tp")
        grads = {}
        for n, prm in piped.named_parameters():
            g = None if prm.grad is None else tensor_parallel.full_tensor(prm, prm.grad, group)
            grads.update(hf_split(names[n], g, cfg) if g is not None else {names[n]: None})
    else:
        grads = {names[n]: prm.grad for n, prm in piped.named_parameters()}
    out = _compare(grads, ref, rtol, atol)
    loss_err = abs(loss_mean - ref_loss.item())
    stores = piped.runtime.stores.values()
    norm = grad_norm.total_norm(piped).item()  # the whole model's, from the pieces
    ref_norm = torch.stack([p.grad.norm() for p in ref.parameters()
                            if p.grad is not None]).norm().item()
    out.update(norm=norm, ref_norm=ref_norm,
               norm_ok=abs(norm - ref_norm) <= atol + rtol * ref_norm)
    out.update(name=f"{piped.schedule.name} pp={pp} dp={dp}" + (f" tp={tp} {tp_mode}"
                                                                 if tp > 1 else ""),
               deferred=sum(getattr(st, "jobs_run", 0) for st in stores),
               loss=loss_mean,
               ref_loss=ref_loss.item(), loss_err=loss_err,
               loss_ok=loss_err <= atol + rtol * abs(ref_loss.item()),
               counts=dict(piped.runtime.counts), stages=sorted(piped.runtime.stages),
               rank=distributed.rank())
    return out


def _count(pipe, counts: Counter) -> None:
    """Count `pipe`'s forward, full backward, input-gradient and weight steps."""
    fwd, bwd, wgt = (pipe.forward_one_chunk, pipe.backward_one_chunk,
                     pipe.backward_weight_one_chunk)

    def forward_one_chunk(*a, **k):
        counts["F"] += 1
        return fwd(*a, **k)

    def backward_one_chunk(*a, full_backward: bool = True, **k):
        counts["B" if full_backward else "I"] += 1
        return bwd(*a, full_backward=full_backward, **k)

    def backward_weight_one_chunk(*a, **k):
        counts["W"] += 1
        return wgt(*a, **k)

    pipe.forward_one_chunk = forward_one_chunk
    pipe.backward_one_chunk = backward_one_chunk
    pipe.backward_weight_one_chunk = backward_weight_one_chunk


def check_schedules(cases: dict) -> dict:
    """Run on every rank of a group: each case ``{key: ("ours" | "torch" | "switches",
    name, keywords)}`` through `ours`, `torch_peer` or `through_switches` (which takes
    its own pp and dp), in one group of processes (each costs seconds to start).
    Returns {key: this rank's verdict}; a torch case whose schedule we also ran gets
    "vs_ours", the largest difference between its gradients and ours."""
    p = distributed.world_size()
    out = {}
    for key, (who, name, kw) in cases.items():
        if who == "switches":
            out[key] = through_switches(name, **kw)
        else:
            out[key] = (ours if who == "ours" else torch_peer)(name, p=p, **kw)
    mine = {name: out[k]["grads"] for k, (who, name, _) in cases.items()
            if who == "ours" and "grads" in out[k]}
    for k, (who, name, _) in cases.items():  # torch's gradients against ours, directly
        if who == "torch" and name in mine and "grads" in out[k]:
            theirs = out[k]["grads"]
            out[k]["vs_ours"] = max(max_abs_err(theirs[n], g) for n, g in mine[name].items())
    for v in out.values():
        v.pop("grads", None)  # tensors stay in the process
    return out


def measured_timeline(name: str, p: int, verdicts: list[dict], m: int = 4,
                      chunks: int = 2):
    """A `simulate.Timeline` of what the ranks of a gloo run really did: each rank's
    trace (from `ours`, one verdict per rank) on the clock they share, from the first
    rank's start, in milliseconds; for `simulate.plot_gantt`."""
    schedule = sch.make(name, p, m, chunks)
    start = min(v["t0"] for v in verdicts)
    rows = []
    for r, v in enumerate(verdicts):
        shift = v["t0"] - start
        rows.append(tuple(Span(r, sch.Action.parse(a), (shift + t0) * 1e3,
                               (shift + t1) * 1e3) for a, t0, t1 in v["trace"]))
    return Timeline(schedule, tuple(rows), {"measured": "host clock, ms"},
                    peak_activations(schedule))
