"""Switch 7 on 2 or 4 GPUs: the pipeline schedules measured against the simulator.

The schedules run side by side in one run (p = the world size), each next to what
`pipeline_sim`'s simulator predicts for the same p, m and costs."""

from __future__ import annotations

import math

import torch
from torch.distributed import pipelining

from colossal_lab import precision
from colossal_lab.benchmarks import pipeline_sim
from colossal_lab.benchmarks import two_gpu as two
from colossal_lab.benchmarks.harness import Benchmark, opt
from colossal_lab.config import preset
from colossal_lab.errors import UsageError
from colossal_lab.model import build_model
from colossal_lab.parallel import distributed
from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.stages import build_stages
from colossal_lab.switches.apply import apply_switches
from colossal_lab.testing import pipeline_check as check
from colossal_lab.testing.correctness import max_abs_err
from colossal_lab.training import data
from colossal_lab.training.optimizer import make_optimizer

NAME = pipeline_sim.MEASURED
PRESET, SEQ_LEN, MICRO_BATCH = "llama-7b-8l", 4096, 1
P = 2
"""The pipeline depth at two ranks (`composed_parallel`'s PP 2); this benchmark's p is
the world size torchrun launched (`two_gpu.WORLDS`)."""
MS = {2: (4, 8, 16), 4: (8, 16, 32)}
"""Micro-batches per step at each p: m = 2p .. 8p, where the bubbles of 1F1B and ZB-H1
shrink as (p − 1)/(m + p − 1) and ZB-V fills (m >= p)."""
SCHEDULES = ("1f1b", "zb-h1", "zbv", "torch-zbv")
WARMUP, ITERS = 2, 20
"""Untimed steps after the checking step, then timed steps (>= 20)."""
FBW_WARMUP, FBW_REPS = 3, 20
"""`pipeline_sim.measure`'s repetitions for the per-layer F, B, W."""
SIM_LINK = "NVLink 4"
GRAD_RTOL = {"bf16-pure": 2e-2, "bf16": 2e-2, "fp32": 1e-5}
"""Largest gradient difference against 1F1B, over the largest 1F1B gradient."""
TARGET_M = 8
"""The m of the targets: 8 micro-batches per step (4p at p = 2, 2p at p = 4)."""
ZBV_VS_1F1B = {2: 1.1}
"""Target at p = 2: ZB-V's ``speedup_vs_1f1b`` at m = `TARGET_M` at least this."""
BUBBLE_VS_SIM = {2: 0.2}
"""Target at p = 2: ZB-V's measured bubble within this share of the simulator's at m =
`TARGET_M`: ``|bubble − bubble_sim| <= 0.2 · bubble_sim``."""
ZBV_BUBBLE_VS_1F1B = {4: 1 / 3}
"""Target at p = 4: ZB-V's measured bubble at most this share of 1F1B's at m =
`TARGET_M`."""
QUICK = {"preset": "tiny", "layers": 4, "seq_len": 32, "ms": (4,), "warmup": 1,
         "iters": 3, "fbw_warmup": 1, "fbw_reps": 3}
"""The CPU smoke test at p = 2 (`composed_parallel` reads its layers and m); at other p
`quick_sizes` scales layers and m with p."""


def quick_sizes(p: int) -> tuple[int, tuple[int, ...]]:
    """(layers, ms) of the quick run at p: `QUICK`'s at p = 2, scaled by p / 2, so ZB-V
    keeps one layer per virtual stage (2p) and m = 2p micro-batches fill its V."""
    return QUICK["layers"] * p // P, tuple(m * p // P for m in QUICK["ms"])


def bubble(useful_ms_per_rank, step_ms: float) -> float:
    """Idle over total time of a pipelined step: ``1 − Σ useful / (p · step)``."""
    return 1.0 - sum(useful_ms_per_rank) / (len(useful_ms_per_rank) * step_ms)


