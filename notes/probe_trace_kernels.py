"""Per-step GPU time of each kernel name in a `torch.profiler` trace (Chrome JSON, may
be gzipped), GEMMs summed into one line: how the finale's step was read kernel by kernel
(notes/finale.md, sixth session). A working tool, not a results file; it needs no GPU.

    python notes/probe_trace_kernels.py TRACE.json[.gz] STEPS OUT.json

The traces are `bench profile_breakdown --setups best --trace-dir DIR`'s (its schedule
profiles STEPS = 3 active steps); kernel, memcpy and memset events are summed by name
and divided by STEPS.
"""

import argparse
import collections
import gzip
import json
import re

GEMM = re.compile(r"nvjet|gemm|cutlass")


def summary(path: str, steps: int) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_name[e["name"]][0] += e["dur"]
            by_name[e["name"]][1] += 1
    gemm = sum(d for n, (d, _) in by_name.items() if GEMM.search(n)) / 1e3 / steps
    total = sum(d for d, _ in by_name.values()) / 1e3 / steps
    rows = [{"kernel": n, "ms": round(d / 1e3 / steps, 4), "calls": c / steps}
            for n, (d, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])
            if not GEMM.search(n)]
    return {"trace": path, "steps": steps, "kernel_ms": round(total, 3),
            "gemm_ms": round(gemm, 3), "non_gemm_ms": round(total - gemm, 3),
            "non_gemm": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("steps", type=int)
    ap.add_argument("out")
    args = ap.parse_args()
    s = summary(args.trace, args.steps)
    with open(args.out, "w") as f:
        json.dump(s, f, indent=1)
    print(f"kernels {s['kernel_ms']} ms a step: GEMMs {s['gemm_ms']}, the rest "
          f"{s['non_gemm_ms']}")
    for r in s["non_gemm"][:20]:
        print(f"{r['ms']:8.3f} ms {r['calls']:6.1f}  {r['kernel'][:90]}")


if __name__ == "__main__":
    main()
