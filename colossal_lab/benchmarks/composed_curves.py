"""The finale's loss check: do the switches change what a 300M-parameter LLaMA learns?

A check that can fail needs three things: runs long enough for differences to show
(2,000 steps of a ~325M-parameter model on real text, under one epoch of the corpus), a
measure of how far equally good runs land apart (the naive model from three seeds),
and a change known to be harmful that the check must flag (a positive control).

    naive-sK                bf16 autocast, eager ops, torch's AdamW, seed K = 0, 1, 2
    ours-bf16-sK            every switch, bf16 parameters, fp32 masters and moments
                            (the exact optimizer), seed K: paired with naive-sK
    best-bf16-moments-sK    the same with AdamW's moments in bf16, stochastically rounded
    ours-fp8-sK             every switch, fp8 linears (delayed scaling) over bf16
                            parameters, exact optimizer, seed K
    ours-fp8-fp32-params-s0 the same over fp32 parameters
    control-nearest-s0      bf16 moments rounded to nearest: biased, the rounding the
                            stochastic one exists to avoid
    control-no-masters-s0   bf16 parameters updated in place, no fp32 masters: an update
                            smaller than half a bf16 ulp of its weight is lost

Seeds set the initialisation and the batch order; every run is evaluated on the same
validation batches. The verdict (`verdict`) compares validation losses: the spread is
the range of the naive seeds' losses; a switch "changes nothing we can see" when every
paired difference lies inside the spread, and the check has power only if the controls
land outside it.

    python -m colossal_lab bench composed_curves                 # every run, in order
    python -m colossal_lab bench composed_curves --resume --budget-s 540
    python -m colossal_lab bench composed_curves --jobs 5 --budget-s 500
    python -m colossal_lab bench composed_curves --quick         # tiny model, 6 steps

At this size one run is host-bound (a step's ~4,000 eager launches take longer on the
CPU than its ~2.5 TFLOP on the GPU), so `--jobs N` trains N runs at once, each in its
own process on its own CPU core, sharing the GPU: the runs compute what they compute
alone (same seeds, same kernels), only the wall time changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from colossal_lab.benchmarks.curves import FINAL_WINDOW, Curve, run_curves
from colossal_lab.benchmarks.harness import (
    SUPPRESS,
    Benchmark,
    Invocation,
    flag,
    opt,
    whole_at_least,
)
from colossal_lab.config import SWITCH_SETS, ModelConfig, tiny
from colossal_lab.errors import UsageError
from colossal_lab.kernels import native
from colossal_lab.measure import mfu
from colossal_lab.measure.results import error_line, exception_tail
from colossal_lab.training import data

NAME = "composed_curves"
LOSS_CFG = ModelConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=16, max_position_embeddings=512)
"""The loss-check model: ~325M parameters (24 layers of width 1024, head dim 64), every
width a multiple of 16 so that fp8 applies to every linear."""
LOSS_RUN = dict(seq_len=256, steps=2000, lr=3e-4, max_files=None, log_every=100,
                eval_batches=40)
"""2,000 steps of sequences of 256 tokens, as many a step as one epoch of the corpus
allows (`fit_batch`: the standard library's size depends on the Python installed, so
the batch is chosen where the run happens and recorded); validation on 40 batches."""
EPOCH_SHARE = 0.98
"""The share of one epoch of training sequences the run may use."""
SEEDS = (0, 1, 2)
POLL_S = 1.0
"""How often `run_concurrently` looks for finished runs."""
QUICK_RUN = dict(batch=4, seq_len=32, steps=6, lr=3e-3, max_files=20, log_every=3,
                 eval_batches=1)
QUICK_CFG = tiny().replace(intermediate_size=176)

NAIVE = SWITCH_SETS["bf16"]
EXACT = SWITCH_SETS["best"]
BF16_MOMENTS = SWITCH_SETS["best-bf16-moments"]
FP8_EXACT = SWITCH_SETS["best-fp8"]
FP8_FP32_PARAMS = SWITCH_SETS["best-fp8-fp32-params"]
NEAREST = SWITCH_SETS["best"].replace(extra={"adamw_moments": "bf16-nearest"})
NO_MASTERS = SWITCH_SETS["best"].replace(enable_fused_optimizer=False,
                                         extra={"adamw_masters": False})

CURVES = (
    Curve("naive-s0", NAIVE, seed=0, fields={"role": "naive"}),
    Curve("ours-bf16-s0", EXACT, seed=0, fields={"role": "ours-bf16"}),
    Curve("control-no-masters-s0", NO_MASTERS, seed=0, fields={"role": "control"}),
    Curve("control-nearest-s0", NEAREST, seed=0, fields={"role": "control"}),
    Curve("naive-s1", NAIVE, seed=1, fields={"role": "naive"}),
    Curve("ours-bf16-s1", EXACT, seed=1, fields={"role": "ours-bf16"}),
    Curve("naive-s2", NAIVE, seed=2, fields={"role": "naive"}),
    Curve("ours-bf16-s2", EXACT, seed=2, fields={"role": "ours-bf16"}),
    Curve("best-bf16-moments-s0", BF16_MOMENTS, seed=0, fields={"role": "variant"}),
    Curve("ours-fp8-s0", FP8_EXACT, seed=0, fields={"role": "variant"}),
    Curve("ours-fp8-s1", FP8_EXACT, seed=1, fields={"role": "variant"}),
    Curve("ours-fp8-s2", FP8_EXACT, seed=2, fields={"role": "variant"}),
    Curve("best-bf16-moments-s1", BF16_MOMENTS, seed=1, fields={"role": "variant"}),
    Curve("best-bf16-moments-s2", BF16_MOMENTS, seed=2, fields={"role": "variant"}),
    Curve("ours-fp8-fp32-params-s0", FP8_FP32_PARAMS, seed=0, fields={"role": "variant"}),
)
"""In the order they run: seed pairs first, then the controls' and the variants' seeds."""
QUICK = ("naive-s0", "ours-bf16-s0", "naive-s1", "control-nearest-s0")


def verdict(rows: list[dict]) -> dict:
    """The check's outcome from the curve rows present: the naive seeds' spread (range
    of validation losses), each run's difference from the naive run of its seed, and
    whether it lies inside the spread. `holds`: every ours-bf16 pair inside and every
    control outside (None while a part is missing)."""
    curves = [r for r in rows if r.get("kind") == "loss_curve" and "val_loss" in r]
    naive = {r["seed"]: r["val_loss"] for r in curves if r.get("role") == "naive"}
    out: dict = {"kind": "loss_check", "naive_seeds": sorted(naive)}
    if len(naive) < 2:
        return {**out, "holds": None, "why": "fewer than two naive seeds: no spread"}
    spread = max(naive.values()) - min(naive.values())
    out["spread_val_loss"] = spread
    pairs = {}
    for r in curves:
        if r.get("role") == "naive" or r["seed"] not in naive:
            continue
        diff = r["val_loss"] - naive[r["seed"]]
        pairs[r["setup"]] = {"role": r.get("role"), "seed": r["seed"], "diff": diff,
                             "inside_spread": abs(diff) <= spread}
    out["paired"] = pairs
    ours = [p for p in pairs.values() if p["role"] == "ours-bf16"]
    controls = [p for p in pairs.values() if p["role"] == "control"]
    if ours:
        out["ours_bf16_mean_diff"] = sum(p["diff"] for p in ours) / len(ours)
    out["controls_flagged"] = [name for name, p in pairs.items()
                               if p["role"] == "control" and not p["inside_spread"]]
    complete = len(naive) == len(SEEDS) and len(ours) == len(SEEDS) and controls
    out["holds"] = (all(p["inside_spread"] for p in ours)
                    and any(not p["inside_spread"] for p in controls)) if complete else None
    if not complete:
        out["why"] = "not every seed pair and control has run yet"
    return out


def summary(rows: list[dict]) -> str:
    v = next((r for r in rows if r.get("kind") == "loss_check"), verdict(rows))
    lines = [f"{'run':<24} {'val loss':>9} {'vs naive (same seed)':>21}  inside spread"]
    for r in rows:
        if r.get("kind") != "loss_curve":
            continue
        if "error" in r:
            lines.append(f"{r['setup']:<24} failed: {r['error'][:60]}")
            continue
        p = v.get("paired", {}).get(r["setup"])
        cmp = f"{p['diff']:+.4f}" if p else ""
        inside = ("yes" if p["inside_spread"] else "NO") if p else ""
        lines.append(f"{r['setup']:<24} {r['val_loss']:>9.4f} {cmp:>21}  {inside}")
    if "spread_val_loss" in v:
        lines.append(f"naive seeds' spread (range): {v['spread_val_loss']:.4f}; "
                     f"controls flagged: {v['controls_flagged']}; holds: {v['holds']}")
    return "\n".join(lines)


def run(quick: bool = False, names=None) -> list[dict]:
    """The curves named (default all) on the loss-check model, one row each, and the
    verdict row. `quick`: the tiny model for 6 steps on the CPU."""
    if quick:
        curves = [c for c in CURVES if c.name in (names or QUICK)]
        rows = [_annotated(r, QUICK_CFG, QUICK_RUN)
                for r in run_curves(curves, QUICK_CFG, QUICK_RUN,
                                    reference=curves[0].name)]
        return rows + [verdict(rows)]
    curves = [c for c in CURVES if names is None or c.name in names]
    run_args = {**LOSS_RUN, "batch": fit_batch(LOSS_CFG, LOSS_RUN)}
    rows = [_annotated(r, LOSS_CFG, run_args)
            for r in run_curves(curves, LOSS_CFG, run_args, reference=curves[0].name)]
    return rows + [verdict(rows)]


def train_sequences(cfg: ModelConfig, run_args: dict) -> int:
    """Training sequences of `run_args["seq_len"]` tokens in one epoch of the corpus."""
    return len(data.packed_sequences("train", run_args["seq_len"], cfg.vocab_size,
                                     max_files=run_args["max_files"]))


def fit_batch(cfg: ModelConfig, run_args: dict) -> int:
    """Sequences a step such that `steps` steps stay inside `EPOCH_SHARE` of one epoch
    of the training split; a corpus too small for one sequence a step is an error."""
    seqs = train_sequences(cfg, run_args)
    batch = int(EPOCH_SHARE * seqs) // run_args["steps"]
    if batch < 1:
        raise UsageError(f"the corpus has {seqs} training sequences of "
                         f"{run_args['seq_len']} tokens: too few for "
                         f"{run_args['steps']} steps inside one epoch")
    return batch


def _annotated(row: dict, cfg: ModelConfig, run_args: dict) -> dict:
    """A curve row with its role and the share of an epoch of the corpus it trained on."""
    role = next(c.fields.get("role") for c in CURVES if c.name == row["setup"])
    seqs = train_sequences(cfg, run_args)
    row = {k: v for k, v in row.items() if not k.startswith("rel_diff_vs_")}
    return {**row, "role": role, "epochs": run_args["steps"] * run_args["batch"] / seqs,
            "train_sequences": seqs}


def run_concurrently(names, jobs: int, *, quick: bool = False, budget_s=None,
                     on_row=None) -> list[dict]:
    """The curves named, up to `jobs` at a time, each trained in a child process
    (`--one NAME`); returns their rows in `CURVES` order and hands the rows so far to
    `on_row(rows)` as each run ends. The parent builds the corpus caches and the C++
    norm first, so the children only read them. `budget_s`: start no run that the time
    left would not fit, judged by the slowest run so far. A run that fails becomes a
    row with an `error`; if the parent is stopped, its children are stopped with it."""
    cfg, run_args = (QUICK_CFG, QUICK_RUN) if quick else (LOSS_CFG, LOSS_RUN)
    train_sequences(cfg, run_args)  # the tokenizer and token caches, built once
    data.packed_sequences("val", run_args["seq_len"], cfg.vocab_size,
                          max_files=run_args["max_files"])
    if torch.cuda.is_available():
        native.module()
    queue = [c for c in CURVES if c.name in names]
    running: dict[str, tuple] = {}
    rows: list[dict] = []
    t0, slowest = time.perf_counter(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    c = queue.pop(0)
                    left = budget_s - (time.perf_counter() - t0) if budget_s else None
                    if left is not None and slowest and slowest * 1.1 > left:
                        print(f"[{NAME}] {c.name}: left for a later invocation ({left:.0f}"
                              f" s left, a run takes about {slowest:.0f} s)", flush=True)
                        continue
                    out, log = os.path.join(tmp, c.name + ".json"), \
                        os.path.join(tmp, c.name + ".log")
                    cmd = [sys.executable, "-m", f"colossal_lab.benchmarks.{NAME}", "--one", c.name,
                           "--json-out", out] + (["--quick"] if quick else [])
                    with open(log, "w") as f:
                        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
                    running[c.name] = (c, proc, out, log, time.perf_counter())
                    print(f"[{NAME}] {c.name}: started", flush=True)
                if not running:
                    break
                time.sleep(POLL_S)
                for name, (c, proc, out, log, started) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[name]
                    slowest = max(slowest, time.perf_counter() - started)
                    rows.append(_child_row(c, proc.returncode, out, log))
                    rows.sort(key=lambda r: [k.name for k in CURVES].index(r["setup"]))
                    done = rows[-1] if "error" in rows[-1] else None
                    print(f"[{NAME}] {name}: " + (f"failed: {done['error'][:200]}" if done
                          else f"{time.perf_counter() - started:.0f} s"), flush=True)
                    if on_row is not None:
                        on_row(rows)
        finally:
            for _, proc, *_ in running.values():
                proc.terminate()
            for _, proc, *_ in running.values():
                proc.wait()
    return rows


def _child_row(c: Curve, returncode: int, out: str, log: str) -> dict:
    """The row a child wrote, or an error row with the tail of its output."""
    if returncode == 0 and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    with open(log) as f:
        tail = exception_tail(f.read())
    return {"kind": "loss_curve", "setup": c.name, "seed": c.seed, **c.fields,
            "error": error_line(tail or f"exit status {returncode}")}


def still_current(row: dict) -> bool:
    """Whether a saved run ran what its curve runs now (its precision and AdamW's
    moments): `--resume` keeps it, or runs the curve again. A curve that is gone is
    dropped; the file's `resumed_from` keeps the curves of every earlier invocation."""
    c = next((c for c in CURVES if c.name == row.get("setup")), None)
    if c is None:
        return False
    moments = (c.switches.extra or {}).get("adamw_moments", "fp32")
    return row.get("precision") == c.switches.precision and (
        row.get("optimizer_moments") in (None, moments)
        or not c.switches.enable_fused_optimizer)