def useful_per_rank(fbw: list[dict], schedule: str, m: int, num_layers: int,
                    p: int = P) -> list[float]:
    """m · Σ (F + B + W) of the stages each of the `p` ranks holds, ms, from the
    measured per-layer costs (`pipeline_sim.measure` rows)."""

    layer = next(r for r in fbw if r.get("kind") == "measure" and r["part"] == "layer")
    head = next(r for r in fbw if r.get("kind") == "measure" and r["part"] == "head")
    v = schedule in ("zbv", "torch-zbv")
    S = p * (2 if v else 1)
    split = schedule != "1f1b"
    fs, bs, ws = pipeline_sim.stage_costs(layer, head, num_layers, S, split)
    placement = sch.v_placement(p) if v else sch.linear_placement(p)
    out = [0.0] * p
    for s, r in enumerate(placement):
        out[r] += m * (fs[s] + bs[s] + ws[s])
    return out


def _sim(fbw: list[dict], schedule: str, m: int, num_layers: int, p: int = P) -> dict:
    ours = "zbv" if schedule == "torch-zbv" else schedule
    row = pipeline_sim.simulate_rows(fbw, ps=(p,), ms=(m,), schedules=(ours,),
                                     links=(SIM_LINK,), num_layers=num_layers)[0]
    return {"bubble_sim": row["bubble"], "sim_step_ms": row["step_ms"],
            "sim_schedule": ours, "sim_link": SIM_LINK}


# ------------------------------------------------------------------- the schedules


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """`p`'s gradient; zeros when it got none, so the comparison with 1F1B flags it."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _ours(schedule: str, model, sw, mesh, m: int):
    """(step, named grads, holder, optimizer) of our runtime on `schedule`."""

    piped = apply_switches(model, sw.replace(pp_style=schedule, num_microbatches=m), mesh)
    names = piped.model_names()

    def grads():
        return {names[n]: _grad(p) for n, p in piped.named_parameters()}

    opt = make_optimizer(piped)
    return piped.step, grads, piped, opt


def _torch_zbv(model, sw, m: int, device, p: int = P):
    """(step, named grads, holder, optimizer) of torch's ZB-V on our V-placed stages of
    a p-rank pipeline (the whole world), or why it cannot run here."""


    cls = getattr(pipelining, check.TORCH_PEERS["zbv"], None)
    if cls is None:
        return f"torch {torch.__version__} has no {check.TORCH_PEERS['zbv']}"
    model = apply_switches(model, sw)
    S = 2 * p
    placement = sch.v_placement(p)
    rank = distributed.rank()
    mine = build_stages(model, placement, rank)
    pipes = []
    for s, st in sorted(mine.items()):
        pipe = pipelining.PipelineStage(st, s, S, device)
        check._skip_self_warmup(pipe)  # torch 2.11 under gloo: no send to oneself
        pipes.append(pipe)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 target.flatten().long())

    sched = cls(pipes, m, loss_fn=loss_fn)
    holder = torch.nn.ModuleDict({str(s): st for s, st in mine.items()})
    holder.switches = sw
    opt = make_optimizer(holder)
    has_first, owner = 0 in mine, placement[S - 1]

    def step(x, y):
        losses: list = []
        with precision.step_context(sw.precision, device):
            sched.step(*((x,) if has_first else ()),
                       **({"target": y, "losses": losses} if S - 1 in mine else {}))
        loss = torch.stack(losses).float().mean() if losses else \
            torch.zeros((), device=device)
        torch.distributed.broadcast(loss, src=owner)
        return loss

    def grads():
        return {names[n]: _grad(p) for st in mine.values() for names in [st.model_names()]
                for n, p in st.named_parameters()}

    return step, grads, holder, opt


def _build(schedule: str, cfg, sw, mesh, m: int, device):
    """A fresh model (seed 0) under `schedule`: `_ours` or `_torch_zbv`'s answer."""

    torch.manual_seed(0)
    model = build_model(cfg, device)
    if schedule == "torch-zbv":
        return _torch_zbv(model, sw, m, device, mesh["pp"].size())
    return _ours(schedule, model, sw, mesh, m)


def _loss_of(step, batch) -> float:
    return step(*batch).item()


