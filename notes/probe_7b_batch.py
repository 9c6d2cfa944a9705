"""Full LLaMA-7B (`ours-7b-bf16` of `benchmarks.composed`: every switch, AdamW exact)
at batch 2 and batch 3, each in its own process, in one run: does batch 3 fit the H200
with the fewest checkpointed layers `auto_ratio` picks, what peak does it reach against
the memory model's prediction, and what MFU does it buy? A working tool for
notes/finale.md (the 7B row's 0.55 MFU target), not a results file.

    python notes/probe_7b_batch.py OUT.json [--batches 2 3] [--setups ours-7b-bf16 ...]
        [--preset llama-7b-8l]   # the same setups on another model (a smaller card)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from colossal_lab.benchmarks import composed, steps

KEYS = ("batch", "step_ms", "step_ms_p10", "step_ms_p90", "tokens_per_s", "mfu",
        "peak_mem_gib", "predicted_peak_gib", "auto_ratio_ckpt_layers", "ckpt_layers",
        "activation_mem_gib", "mem_before_gib", "mem_fixed_gib", "mem_per_sample_none_gib",
        "mem_per_sample_full_gib", "mem_capacity_gib", "sm_clock_mhz", "power_w", "error")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--setups", nargs="+", default=["ours-7b-bf16"],
                    choices=[s.name for s in composed.SETUPS if s.preset == "llama-7b"])
    ap.add_argument("--preset", default="llama-7b")
    args = ap.parse_args()
    rows = []
    runs = [(name, b) for name in args.setups for b in args.batches]
    for name, b in runs:
        base = next(s for s in composed.SETUPS if s.name == name)
        setup = dataclasses.replace(base, batch=b, preset=args.preset)
        row = steps.measure_isolated(setup, args.preset, 4096, b)
        row["setup"] = name
        rows.append(row)
        print(name, {k: row.get(k) for k in KEYS if k in row}, flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)

if __name__ == "__main__":
    main()
