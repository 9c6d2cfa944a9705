"""Re-time steps already recorded under `results/<gpu>/` and say whether they moved.

A change that should not change behaviour (a refactor of how switches are applied,
say) is checked where it matters: the same `Setup`s, timed again on the same
GPU, against the rows recorded before it. Each row of `spot_check.json` holds the
recorded median and p10-p90, the new ones, the ratio of the medians and the verdict of
`compare.versus`: "level" when each median lies inside the other's p10-p90 range.

    python -m colossal_lab bench spot_check                       # the default CHECKS
    python -m colossal_lab bench spot_check --checks precision_step:fp8-delayed
    python -m colossal_lab bench spot_check --old-tree ../old --old-commit OLD_SHA \
        --rounds 2 --checks composed:hf-liger composed:ours-bf16

With `--old-tree`, the recorded rows are not used: each setup is timed with the code of
another checkout (each child process imports `colossal_lab` from that folder) and with
this one, in turns, in the same run, so a drift of the card's clock or power between
runs does not pass for a change of the code. Each row then holds one round of one check:
the old and the new timing, their ratio and the verdict.

What the default checks exercise: fp8 linears (precision applied last, delayed
scaling), bf16 parameters (bf16-pure: the parameters cast, the buffers not), selective
recomputation (checkpointed layers wrapped in place), fused projections with our
SwiGLU (the linears restacked in place).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from colossal_lab.benchmarks import (
    baseline,
    checkpointing,
    composed,
    flash_attention_step,
    fused_norm_step,
    fused_qkv,
    precision,
)
from colossal_lab.benchmarks.harness import Benchmark, flag, opt
from colossal_lab.benchmarks.steps import format_row, in_child, run_setups
from colossal_lab.errors import UsageError
from colossal_lab.measure import compare
from colossal_lab.measure.results import load_results

SOURCES = {
    "baseline": baseline,
    "checkpointing": checkpointing,
    "checkpointing_7b": checkpointing,
    "composed": composed,
    "flash_attention_step": flash_attention_step,
    "fused_norm_step": fused_norm_step,
    "fused_qkv_step": fused_qkv,
    "precision_step": precision,
}
"""Results file -> the module whose `SETUPS` made its rows."""

CHECKS = ("precision_step:fp8-delayed", "precision_step:bf16-pure",
          "checkpointing:ckpt-selective", "fused_qkv_step:proj-fused-triton")


def find(check: str, gpu: str | None = None):
    """("file:setup") -> (the Setup, its recorded row, the recorded file's provenance)."""

    name, _, setup_name = check.partition(":")
    if name not in SOURCES or not setup_name:
        raise UsageError(f"check {check!r}: write FILE:SETUP with FILE one of "
                         f"{sorted(SOURCES)}")
    setups = {s.name: s for s in SOURCES[name].SETUPS}
    recorded = load_results(name, gpu=gpu)
    rows = {r["setup"]: r for r in recorded.rows if "error" not in r}
    if setup_name not in setups or setup_name not in rows:
        raise UsageError(f"check {check!r}: {name} has setups {sorted(setups)} and "
                         f"recorded rows {sorted(rows)}")
    return setups[setup_name], rows[setup_name], recorded.provenance


def spot_row(check: str, recorded: dict, provenance: dict, now: dict) -> dict:
    """One results row: the recorded and the new timing of one setup, and the verdict."""
    out = {"check": check, "setup": recorded["setup"], "recorded_commit":
           provenance.get("git_sha"), "preset": recorded["preset"],
           "batch": recorded["batch"], "seq_len": recorded["seq_len"]}
    for k in ("step_ms", "step_ms_p10", "step_ms_p90", "tokens_per_s", "steps_timed"):
        out[f"recorded_{k}"] = recorded.get(k)
    if "error" in now:
        return {**out, "error": now["error"]}
    for k in ("step_ms", "step_ms_p10", "step_ms_p90", "tokens_per_s", "steps_timed",
              "step_ms_all", "attention_backend", "norm_backend", "swiglu_backend",
              "fp8_backend", "precision"):
        out[k] = now.get(k)
    c = compare.versus(now, recorded)
    out["speedup_vs_recorded"] = c.speedup
    out["level"] = c.level
    out["verdict"] = c.verdict
    return out


def run(quick: bool = False, checks=CHECKS) -> list[dict]:
    """Time each check's setup again (its own process) next to its recorded row."""
    if quick:  # CPU smoke: the machinery, on the tiny model, compared with itself
        setup, recorded, prov = find(checks[0])
        now = run_setups([dataclasses.replace(setup, preset=None, batch=None)],
                         preset_name="tiny", seq_len=64, batch=2, isolate=False,
                         tag="spot_check")[0]
        return [spot_row(checks[0], {**now, "setup": setup.name}, prov, now)]
    rows = []
    for check in checks:
        setup, recorded, prov = find(check)
        now = run_setups([setup], preset_name=recorded["preset"],
                         seq_len=recorded["seq_len"], batch=recorded["batch"],
                         tag="spot_check")[0]
        rows.append(spot_row(check, recorded, prov, now))
    return rows


def setup_in_tree(check: str, tree: str | None) -> str:
    """The JSON of check "FILE:SETUP"'s `Setup` as the code in `tree` defines it
    (None: this code), so that each checkout times its own definition."""
    name, _, setup_name = check.partition(":")
    if name not in SOURCES or not setup_name:
        raise UsageError(f"check {check!r}: write FILE:SETUP with FILE one of "
                         f"{sorted(SOURCES)}")
    if tree is None:
        setups = {s.name: s for s in SOURCES[name].SETUPS}
        if setup_name not in setups:
            raise UsageError(f"check {check!r}: {name} has setups {sorted(setups)}")
        return setups[setup_name].to_json()
    module = SOURCES[name].__name__
    code = (f"import {module} as m; print({{s.name: s for s in m.SETUPS}}"
            f"[{setup_name!r}].to_json())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise UsageError(f"check {check!r} in {tree}: "
                         f"{proc.stdout.strip().splitlines()[-1:]}")
    return proc.stdout.strip().splitlines()[-1]


def time_in_tree(setup_json: str, tree: str | None, preset: str, seq_len: int,
                 batch: int) -> dict:
    """One setup's step timed in a child process importing the code of `tree`."""
    name = json.loads(setup_json)["name"]
    row, why = in_child("colossal_lab.benchmarks.steps", [
        "--setup-json", setup_json, "--preset", preset, "--seq-len", str(seq_len),
        "--batch", str(batch)], cwd=tree)
    return row if why is None else {"setup": name, "preset": preset, "seq_len": seq_len,
                                    "batch": batch, "error": why}


def old_and_new(checks, old_tree: str, old_commit: str | None, rounds: int,
                preset: str, seq_len: int, batch: int) -> list[dict]:
    """Each check timed with the code in `old_tree` and with this code, in turns
    (old first in even rounds, new first in odd ones), `rounds` times; one row per
    check and round."""
    tree = str(Path(old_tree).resolve())
    definitions = {c: (setup_in_tree(c, tree), setup_in_tree(c, None)) for c in checks}
    rows = []
    for r in range(rounds):
        for check in checks:
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            timed = {}
            for which in order:
                print(f"[spot_check] round {r + 1}/{rounds} {check} ({which}) ...",
                      flush=True)
                old_json, new_json = definitions[check]
                timed[which] = time_in_tree(old_json if which == "old" else new_json,
                                            tree if which == "old" else None,
                                            preset, seq_len, batch)
                print(format_row(timed[which]), flush=True)
            rows.append(pair_row(check, r, old_commit, timed["old"], timed["new"]))
    return rows


def pair_row(check: str, round_: int, old_commit: str | None, old: dict,
             new: dict) -> dict:
    """One round of one check: the old code's and the new code's timing, the ratio of
    the medians (old / new: above 1, the new code is faster) and the verdict."""
    out = {"check": check, "setup": new.get("setup"), "round": round_,
           "old_commit": old_commit, "preset": new.get("preset"),
           "batch": new.get("batch"), "seq_len": new.get("seq_len")}
    for tag, row in (("old", old), ("new", new)):
        for k in ("step_ms", "step_ms_p10", "step_ms_p90", "tokens_per_s", "steps_timed",
                  "step_ms_all", "sm_clock_mhz", "power_w"):
            if k in row:
                out[f"{tag}_{k}"] = row[k]
    errors = [f"{tag}: {row['error']}" for tag, row in (("old", old), ("new", new))
              if "error" in row]
    if errors:
        return {**out, "error": "; ".join(errors)}
    c = compare.versus(new, old)  # old / new
    out["speedup_new_vs_old"] = c.speedup
    out["level"] = c.level
    out["verdict"] = c.verdict
    return out


def pair_summary(rows: list[dict]) -> str:
    lines = [f"{'check':<28} {'round':>5} {'old ms (p10-p90)':>20} "
             f"{'new ms (p10-p90)':>20} {'old/new':>8}  verdict"]
    for r in rows:
        head = f"{r['check']:<28} {r['round'] + 1:>5}"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:80]}")
            continue
        cells = [f"{r[f'{t}_step_ms']:.1f} ({r[f'{t}_step_ms_p10']:.0f}-"
                 f"{r[f'{t}_step_ms_p90']:.0f})" for t in ("old", "new")]
        lines.append(f"{head} {cells[0]:>20} {cells[1]:>20} "
                     f"{r['speedup_new_vs_old']:>8.3f}  {r['verdict']}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    lines = [f"{'check':<36} {'recorded ms (p10-p90)':>24} {'now ms (p10-p90)':>22} "
             f"{'ratio':>6}  verdict"]
    for r in rows:
        rec = (f"{r['recorded_step_ms']:.1f} ({r['recorded_step_ms_p10']:.0f}-"
               f"{r['recorded_step_ms_p90']:.0f})")
        if "error" in r:
            lines.append(f"{r['check']:<36} {rec:>24} failed: {r['error'][:60]}")
            continue
        now = f"{r['step_ms']:.1f} ({r['step_ms_p10']:.0f}-{r['step_ms_p90']:.0f})"
        lines.append(f"{r['check']:<36} {rec:>24} {now:>22} "
                     f"x{r['speedup_vs_recorded']:.3f}  {r['verdict']}")
    return "\n".join(lines)