def compare_grads(mine: dict, ref: dict, device) -> tuple[float, float]:
    """(max |g − g_ref| over every parameter, max |g_ref|) where `mine` and `ref` are
    this rank's named gradients under two placements: each parameter's owner under
    `mine` broadcasts it to the world, its owner under `ref` compares."""

    meta = {n: (tuple(g.shape), str(g.dtype).split(".")[-1]) for n, g in mine.items()}
    owners: dict = {}
    for r, got in enumerate(two.per_rank(meta)):
        for n, sd in got.items():
            owners[n] = (r, sd)
    me = distributed.rank()
    diff, scale = 0.0, 0.0
    for n in sorted(owners):
        src, (shape, dtype) = owners[n]
        t = mine[n] if me == src else torch.empty(shape, dtype=getattr(torch, dtype),
                                                  device=device)
        if distributed.world_size() > 1:
            torch.distributed.broadcast(t, src=src)
        if n in ref:
            diff = max(diff, max_abs_err(t, ref[n]))
            scale = max(scale, ref[n].abs().max().item())
    out = torch.tensor([diff, scale], dtype=torch.float64, device=device)
    if distributed.world_size() > 1:
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out[0].item(), out[1].item()


def run_ranks(quick: bool = False, ms=None, schedules=SCHEDULES) -> list[dict]:
    """The benchmark on every rank of a group (already initialised) that is one
    pipeline of p = its world size; returns the rows (the same on every rank)."""

    e = distributed.env()
    p = e.world_size
    q = QUICK if quick else None
    preset_name = q["preset"] if quick else PRESET
    seq_len = q["seq_len"] if quick else SEQ_LEN
    if ms is None and not quick and p not in MS:
        raise UsageError(f"p={p} has no default m (MS has p in {sorted(MS)}): pass --ms")
    ms = ms or (quick_sizes(p)[1] if quick else MS[p])
    warmup, iters = (q["warmup"], q["iters"]) if quick else (WARMUP, ITERS)
    cfg = preset(preset_name)
    if quick:
        cfg = cfg.replace(num_hidden_layers=quick_sizes(p)[0])
    L = cfg.num_hidden_layers
    sw = two.switches_for(quick)
    mesh = distributed.make_mesh(pp=p)
    fbw = pipeline_sim.measure(preset_name, seq_len, MICRO_BATCH, switches=sw,
                               warmup=q["fbw_warmup"] if quick else FBW_WARMUP,
                               reps=q["fbw_reps"] if quick else FBW_REPS, device=e.device)
    fbw = two.per_rank(fbw)[0]  # rank 0's costs for everyone
    two.release()
    rtol = two.LOSS_RTOL.get(sw.precision, 5e-3)
    grtol = GRAD_RTOL.get(sw.precision, 2e-2)
    rows = []
    for m in ms:
        gen = data.random_batches(cfg.vocab_size, m * MICRO_BATCH, seq_len, seed=0,
                                  device=e.device)
        batches = [next(gen) for _ in range(3)]
        ref_grads, base = None, None
        for schedule in schedules:
            row = {"schedule": schedule, "impl": "torch" if schedule.startswith("torch")
                   else "ours", "p": p, "m": m, "chunks": 2 if "zbv" in schedule else 1,
                   "micro_batch": MICRO_BATCH, "batch": m * MICRO_BATCH,
                   "seq_len": seq_len, "preset": preset_name, "layers": L,
                   "precision": sw.precision, "world": e.world_size}
            got, error = two.attempt(_build, schedule, cfg, sw, mesh, m, e.device)
            if isinstance(got, str):
                row["skipped"] = got
                rows.append(row)
                distributed.rank0_print(f"[{NAME}] m {m} {schedule}: skipped, {got}")
                continue
            if error is None:
                step, grads, _, opt = got  # got keeps the stages (holder)
                loss, error = two.attempt(_loss_of, step, batches[0])  # the check
            if error is not None:
                row["error"] = error
                rows.append(row)
                distributed.rank0_print(f"[{NAME}] m {m} {schedule}: failed, {error}")
                got = step = grads = opt = None
                two.release()
                continue
            if schedule == "1f1b":
                ref_grads = {n: g.detach().clone() for n, g in grads().items()}
                ref_loss = loss
            if ref_grads is not None:
                d, scale = compare_grads(grads(), ref_grads, e.device)
                row.update(grad_max_abs_diff=d, grad_max_abs=scale,
                           grad_rel_diff=d / scale if scale else None,
                           grad_ok=bool(scale) and d / scale <= grtol, grad_rtol=grtol,
                           loss=loss, loss_diff=abs(loss - ref_loss),
                           loss_ok=abs(loss - ref_loss) <= rtol * abs(ref_loss))
            opt.step()
            opt.zero_grad(set_to_none=True)

            def train_step(x, y, step=step, opt=opt):
                out = step(x, y)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return out

            t, error = two.attempt(two.timed_steps, train_step, batches, warmup=warmup,
                                   iters=iters, device=e.device)
            if error is not None:
                row["error"] = error
                rows.append(row)
                distributed.rank0_print(f"[{NAME}] m {m} {schedule}: failed, {error}")
                got = step = grads = opt = train_step = None
                two.release()
                continue
            peaks = two.per_rank(t.pop("peak_mem_gib"))
            row.update(t, peak_mem_gib_per_rank=peaks,
                       peak_mem_gib=None if None in peaks else max(peaks))
            row["tokens_per_s"] = row["batch"] * seq_len / (row["step_ms"] / 1e3)
            row["useful_ms_per_rank"] = useful_per_rank(fbw, schedule, m, L, p)
            row["costs_from"] = "pipeline_sim.measure"
            row["bubble"] = bubble(row["useful_ms_per_rank"], row["step_ms"])
            row.update(_sim(fbw, schedule, m, L, p))
            if row["bubble_sim"]:
                row["bubble_vs_sim"] = row["bubble"] / row["bubble_sim"]
            if schedule == "1f1b":
                base = row
            if base is not None:
                row["step_ms_1f1b"] = base["step_ms"]
                row["speedup_vs_1f1b"] = base["step_ms"] / row["step_ms"]
            rows.append(row)
            distributed.rank0_print(
                f"[{NAME}] m {m} {schedule}: {row['step_ms']:.1f} ms (p10 "
                f"{row['step_ms_p10']:.1f}, p90 {row['step_ms_p90']:.1f}), bubble "
                f"{row['bubble']:.1%} (sim {row['bubble_sim']:.1%}), x"
                f"{row.get('speedup_vs_1f1b', 1):.3f} vs 1F1B, grad diff "
                f"{row.get('grad_max_abs_diff', 0):.2e}")
            got = step = grads = opt = train_step = None
            two.release()
    for r in fbw:
        if r.get("kind") == "measure":  # the costs the bubbles came from, on record
            rows.append({"kind": "costs", **{k: v for k, v in r.items()
                                             if not k.endswith("_all") and k != "kind"}})
    return rows