def config_of() -> dict:
    return {"model": {k: getattr(LOSS_CFG, k) for k in
                      ("vocab_size", "hidden_size", "intermediate_size",
                       "num_hidden_layers", "num_attention_heads")},
            "n_params": mfu.count_params(LOSS_CFG),
            "run": {**LOSS_RUN, "batch": "fit_batch: the most sequences a step that "
                    f"keep the steps inside {EPOCH_SHARE:.0%} of one epoch"},
            "data": "corpus (Python standard library source)",
            "final_window": FINAL_WINDOW, "seeds": list(SEEDS),
            "curves": {c.name: {"switches": repr(c.switches), "seed": c.seed,
                                **c.fields} for c in CURVES}}


def _execute(call: Invocation) -> None:
    """Run the curves not yet saved (`--resume` keeps the saved ones), saving after
    each, and start none that the time left (`--budget-s`) would not fit, judged by the
    slowest run so far."""
    a = call.args
    if a.one:  # a child of run_concurrently
        row = run(a.quick, (a.one,))[0]
        with open(a.json_out, "w") as f:
            json.dump(row, f)
        return
    names = a.curves or [c.name for c in CURVES]
    if a.quick:
        rows = (run_concurrently(names if a.curves else QUICK, a.jobs, quick=True)
                if a.jobs > 1 else run(True, names))
        print(summary([r for r in rows if r["kind"] == "loss_curve"] + [verdict(rows)]))
        return
    config = config_of()
    kept, config = call.resume(config, missing_ok=True, may_change=("curves",)) \
        if a.resume else ([], config)
    rows = [r for r in kept if r.get("kind") == "loss_curve" and still_current(r)]
    if a.jobs > 1:
        todo = [n for n in names if not any(r["setup"] == n for r in rows)]
        new = run_concurrently(todo, a.jobs, budget_s=a.budget_s, on_row=lambda got: (
            call.save(rows + got + [verdict(rows + got)], config=config, quiet=True)))
        print(summary(rows + new + [verdict(rows + new)]))
        return
    t0, slowest = time.perf_counter(), 0.0
    for c in CURVES:
        if c.name not in names or any(r["setup"] == c.name for r in rows):
            continue
        left = a.budget_s - (time.perf_counter() - t0) if a.budget_s else None
        if left is not None and slowest and slowest * 1.1 > left:
            print(f"[{NAME}] {c.name}: left for a later invocation ({left:.0f} s left, "
                  f"a run takes about {slowest:.0f} s)", flush=True)
            continue
        started = time.perf_counter()
        try:
            rows += run(False, (c.name,))[:-1]
        except Exception as e:  # noqa: BLE001 - the row says why; --resume runs it again
            rows.append({"kind": "loss_curve", "setup": c.name, "seed": c.seed,
                         **c.fields, "error": error_line(f"{type(e).__name__}: {e}")})
            print(f"[{NAME}] {c.name} failed: {rows[-1]['error'][:200]}", flush=True)
        slowest = max(slowest, time.perf_counter() - started)
        call.save(rows + [verdict(rows)], config=config, quiet=True)
    print(summary(rows + [verdict(rows)]))


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny model, 6 steps, not saved",
    options=[opt("--curves", nargs="*", choices=[c.name for c in CURVES],
                 help="only these runs (default all)"),
             flag("resume", help="keep the runs saved in results/<gpu>/composed_curves"
                  ".json and run the others"),
             opt("--budget-s", type=float, default=None,
                 help="start no run that would end after this many seconds"),
             opt("--jobs", type=whole_at_least(1), default=1,
                 help="runs trained at once, each in its own process (default 1)"),
             opt("--one", choices=[c.name for c in CURVES], help=SUPPRESS),
             opt("--json-out", help=SUPPRESS)],
    config=lambda a: config_of(), summary=summary, execute=_execute)
main = BENCH.main


if __name__ == "__main__":
    main()
