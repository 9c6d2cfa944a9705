"""How fast the finale's bf16 GEMMs can run when nothing else does: one training step's
GEMMs back to back, against the same GEMMs each timed alone. A working tool for
notes/finale.md (what limits `ours-bf16`), not a results file.

    python notes/probe_gemm_power.py OUT.json [--preset llama-7b-8l] [--tokens 16384]
                                              [--steps 20]

The GEMMs of one step of ours-bf16 on the preset (fused q/k/v and gate/up projections,
the output head in `switches.loss` chunks), each as `F.linear` and its backward run them:
forward ``x @ W.T``, input gradient ``dy @ W``, weight gradient ``dy.T @ x``, bf16 in
and out (the head's weight gradient, summed in fp32 there, is a bf16 GEMM here).

- "sustained": the whole list captured in one CUDA graph and replayed `--steps` times
  back to back, each replay timed with events, `nvidia-smi` sampled beside them
  (`telemetry.GpuSampler`): the GEMMs of a step with no gap for the power to recover in.
- "isolated": each distinct GEMM timed alone (`timing.time_kernels`: graph replay of
  100, L2 flushed), times how often the step runs it: the rate a short GEMM benchmark
  reports.

Both with the SM-clock-normalised rate: TFLOP/s against 132 SMs x 4096 dense bf16
FLOP per clock at the median clock sampled (989.4 TFLOP/s is that at 1830 MHz).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from colossal_lab import config
from colossal_lab.benchmarks.step_floor import step_gemms
from colossal_lab.measure import telemetry, timing

FLOP_PER_CLOCK = 132 * 4096
"""Dense bf16 FLOP per SM clock of the H200 (and H100 SXM): 989.4e12 / 1.83e9."""


def operands(name: str, m: int, n: int, k: int, dev) -> tuple:
    """Tensors laid out as `F.linear`'s GEMMs see them: A (m, k) and B (k, n) views."""
    bf16 = torch.bfloat16
    if name.endswith(".fwd"):  # x (m, k) @ W.T, W stored (n, k)
        return torch.randn(m, k, device=dev, dtype=bf16), \
            torch.randn(n, k, device=dev, dtype=bf16).t()
    if name.endswith(".dx"):  # dy (m, k) @ W, W stored (k, n)
        return torch.randn(m, k, device=dev, dtype=bf16), \
            torch.randn(k, n, device=dev, dtype=bf16)
    # dw: dy.T (m, k) @ x (k, n), dy stored (k, m), x stored (k, n)
    return torch.randn(k, m, device=dev, dtype=bf16).t(), \
        torch.randn(k, n, device=dev, dtype=bf16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--preset", default="llama-7b-8l")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seq of the step")
    p.add_argument("--steps", type=int, default=20, help="timed replays of the step")
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg = config.preset(a.preset)
    gemms = step_gemms(cfg, a.tokens)
    flop = {g: 2 * g[1] * g[2] * g[3] for g in set(gemms)}
    total_flop = sum(flop[g] for g in gemms)
    ops = {g: operands(*g, dev) for g in set(gemms)}  # one set of tensors per shape
    outs = {g: torch.empty(g[1], g[2], device=dev, dtype=torch.bfloat16) for g in ops}

    def run_step():
        for g in gemms:
            torch.mm(*ops[g], out=outs[g])

    run_step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(a.steps)]
    with telemetry.GpuSampler(dev) as gpu:
        time.sleep(0.3)  # a sample or two before, so the timed window has its own
        since = telemetry.now()
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events]
    sustained = timing._summary(ms)
    clocks = gpu.fields(since)

    isolated, how = {}, set()
    for g in sorted(set(gemms)):
        t, taken = timing.time_kernels(lambda g=g: torch.mm(*ops[g], out=outs[g]))
        isolated[g] = t.median_ms
        how.add(taken)
    count = Counter(gemms)
    iso_ms = sum(isolated[g] * count[g] for g in count)

    def rate(ms_: float) -> float:
        return total_flop / ms_ / 1e9

    mhz = clocks.get("sm_clock_mhz")
    row = {
        "preset": a.preset, "tokens": a.tokens, "gemms_per_step": len(gemms),
        "step_gemm_tflop": total_flop / 1e12,
        "sustained": {"ms": sustained.median_ms, "p10_ms": sustained.p10_ms,
                      "p90_ms": sustained.p90_ms, "tflops": rate(sustained.median_ms),
                      "steps": a.steps, **clocks,
                      "of_clock_peak": (rate(sustained.median_ms)
                                        / (FLOP_PER_CLOCK * mhz * 1e6 / 1e12))
                      if mhz else None},
        "isolated": {"ms": iso_ms, "tflops": rate(iso_ms), "timing": sorted(how),
                     "per_gemm": [{"gemm": g[0], "m": g[1], "n": g[2], "k": g[3],
                                   "calls": count[g], "ms": isolated[g],
                                   "tflops": flop[g] / isolated[g] / 1e9}
                                  for g in sorted(count)]},
        "gpu": torch.cuda.get_device_name(),
    }
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)
    s = row["sustained"]
    print(f"{a.preset}, {len(gemms)} GEMMs, {total_flop / 1e12:.1f} TFLOP a step")
    print(f"sustained: {s['ms']:.1f} ms (p10-p90 {s['p10_ms']:.1f}-{s['p90_ms']:.1f}), "
          f"{s['tflops']:.0f} TFLOP/s, SM clock {mhz} MHz, power {s.get('power_w')} W "
          f"of {s.get('power_limit_w')}, {s['of_clock_peak'] or 0:.3f} of the clock's peak")
    print(f"isolated:  {iso_ms:.1f} ms, {rate(iso_ms):.0f} TFLOP/s ({', '.join(sorted(how))})")


if __name__ == "__main__":
    main()