def run(quick: bool = False, world: int = two.WORLD) -> list[dict]:
    """Rank 0's rows (`two_gpu.run`): with `quick`, `world` gloo CPU processes (p).

    On p ranks (``torchrun --nproc-per-node p``, NCCL, NVLink multicast off), `llama-7b-8l`
    at sequence 4096, micro-batch 1, the best bf16 switches but the fused cross-entropy
    (``config.SWITCH_SETS["best"]``; torch's schedules compute the loss from the logits,
    and every schedule gets the same head), for m in `MS` micro-batches (4, 8, 16 at p = 2;
    8, 16, 32 at p = 4) and each of `SCHEDULES`:

    * "1f1b": ours (`pipeline.runtime`), p stages of 8/p layers;
    * "zb-h1": ours, the backward split into B and W, W filling the bubbles;
    * "zbv": ours, two chunks per rank in a V (rank 0 holds stages 0 and 2p − 1);
    * "torch-zbv": ``torch.distributed.pipelining.ScheduleZBVZeroBubble`` on the same
      stages (`stages.Stage`), the V placement and the same loss, or a row saying why not
      (a torch without the class).

    The optimizer runs after each pipelined step (AdamW of `optimizer.make_optimizer`), no
    gradient clipping (it needs a norm across the stages, the same for every schedule).

    **Correctness first.** Every schedule's first step starts from the same weights (seed
    0) on the same batch as 1F1B's; its gradients are compared with 1F1B's, parameter by
    parameter across the ranks (a parameter may live on another rank under the V
    placement: its owner broadcasts it): ``grad_max_abs_diff`` (the largest
    ``max|g − g_1f1b|``), ``grad_rel_diff`` (over the largest ``|g_1f1b|``) and
    ``grad_ok`` (``grad_rel_diff <= GRAD_RTOL[precision]``); the loss likewise
    (``loss_diff``).

    **Timing.** `WARMUP` untimed steps, then `ITERS` timed with CUDA events; a step's time
    is the slower rank's. ``tokens_per_s = m · micro_batch · seq / step``.

    **The bubble.** ``bubble = 1 − Σ_r useful_r / (p · step_ms)``, the simulator's
    definition (idle over total time, `simulate.Timeline.bubble`), with ``useful_r = m ·
    Σ_{stages s on rank r} (F_s + B_s + W_s)``: the per-stage costs
    (`pipeline_sim.stage_costs`) from `pipeline_sim.measure`'s per-layer F, B, W (and the
    undivided F and full backward for 1F1B) of one decoder layer and of the head, timed
    in isolation on rank 0's GPU in this run (``costs_from="pipeline_sim.measure"``); the
    embedding is left out, as in the simulator. Not from the ranks' own traces: the
    runtime's trace is host time and the kernels run asynchronously. ``bubble_sim`` is the
    simulator's bubble for the same schedule, p, m and costs on NVLink 4 (`SIM_LINK`;
    torch's ZB-V against our ZB-V's order), ``sim_step_ms`` its step, ``bubble_vs_sim =
    bubble / bubble_sim``. ``speedup_vs_1f1b = step_ms_1f1b / step_ms`` at the same m.

        torchrun --nproc-per-node 2 -m colossal_lab bench pipeline_measured   # p = 2
        torchrun --nproc-per-node 4 -m colossal_lab bench pipeline_measured   # p = 4
        python -m colossal_lab bench pipeline_measured --quick   # 2 gloo CPU processes
        python -m colossal_lab bench pipeline_measured --quick --world 4   # p = 4 on gloo

    The quick run: the tiny model with 2p layers (ZB-V needs a layer per virtual stage),
    fp32, gloo, m = 2p, a few steps (`quick_sizes`); checks and prints, saves nothing.

    **Targets** (at p = 2 and at p = 4, both at m = 8): `targets(rows)` reads
    them off the rows.
    """
    return two.run(run_ranks, quick, world)


