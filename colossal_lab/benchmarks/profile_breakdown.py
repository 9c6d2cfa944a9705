"""Chapter 09's breakdown: where a training step's GPU time goes, naive against best."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from colossal_lab import precision
from colossal_lab.benchmarks.baseline import STEP_FLAGS
from colossal_lab.benchmarks.harness import SUPPRESS, Benchmark, Invocation, opt
from colossal_lab.benchmarks.steps import Setup, in_child, prepare, ran_backends
from colossal_lab.config import SWITCH_SETS
from colossal_lab.measure import profile, timing
from colossal_lab.measure.profile import step_ms_of
from colossal_lab.training import data, train

NAME = "profile_breakdown"
SETUPS = (
    Setup("naive-fp32", "ours: fp32, every switch off", switches=SWITCH_SETS["naive"],
          micro_batch=1),
    Setup("naive-bf16", "ours: bf16 autocast, every switch off",
          switches=SWITCH_SETS["bf16"], micro_batch=1),
    Setup("best", "ours: every switch, bf16 params (best)", switches=SWITCH_SETS["best"]),
    Setup("best-fp8", "ours: every switch, fp8 linears (best-fp8)",
          switches=SWITCH_SETS["best-fp8"]),
    Setup("hf-liger", "HF transformers: bf16, SDPA, Liger kernels", "hf", liger=True),
)
SETUP_NAMES = tuple(s.name for s in SETUPS)
TOP_OPS = 40
"""Roofline points kept per setup (the operators with the most time)."""


def profile_one(setup: Setup, preset_name: str, seq_len: int, batch: int,
                trace_dir: str | Path) -> list[dict]:
    """Build `setup` (`steps.build`), profile its training step in this process and
    return its rows; the trace is written to `trace_dir/<setup>.json`."""

    device, cfg, model, loss_fn, micro, opt = prepare(setup, preset_name, batch)
    step = train.make_step(model, opt, loss_fn, micro_batches=batch // micro)
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=0, device=device)
    trace = Path(trace_dir) / f"{setup.name}.json"
    timing.reset_peak_memory()
    with train.gc_between_steps():
        profile.profile_steps(step, batches, trace)
    summary = profile.summarize(trace)
    fields = {"setup": setup.name, "label": setup.label, "preset": preset_name,
              "seq_len": seq_len, "batch": batch, "micro_batch": micro,
              "precision": precision.of(getattr(model, "_orig_mod", model))}
    rows = profile.breakdown_rows(summary, **fields)
    rows[0].update({"trace_file": trace.name, "peak_mem_gib": timing.peak_memory_gib(),
                    **ran_backends(model, setup)})
    for p in profile.roofline_points(trace)[:TOP_OPS]:
        rows.append({**fields, "kind": "op", "name": p.name, "kernel_class": p.kernel_class,
                     "calls": p.calls, "ms": p.ms, "flops": p.flops, "bytes": p.bytes,
                     "tflops": p.tflops, "intensity": p.intensity})
    return rows


def profile_isolated(setup: Setup, preset_name: str, seq_len: int, batch: int,
                     trace_dir: str | Path) -> list[dict]:
    """`profile_one` in a child process; a failure becomes one ``kind="step"`` row with
    an `error`."""
    rows, why = in_child("colossal_lab.benchmarks.profile_breakdown", [
        "--child", setup.to_json(), "--preset", preset_name, "--seq-len", str(seq_len),
        "--batch", str(batch), "--trace-dir", str(trace_dir)])
    return rows if why is None else [{"setup": setup.name, "label": setup.label,
                                      "preset": preset_name, "seq_len": seq_len,
                                      "batch": batch, "kind": "step", "error": why}]


def run(quick: bool = False, *, preset_name: str = "llama-7b-8l", seq_len: int = 4096,
        batch: int = 4, setups=None, trace_dir: str | Path | None = None) -> list[dict]:
    """Every setup's rows. `quick`: the tiny model at seq 64, batch 2, in this process,
    without Liger (its kernels need a GPU).

    One training step of `llama-7b-8l` (seq 4096, batch 4, random tokens, AdamW) profiled
    with `colossal_lab.measure.profile` (wait 1, warm-up 2, active 3 steps), each setup in its own
    process (as `steps.run_setups` times them), then summarized: GPU time by kernel class,
    the top kernels, idle time (HolisticTraceAnalysis's host-wait / kernel-wait split), and
    the operators placed on the roofline.

        naive-fp32   ours, every switch off, fp32 (the tutorial's starting point; micro-batch 1,
                     as chapter 00 times it, since naive attention at 4 does not fit)
        naive-bf16   ours, every switch off, bf16 autocast (SWITCH_SETS["bf16"]; micro 1)
        best         ours, SWITCH_SETS["best"] (chapter 10's ours-bf16)
        hf-liger     Hugging Face LlamaForCausalLM, SDPA, Liger's kernels, bf16 autocast

    Rows (`profile.breakdown_rows`): ``kind="step"`` (profiled step, busy, idle, data,
    communication, HTA's numbers), ``kind="class"`` (ms per step by kernel class),
    ``kind="kernel"`` (the top kernels) and ``kind="op"`` (roofline points: FLOPs, bytes,
    time). Times are under the profiler, a little slower than chapter 10's timed steps; the
    chapters' step benchmarks give the MFU.

        python -m colossal_lab bench profile_breakdown   # results/<gpu>/profile_breakdown.json
        python -m colossal_lab bench profile_breakdown --quick    # tiny model on this CPU
        python -m colossal_lab bench profile_breakdown --trace-dir traces   # keep the traces
    """
    chosen = [s for s in SETUPS if s.name in (setups or SETUP_NAMES)]
    if quick:
        preset_name, seq_len, batch = "tiny", 64, 2
        chosen = [s for s in chosen if not s.liger]
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(trace_dir or tmp)
        rows = []
        for s in chosen:
            print(f"[{NAME}] {s.name} ...", flush=True)
            got = (profile_one(s, preset_name, seq_len, batch, where) if quick else
                   profile_isolated(s, preset_name, seq_len, batch, where))
            print(format_rows(got), flush=True)
            rows += got
    return rows


def format_rows(rows: list[dict]) -> str:
    step = next(r for r in rows if r["kind"] == "step")
    if "error" in step:
        return f"  {step['setup']:<12} failed: {step['error'][:80]}"
    classes = ", ".join(f"{r['kernel_class']} {r['share']:.0%}" for r in rows
                        if r["kind"] == "class")[:120]
    return (f"  {step['setup']:<12} {step_ms_of(step):8.1f} ms/step, idle "
            f"{step['idle_share']:.0%}; {classes}")


def config_of(preset_name: str = "llama-7b-8l", seq_len: int = 4096, batch: int = 4) -> dict:

    return {"preset": preset_name, "seq_len": seq_len, "batch": batch,
            "optimizer": "AdamW", "data": "random tokens",
            "schedule": "torch.profiler schedule(wait=1, warmup=2, active=3), per step "
                        "means of the 3 active steps",
            "kernel_classes": {c: list(p) for c, p in profile.KERNEL_CLASSES},
            "roofline": "FLOPs and bytes from recorded shapes (profile.op_cost); time of "
                        "the kernels each operator launched",
            "setups": {s.name: s.label for s in SETUPS}}


def _profile(call: Invocation) -> None:
    """The breakdown of the chosen setups, saved; or, as a child (`--child`), one
    setup's rows written to `--json-out`."""
    a = call.args
    if a.child:
        rows = profile_one(Setup.from_json(a.child), a.preset, a.seq_len, a.batch,
                           a.trace_dir)
        with open(a.json_out, "w") as f:
            json.dump(rows, f)
        return
    rows = run(a.quick, preset_name=a.preset, seq_len=a.seq_len, batch=a.batch,
               setups=a.setups, trace_dir=a.trace_dir)
    if not a.quick:
        call.save(rows)


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny model, in this process, not saved",
    options=[*STEP_FLAGS, opt("--setups", nargs="*", choices=SETUP_NAMES),
             opt("--trace-dir", help="keep the traces here (default: thrown away)"),
             opt("--child", help=SUPPRESS),  # a Setup's JSON: profile_isolated
             opt("--json-out", help=SUPPRESS)],
    config=lambda a: config_of(a.preset, a.seq_len, a.batch), execute=_profile)
main = BENCH.main


if __name__ == "__main__":
    main()
