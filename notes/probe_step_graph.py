"""The best bf16 step eagerly and replayed as one CUDA graph (`enable_compile="graph"`),
each in its own process, on the finale's step (llama-7b-8l, seq 4096, batch 4): a first
look before the composed run takes `ours-bf16-graph`. A working tool, not a results
file (notes/finale.md, seventh session).

    python notes/probe_step_graph.py OUT.json

Each row is `benchmarks.steps.measure_isolated`'s (20 timed steps, p10-p90 kept), with
the graph's capture count and time.
"""

import argparse
import json

from colossal_lab.benchmarks import composed
from colossal_lab.benchmarks.steps import measure_isolated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file for the rows")
    args = ap.parse_args()
    by = {s.name: s for s in composed.SETUPS}
    rows = []
    for name in ("ours-bf16", "ours-bf16-graph"):
        r = measure_isolated(by[name], "llama-7b-8l", 4096, 4)
        rows.append(r)
        if "error" in r:
            print(f"{name}: {r['error'][-300:]}", flush=True)
            continue
        print(f"{name:<16} {r['step_ms']:.1f} ms (p10-p90 {r['step_ms_p10']:.1f}-"
              f"{r['step_ms_p90']:.1f}), MFU {r['mfu']:.4f}, {r['sm_clock_mhz']} MHz, "
              f"first step {r['first_step_s']} s, captures {r.get('graph_captures')}",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