# ---------------------------------------------------------------------- the targets


def _speedup(zbv: dict, base: dict) -> tuple[float | None, str | None]:
    """ZB-V's ``speedup_vs_1f1b`` (its row has none where 1F1B's row failed)."""
    x = zbv.get("speedup_vs_1f1b")
    return (x, None) if x is not None else (None, "no speedup_vs_1f1b")


def _bubble_off_sim(zbv: dict, base: dict) -> tuple[float | None, str | None]:
    """|bubble − bubble_sim| / bubble_sim of ZB-V's row (inf where the simulator says
    no bubble and the run has one)."""
    b, s = zbv.get("bubble"), zbv.get("bubble_sim")
    if b is None or s is None:
        return None, "no bubble or bubble_sim"
    if s <= 0:
        return (0.0 if b == s else math.inf), None
    return abs(b - s) / s, None


def _bubble_vs_1f1b(zbv: dict, base: dict) -> tuple[float | None, str | None]:
    """ZB-V's measured bubble over 1F1B's (None where 1F1B's is not positive)."""
    b, b1 = zbv.get("bubble"), base.get("bubble")
    if b is None or b1 is None:
        return None, "no bubble"
    if b1 <= 0:
        return None, f"1F1B's measured bubble is {b1:.3g}: no ratio to it"
    return b / b1, None


