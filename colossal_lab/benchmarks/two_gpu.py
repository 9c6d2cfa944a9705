"""What the multi-GPU step benchmarks share.

`sequence_parallel_step`, `pipeline_measured` and `composed_parallel` share: the
refusal of a run that cannot measure, NCCL start with NVLink multicast off, each step's
time on the slower rank, one value from every rank, a case's failure turned into its
row's error, the timed steps, the table, the base switches, and the targets read off
the rows (`threshold`, one verdict; `format_targets`, the lines a chapter prints).

The name says two GPUs; a benchmark says which world sizes it measures (`refusal`'s
``worlds``): TP and the pipeline run at the world size torchrun launched, 2 or 4
(`WORLDS`); `composed_parallel`'s layouts are two-GPU ones (`WORLD`). The quick CPU run spawns as
many gloo processes as asked (`run`'s ``world``; ``--quick --world 4`` on the CLIs).
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from colossal_lab.benchmarks.harness import Invocation, Option, opt
from colossal_lab.config import SWITCH_SETS
from colossal_lab.measure import results, timing
from colossal_lab.measure.results import error_line
from colossal_lab.parallel import distributed

WORLD = 2
"""The default world size: a quick run's processes, and the only one a benchmark that
names no ``worlds`` measures (`composed_parallel`: DP 2, TP 2, PP 2)."""
WORLDS = (2, 4)
"""The world sizes `sequence_parallel_step` (tp = world) and `pipeline_measured` (p =
world) measure: `llama-7b-8l`'s 32 heads and 8 layers split
either way (ZB-V's 2p virtual stages: 8 at p = 4, one layer each)."""
LOSS_RTOL = {"bf16-pure": 5e-3, "bf16": 5e-3, "fp32": 1e-5}
"""Relative tolerance of a case's loss against its baseline's, by precision."""


def _either(worlds) -> str:
    """"2", "2 or 4", "2, 4 or 8": `worlds` in a sentence."""
    worlds = [str(w) for w in worlds]
    return worlds[0] if len(worlds) == 1 else f"{', '.join(worlds[:-1])} or {worlds[-1]}"


def refusal(quick: bool, at_least: bool = False, worlds=(WORLD,)) -> str | None:
    """Why this process cannot run a measured (non-quick) multi-GPU benchmark, or None:
    it needs CUDA and a world size (torchrun's, ``WORLD_SIZE``) among `worlds` (with
    `at_least`, the smallest of them or more)."""
    if quick:
        return None
    n = _either(worlds)
    if not torch.cuda.is_available():
        return (f"needs CUDA: run it on a {n}-GPU node under torchrun --nproc-per-node "
                f"{n}, or pass --quick for the CPU smoke test")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if at_least and world < min(worlds):
        return (f"needs at least {min(worlds)} ranks (world size is {world}): launch "
                f"with torchrun --nproc-per-node {min(worlds)} or more")
    if not at_least and world not in worlds:
        exactly = "exactly " if len(worlds) == 1 else ""
        return (f"needs {exactly}{n} ranks (world size is {world}): launch with "
                f"torchrun --nproc-per-node {n}; no other world size is measured")
    return None


def refuse(name: str, quick: bool, at_least: bool = False, worlds=(WORLD,)) -> None:
    """Exit with status 2 and one line on stderr when `refusal` says no, before anything
    (the NCCL environment, the process group) is touched."""
    why = refusal(quick, at_least, worlds)
    if why is not None:
        print(f"{name}: {why}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def refuse_or_init(name: str, quick: bool, worlds=(WORLD,)) -> None:
    """`refuse`; then, for a measured run, NVLink multicast off and the NCCL group."""
    refuse(name, quick, worlds=worlds)
    if not quick:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on this node
        distributed.init()


def per_rank(value) -> list:
    """`value` of every rank, by rank (`all_gather_object`)."""
    if distributed.world_size() == 1:
        return [value]
    out: list = [None] * distributed.world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def release() -> None:
    """Free what the last case left (its model, optimizer, cached blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(fn, *args, **kw) -> tuple[object, str | None]:
    """(`fn(*args, **kw)`, None) on every rank, or (None, why) on every rank when it
    raised on any (out of memory, a backend that fails at run time): one case's failure
    becomes its row's ``error`` instead of ending the run and losing the other rows. A
    rank stuck in a collective its failed peer never joins waits out the group's
    timeout first."""
    try:
        out, why = fn(*args, **kw), None
    except Exception as exc:  # noqa: BLE001 - recorded in the row, never swallowed
        out, why = None, f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    errors = [w for w in per_rank(why) if w is not None]
    if errors:
        release()
        return None, errors[0]
    return out, None


def timed_steps(step, data, *, warmup: int, iters: int, device) -> dict:
    """Run `step(*data[i])` for `warmup` + `iters` steps, timing the last `iters`; the
    summary of the slower rank's times, the peak memory over the timed steps."""
    timing.reset_peak_memory(device)
    times: list[float] = []
    timing.time_iterations(lambda i: step(*data[i % len(data)]), warmup=warmup,
                           iters=iters, device=device,
                           on_step=lambda i, ms: times.append(ms))
    peak = timing.peak_memory_gib(device)
    times = [round(t, 3) for t in distributed.all_max(times)]
    t = timing._summary(times)
    return {"step_ms": t.median_ms, "step_ms_p10": t.p10_ms, "step_ms_p90": t.p90_ms,
            "steps_timed": t.n, "step_ms_all": times, "peak_mem_gib": peak}


def print_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """A short aligned table of `rows`: `cols` are (header, key, format)."""
    print("  ".join(f"{h:>12}" for h, _, _ in cols))
    for r in rows:
        cells = []
        for _, k, fmt in cols:
            v = r.get(k)
            cells.append(f"{'-' if v is None else format(v, fmt):>12}")
        why = r.get("skipped") or r.get("error")
        print("  ".join(cells) + (f"  ({why})" if why else ""))


def switches_for(quick: bool):
    """The base switches: the best bf16 set without the fused cross-entropy (TP has its
    own loss); on the CPU (`quick`) the same composition in fp32 with the CPU's best
    norm (not Triton under the interpreter)."""

    sw = SWITCH_SETS["best"].replace(enable_fused_cross_entropy=False,
                                     enable_fused_embedding=False)
    if quick:
        sw = sw.replace(precision="fp32", enable_fused_normalization=True)
    return sw


def run(run_ranks, quick: bool = False, world: int = WORLD) -> list[dict]:
    """`run_ranks(quick)` on rank 0's side: with `quick`, `world` gloo CPU processes
    (`distributed.spawn`) and rank 0's rows; otherwise this process is one rank of a
    torchrun job (`refuse_or_init` first) and `world` is not used: the job's is."""
    if quick:
        return distributed.spawn(run_ranks, world, True, timeout_s=300.0)[0]
    return run_ranks(False)


def world_flag(worlds=WORLDS) -> Option:
    """``--world N`` on a benchmark's CLI: the gloo processes of ``--quick``."""
    return opt("--world", type=int, choices=worlds, default=None,
               help=f"with --quick: gloo processes to spawn ({_either(worlds)}; default "
               f"{WORLD}); a measured run's world size is torchrun's --nproc-per-node")


def world_problem(a) -> str | None:
    """The `check` of `world_flag`: ``--world`` without ``--quick`` is a usage error
    (status 2), since torchrun decides a measured run's world."""
    if a.world is not None and not a.quick:
        return (f"--world {a.world} is for --quick; a measured run takes torchrun's "
                f"world: torchrun --nproc-per-node {a.world}")
    return None


def quick_world(call: Invocation) -> int:
    """The quick run's world size, from ``--world`` (`world_flag`)."""
    return call.args.world or WORLD


def on_ranks(call: Invocation, *, quick_rows, rank_rows, show, config,
             worlds=(WORLD,)) -> None:
    """The command line's flow of a step benchmark on several GPUs: refuse a run that
    cannot measure; `--quick`: `show(quick_rows())`; else the NCCL group, the rows of
    `rank_rows()` on every rank, and on rank 0 `show` them and `save` them with
    `config()` (called once the group is up)."""
    name = call.bench.name
    refuse_or_init(name, call.args.quick, worlds)
    if call.args.quick:
        show(quick_rows())
        return
    with distributed.guard(name):
        rows = rank_rows()
    if distributed.is_main():
        show(rows)
        save(name, rows, config(), call.argv)
    distributed.destroy()


def save(name: str, rows: list[dict], config: dict, argv: list[str],
         world: int | None = None) -> None:
    """Rank 0: write the rows into this run's folder (`results.run_slug`, "h200x2" or
    "h200x4") with the torchrun command that made them, at `world` ranks (default: this
    process group's)."""

    world = world or distributed.world_size()
    launch = f"torchrun --nproc-per-node {world} -m colossal_lab bench {name}"
    path = results.save_results(name, rows, config=config, gpu=results.run_slug(world),
                                command=" ".join([launch, *argv]))
    print(f"saved {path}")


# ------------------------------------------------------------------- the targets


def world_of(rows: list[dict], world: int | None = None) -> int | None:
    """`world`, else the first row's ``world`` (None: no row says): the world size a
    benchmark's `targets` holds its rows to."""
    if world is not None:
        return world
    return next((r["world"] for r in rows if r.get("world") is not None), None)


def gap(row: dict | None) -> str | None:
    """Why `row` holds no measurement ("no row", its error, its skip), or None: it ran."""

    if row is None:
        return "no row"
    if row.get("error") is not None:
        return f"error: {error_line(row['error'])[:120]}"
    if row.get("skipped") is not None:
        return f"skipped: {str(row['skipped'])[:120]}"
    return None


def threshold(check: str, target: float, points, *, at_most: bool = False,
              unmeasured=(), empty: str = "no rows", **extra) -> dict:
    """One target's verdict, in the shape of `fused_norm.targets`' checks.

    `points`: ``(at, measured)`` pairs, or ``(at, measured, ok)`` where the row carries
    its own verdict (``loss_ok``); each is held to ``measured >= target`` (with
    `at_most`, ``<=``); a measured None misses. `unmeasured`: ``(at, why)`` of the points
    the check needs whose rows are absent, failed or skipped. `extra`: more keys.

    Returns ``check``, ``target``, ``ok``, ``points`` (how many were measured),
    ``measured`` and ``worst`` (the figure nearest the wrong side of `target`, or past
    it: the one that decides), ``at`` (where), ``failing`` (``{"at", "measured"}`` of
    each miss), ``unmeasured`` (``{"at", "why"}``) and, when ``ok`` is None, ``why``.
    ``ok`` is False as soon as one point misses; else None when a point is unmeasured
    or there is none (`empty` says why then): a check never passes on what it did not
    see; else True."""
    failing, worst, where = [], None, None
    for at, x, *own in points:
        ok = own[0] if own else (x is not None  # NaN compares false: a miss
                                 and (x <= target if at_most else x >= target))
        if not ok:
            failing.append({"at": at, "measured": x})
        if x is not None and (worst is None or (x > worst if at_most else x < worst)):
            worst, where = x, at
    missing = [{"at": at, "why": why} for at, why in unmeasured]
    ok = False if failing else None if missing or not points else True
    out = {"check": check, "target": target, "ok": ok, "points": len(points),
           "measured": worst, "worst": worst, "at": where, "failing": failing,
           "unmeasured": missing, **extra}
    if ok is None:
        out["why"] = "; ".join(f"{m['at']}: {m['why']}" for m in missing) or empty
    return out


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def format_targets(checks: list[dict]) -> str:
    """One short line per check of a benchmark's `targets`: "met" (the deciding figure
    and where), "NOT met" (the worst, then every miss), "not measured" (why, and what
    was measured if anything), or "reported" for a figure held to no target
    (``target`` None). Skipped cases (``skipped``) are named after the line."""
    lines = []
    for c in checks:
        n = c.get("points", 0)
        fig = (f"{'worst ' if n > 1 else ''}{_num(c.get('worst'))} ({c.get('at')}"
               + (f", of {n} points)" if n > 1 else ")"))
        if c.get("why") is not None:
            status = "not measured"
            tail = c["why"] + (f"; measured {fig}" if c.get("worst") is not None else "")
        elif c.get("target") is None:
            status = "reported"
            tail = f"{_num(c.get('measured'))} ({c.get('at')}" + (
                f"; lowest {_num(c.get('worst'))})" if n > 1 else ")")
        elif c["ok"]:
            status, tail = "met", fig
        else:
            status = "NOT met"
            tail = fig + "; failing: " + ", ".join(
                f"{f['at']} ({_num(f['measured'])})" for f in c["failing"])
        skipped = c.get("skipped") or []
        lines.append(f"{status}: {c['check']}: {tail}"
                     + (f"; skipped: {', '.join(s['at'] for s in skipped)}"
                        if skipped else ""))
    return "\n".join(lines)
