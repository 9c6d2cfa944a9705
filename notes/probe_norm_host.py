"""Host time and eager timing of RMSNorm in a fresh process (a working tool, not a
results file).

    python notes/probe_norm_host.py [--out probe.json]

The sweep (`bench fused_norm --group rms_norm`) times its host rows at the end of a long
process; there the bf16 rows gave ours 153 µs against F.rms_norm's 106 per 16-token
forward+backward, where a standalone probe had measured 95 against 96. This runs the
same measurements (`fused_norm.host_rows`, `fused_norm.measure` and
`fused_norm.eager_in_turns`) first thing
in a fresh process, for both dtypes and both providers, plus the two points where the
sweep's targets miss (16384 x 1024 bf16 eager, 1024 x 1024 bf16 graph replay), so the
two can be compared before the sweep's method is changed.
"""

from __future__ import annotations

import argparse
import json

import torch

from colossal_lab.benchmarks import fused_norm as fn

PROVIDERS = ("torch", "triton-native", "triton")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="probe_norm_host.json")
    a = p.parse_args()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for tokens, hidden in fn.HOST_SHAPES:
            for r in fn.host_rows("rms_norm", PROVIDERS, tokens, hidden, dtype):
                rows.append(r)
                print(f"host {r['provider']:14s}{tokens} x {hidden} {r['dtype']:9s}"
                      f"{r.get('host_us', float('nan')):8.1f} us", flush=True)
    for tokens, hidden in ((16384, 1024), (1024, 1024)):
        case = [fn.measure("rms_norm", provider, tokens, hidden, torch.bfloat16)
                for provider in PROVIDERS[:2]]
        for r in fn.eager_in_turns("rms_norm", case, tokens, hidden, torch.bfloat16):
            provider = r["provider"]
            rows.append(r)
            print(f"op   {provider:14s}{tokens} x {hidden} bf16: graph "
                  f"{r.get('fwd_bwd_ms', float('nan')) * 1e3:.1f} us, eager "
                  f"{r.get('eager_fwd_bwd_ms', float('nan')) * 1e3:.1f} us", flush=True)
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                   else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