def targets(rows: list[dict], world: int | None = None) -> list[dict]:
    """The targets on these rows at p = `world` (default: the rows' ``world``),
    each a `two_gpu.threshold` verdict; "ZB-V" is ours (``zbv``), torch's is a peer:

    1. (p = 2) ZB-V >= `ZBV_VS_1F1B` [p] x 1F1B at m = `TARGET_M`: ``speedup_vs_1f1b
       = step_ms_1f1b / step_ms``;
    2. (p = 2) ZB-V's measured bubble within 20% of the simulator's at m = `TARGET_M`
       (the targets' m): ``|bubble − bubble_sim| / bubble_sim <= 0.2``, i.e. the
       relative error of the prediction for the same schedule, p, m and costs, at that
       one m; the other m are in the table, not in the check;
    3. (p = 4) ZB-V's measured bubble <= 1/3 of 1F1B's at m = `TARGET_M`: ``bubble_zbv
       / bubble_1f1b`` (not measured where 1F1B's bubble is not positive: the costs
       timed in isolation then overstate the useful time);
    4. (any p) every schedule's gradients equal 1F1B's at every m: its ``grad_ok``,
       measured ``grad_rel_diff`` (max |g − g_1F1B| over max |g_1F1B|), target
       ``grad_rtol``;
    5. (any p) every schedule's first loss equals 1F1B's: its ``loss_ok``, measured
       ``loss_diff / |1F1B's loss|``, target `two_gpu.LOSS_RTOL` of the precision.

    A row absent (no m = 8 in a run of ``--ms``), failed or skipped makes its point
    unmeasured; in 4 and 5 a skipped schedule (torch's ZB-V where torch lacks it) is
    named in ``skipped`` instead: it has nothing to compare."""
    world = two.world_of(rows, world)
    rows = [r for r in rows if "schedule" in r]
    by = {(r["m"], r["schedule"]): r for r in rows}
    zbv, base = by.get((TARGET_M, "zbv")), by.get((TARGET_M, "1f1b"))
    at = f"m = {TARGET_M}"

    def at_target_m(figure):
        """(points, unmeasured) of `figure(zbv, base)` at m = `TARGET_M`."""
        for name, r in (("ZB-V", zbv), ("1F1B", base)):
            if two.gap(r):
                return [], [(at, f"{name} {two.gap(r)}")]
        x, why = figure(zbv, base)
        return ([], [(at, why)]) if why else ([(at, x)], [])

    out = []
    if world in ZBV_VS_1F1B:
        t = ZBV_VS_1F1B[world]
        points, missing = at_target_m(_speedup)
        out.append(two.threshold(
            f"ZB-V >= {t}x 1F1B (step_ms_1f1b / step_ms) at m = {TARGET_M}, p = {world}",
            t, points, unmeasured=missing))
    if world in BUBBLE_VS_SIM:
        t = BUBBLE_VS_SIM[world]
        points, missing = at_target_m(_bubble_off_sim)
        extra = {"bubble": zbv.get("bubble"), "bubble_sim": zbv.get("bubble_sim")} \
            if zbv else {}
        out.append(two.threshold(
            f"ZB-V's bubble within {t:.0%} of the simulator's at m = {TARGET_M}, p = "
            f"{world} (|bubble - bubble_sim| <= {t} bubble_sim)",
            t, points, at_most=True, unmeasured=missing, **extra))
    if world in ZBV_BUBBLE_VS_1F1B:
        t = ZBV_BUBBLE_VS_1F1B[world]
        points, missing = at_target_m(_bubble_vs_1f1b)
        out.append(two.threshold(
            f"ZB-V's bubble <= 1/3 of 1F1B's at m = {TARGET_M}, p = {world} "
            "(bubble_zbv / bubble_1f1b)", t, points, at_most=True, unmeasured=missing))
    precision = next((r["precision"] for r in rows if "precision" in r),
                     two.switches_for(False).precision)
    grad_rtol = next((r["grad_rtol"] for r in rows if "grad_rtol" in r),
                     GRAD_RTOL.get(precision, 2e-2))
    out.append(_agreement(
        rows, by, "grad_ok", lambda r, b: r.get("grad_rel_diff"), grad_rtol,
        "every schedule's gradients equal 1F1B's, every m (max |g - g_1F1B| <= "
        "grad_rtol max |g_1F1B|)"))
    out.append(_agreement(
        rows, by, "loss_ok", lambda r, b: r["loss_diff"] / (abs(b["loss"]) or 1.0),
        two.LOSS_RTOL.get(precision, 5e-3),
        "every schedule's first loss equals 1F1B's, every m (|loss - loss_1F1B| <= "
        "rtol |loss_1F1B|)"))
    return out


