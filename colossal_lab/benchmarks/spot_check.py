"""Re-time steps already recorded under `results/<gpu>/` and say whether they moved.

A change that should not change behaviour (a refactor of how switches are applied,
say) is checked where it matters: the same `Setup`s, timed again on the same
GPU, against the rows recorded before it. Each row of `spot_check.json` holds the
recorded median and p10-p90, the new ones, the ratio of the medians and the verdict of
`compare.versus`: "level" when each median lies inside the other's p10-p90 range.

    python -m colossal_lab bench spot_check                       # the default CHECKS
    python -m colossal_lab bench spot_check --checks precision_step:fp8-delayed

What the default checks exercise: fp8 linears (precision applied last, delayed
scaling), bf16 parameters (bf16-pure: the parameters cast, the buffers not), selective
recomputation (checkpointed layers wrapped in place), fused projections with our
SwiGLU (the linears restacked in place).
"""

from __future__ import annotations

import dataclasses

from colossal_lab.benchmarks import (
    baseline,
    checkpointing,
    composed,
    flash_attention_step,
    fused_norm_step,
    fused_qkv,
    precision,
)
from colossal_lab.benchmarks.harness import Benchmark, opt
from colossal_lab.benchmarks.steps import run_setups
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
        raise ValueError(f"check {check!r}: write FILE:SETUP with FILE one of "
                         f"{sorted(SOURCES)}")
    setups = {s.name: s for s in SOURCES[name].SETUPS}
    recorded = load_results(name, gpu=gpu)
    rows = {r["setup"]: r for r in recorded.rows if "error" not in r}
    if setup_name not in setups or setup_name not in rows:
        raise ValueError(f"check {check!r}: {name} has setups {sorted(setups)} and "
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
    out["verdict"] = "level" if c.level else ("faster" if c.speedup > 1 else "slower")
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


def _run_and_print(quick: bool, checks: tuple[str, ...]) -> list[dict]:
    rows = run(quick, checks)
    print(summary(rows))
    return rows


BENCH = Benchmark(
    "spot_check", __doc__, description="re-time recorded steps: did they move?",
    quick_help="tiny model on this machine, not saved",
    options=[opt("--checks", nargs="*", default=list(CHECKS), help="FILE:SETUP ...")],
    run=lambda a: _run_and_print(a.quick, tuple(a.checks)),
    config=lambda a: {"checks": a.checks})
main = BENCH.main


if __name__ == "__main__":
    main()