def _run_and_print(a) -> list[dict]:
    if a.old_tree is None:
        rows = run(a.quick, tuple(a.checks))
        print(summary(rows))
        return rows
    if a.quick:
        rows = old_and_new(tuple(a.checks), a.old_tree, a.old_commit, a.rounds,
                           "tiny", 64, 2)
    else:
        rows = old_and_new(tuple(a.checks), a.old_tree, a.old_commit, a.rounds,
                           a.preset, a.seq_len, a.batch)
    print(pair_summary(rows))
    return rows


def _config(a) -> dict:
    if a.old_tree is None:
        return {"checks": a.checks}
    return {"checks": a.checks, "old_commit": a.old_commit, "rounds": a.rounds,
            "preset": a.preset, "seq_len": a.seq_len, "batch": a.batch}


def _check(a) -> str | None:
    if a.old_tree is not None and not Path(a.old_tree, "colossal_lab").is_dir():
        return f"--old-tree {a.old_tree}: no colossal_lab package in that folder"
    if a.old_tree is None and (a.old_commit is not None or a.rounds != 1):
        return "--old-commit and --rounds go with --old-tree"
    return None


BENCH = Benchmark(
    "spot_check", __doc__, description="re-time recorded steps: did they move?",
    quick_help="tiny model on this machine, not saved",
    options=[opt("--checks", nargs="*", default=list(CHECKS), help="FILE:SETUP ..."),
             opt("--old-tree", default=None,
                 help="another checkout: time its code and this one in turns"),
             opt("--old-commit", default=None, help="the old tree's commit, recorded"),
             flag("rounds", default=1, help="old and new timed this many times, in turns"),
             flag("preset"), flag("seq_len"), flag("batch"),
             flag("name")],
    run=_run_and_print, config=_config, check=_check)
main = BENCH.main


if __name__ == "__main__":
    main()