def _agreement(rows, by, flag: str, figure, target: float, check: str) -> dict:
    """The verdict of `flag` (``grad_ok``, ``loss_ok``) on every schedule but 1F1B, with
    `figure(row, 1F1B's row)` the measured figure."""
    points, missing, skipped = [], [], []
    for r in rows:
        if r["schedule"] == "1f1b":
            continue  # the reference, against itself
        at, base = f"{r['schedule']} at m = {r['m']}", by.get((r["m"], "1f1b"))
        if r.get("skipped") is not None:
            skipped.append({"at": at, "why": two.gap(r)})
        elif r.get(flag) is None:
            missing.append((at, two.gap(r) or f"1F1B: {two.gap(base) or 'no ' + flag}"))
        else:
            points.append((at, figure(r, base), r[flag]))
    return two.threshold(check, target, points, at_most=True, unmeasured=missing,
                         skipped=skipped)


COLUMNS = [("schedule", "schedule", ""), ("m", "m", "d"), ("step ms", "step_ms", ".1f"),
           ("p10", "step_ms_p10", ".1f"), ("p90", "step_ms_p90", ".1f"),
           ("tok/s", "tokens_per_s", ",.0f"), ("bubble", "bubble", ".3f"),
           ("sim bubble", "bubble_sim", ".3f"), ("vs sim", "bubble_vs_sim", ".2f"),
           ("vs 1F1B", "speedup_vs_1f1b", ".3f"), ("grad diff", "grad_max_abs_diff", ".1e")]


def config_of(p: int = P) -> dict:
    return {"preset": PRESET, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "p": p,
            "ms": list(MS.get(p, ())), "schedules": list(SCHEDULES), "warmup": WARMUP,
            "iters": ITERS, "check_steps": 1, "fbw_reps": FBW_REPS,
            "switches": repr(two.switches_for(False)), "grad_rtol": GRAD_RTOL,
            "clip": None, "sim_link": SIM_LINK,
            "bubble": "1 - sum(useful_ms_per_rank) / (p * step_ms); useful from "
                      "pipeline_sim.measure's per-layer F/B/W (rank 0, isolated)",
            "step_time": "per step the slower rank's (CUDA events), median/p10/p90",
            "nccl_nvls_enable": "0"}


def _schedules(a) -> list[str]:
    """The chosen schedules, 1F1B always among them: the gradients' and speed-ups'
    reference."""
    schedules = a.schedules or SCHEDULES
    return schedules if "1f1b" in schedules else ["1f1b", *schedules]


def _show(rows: list[dict]) -> None:
    two.print_table([r for r in rows if "schedule" in r], COLUMNS)


BENCH = Benchmark(
    NAME, __doc__, prog=f"bench {NAME}",
    description="switch 7 measured: schedules at p = the world size "
    f"({two._either(two.WORLDS)}: torchrun's --nproc-per-node, or --world with --quick)",
    quick_help="tiny model (2p layers), fp32, gloo processes here, not saved",
    options=[two.world_flag(),
             opt("--ms", type=int, nargs="*",
                 help="micro-batches per step (default at p = 2: "
                 f"{' '.join(map(str, MS[2]))}; at p = 4: {' '.join(map(str, MS[4]))})"),
             opt("--schedules", nargs="*", choices=SCHEDULES)],
    check=two.world_problem,
    execute=lambda call: two.on_ranks(
        call, worlds=two.WORLDS, show=_show,
        quick_rows=lambda: run(True, two.quick_world(call)),
        rank_rows=lambda: run_ranks(False, ms=call.args.ms,
                                    schedules=_schedules(call.args)),
        config=lambda: config_of(distributed.world_size())))
main = BENCH.main
