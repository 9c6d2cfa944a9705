"""Why F.rms_norm's capture fails at 16384 x 1000 fp32, and whether the failure slows
the eager timings after it (a working tool, not a results file).

    python notes/probe_norm_capture.py [--out probe.json]

In two fresh processes on the H200 (2026-12-03) the sweep's first fp32 case, torch at
16384 x 1000, fell back to events ("operation failed due to a previous error during
capture"), and in the second the eager fwd+bwd of every Triton-launched provider of
that case read 2-3x its usual time (ours 239 µs against 95 in the first process, with
93 µs of kernels) while torch's moved 6%. This probe, first thing in a fresh process:

1. times the case's eager calls in turns (`fused_norm.eager_in_turns`) before any
   capture;
2. captures torch's three passes (fwd, fwd+bwd, bwd on a retained graph) one by one
   under each capture-error mode (`COLOSSAL_LAB_CAPTURE_MODE`: thread_local, global,
   relaxed), recording which fail and the whole error;
3. times the eager calls in turns again;
4. runs the sweep's `fused_norm.measure` for torch (capture tried twice now) and says
   how its row was timed.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from colossal_lab.benchmarks import fused_norm as fn
from colossal_lab.measure import timing

PROVIDERS = ("torch", "triton-native", "triton")
MODES = ("thread_local", "global", "relaxed")


def eager(tokens: int, hidden: int, dtype) -> dict:
    rows = [{"kind": "op", "provider": p, "fwd_bwd_ms": 1.0} for p in PROVIDERS]
    fn.eager_in_turns("rms_norm", rows, tokens, hidden, dtype)
    return {r["provider"]: round(r["eager_fwd_bwd_ms"] * 1e3, 1)
            if r.get("eager_fwd_bwd_ms") else r.get("error") for r in rows}


def captures(tokens: int, hidden: int, dtype) -> list[dict]:
    f = fn._provider_fn("rms_norm", "torch")
    inputs, grads = fn._inputs("rms_norm", tokens, hidden, dtype, torch.device("cuda"))
    fwd, fwd_bwd = fn._eager_calls(f, inputs, grads)
    fwd_bwd()  # (the sweep's warm-up call)
    out = []
    for mode in MODES:
        os.environ["COLOSSAL_LAB_CAPTURE_MODE"] = mode
        for name, make in (("fwd", lambda: fwd), ("fwd_bwd", lambda: fwd_bwd),
                           ("bwd", lambda: fn._backward_only(f, inputs, grads))):
            row = {"mode": mode, "pass": name}
            try:
                row["graph_us"] = round(timing.time_cuda_graph(make(), reps=20)
                                        .median_ms * 1e3, 1)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                torch.cuda.synchronize()
            out.append(row)
            print(f"  capture {mode:12s} {name:8s} "
                  + (f"{row['graph_us']} us" if "graph_us" in row else row["error"][:160]),
                  flush=True)
    os.environ.pop("COLOSSAL_LAB_CAPTURE_MODE")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="probe_norm_capture.json")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=1000)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    doc = {"gpu": torch.cuda.get_device_name(), "case": [a.tokens, a.hidden, a.dtype]}
    doc["eager_before_us"] = eager(a.tokens, a.hidden, dtype)
    print("eager before any capture (µs):", doc["eager_before_us"], flush=True)
    doc["captures"] = captures(a.tokens, a.hidden, dtype)
    doc["eager_after_us"] = eager(a.tokens, a.hidden, dtype)
    print("eager after the captures (µs):", doc["eager_after_us"], flush=True)
    row = fn.measure("rms_norm", "torch", a.tokens, a.hidden, dtype)
    doc["measure_timing"] = row.get("timing")
    print("fused_norm.measure timed torch by:", row.get("timing"), flush=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
