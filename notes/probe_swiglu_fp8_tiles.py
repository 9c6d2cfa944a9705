"""Which (BLOCK_R, BLOCK_C, num_warps) lets the fused SwiGLU-fp8 kernels
(`kernels.swiglu_fp8`) stream nearest the copy rate, smaller tiles and more warps
included: the autotuner's `TILES` are all 64x64 or wider, and the backward, with eight
fp32 tiles live (g, u, dh, σ, silu, its derivative, dg, du), may spill at 64x64 with 4
warps. A working tool for notes/finale.md (the fp8 step), not a results file.

    python notes/probe_swiglu_fp8_tiles.py OUT.json [--tokens 16384] [--width 11008]

Delayed scaling as the step runs it: both layouts and the amax. Bytes counted per element
of h: forward 4 read + 1 + 1 written, backward 6 read + 2 + 2 written. Every tile's bytes
are compared with the first tile's; the copy rate is `hardware.measure_copy_gbps`.
"""

from __future__ import annotations

import argparse
import json

import torch

from colossal_lab.kernels import swiglu_fp8 as sf
from colossal_lab.measure import hardware, timing

CANDIDATES = [*sf.TILES, (64, 64, 8), (32, 64, 4), (32, 128, 4), (32, 64, 2),
              (32, 128, 8), (16, 128, 4), (16, 256, 4), (128, 64, 8), (32, 256, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=11008)
    args = ap.parse_args()
    t, i = args.tokens, args.width
    torch.manual_seed(0)
    gu = (torch.randn(t, 2 * i, device="cuda") * 3).bfloat16()
    dh = torch.randn(t, i, device="cuda").bfloat16()
    src = torch.rand(16, device="cuda") * 4 + 1
    copy = hardware.measure_copy_gbps()
    rows = []
    for name, nbytes, call in (
            ("forward", 6, lambda tile, a: sf.swiglu_fp8_forward(
                gu, torch.float8_e4m3fn, src, amax_out=a, tile=tile)),
            ("backward", 10, lambda tile, a: sf.swiglu_fp8_backward(
                dh, gu, torch.float8_e5m2, src, amax_out=a, tile=tile))):
        ref = None
        for tile in CANDIDATES:
            amax = torch.zeros(1, device="cuda")
            q, qt, _ = call(tile, amax)
            torch.cuda.synchronize()
            got = (q.view(torch.uint8), qt.view(torch.uint8), amax.clone())
            if ref is None:
                ref = got
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            tm, how = timing.time_kernels(lambda tile=tile, call=call, a=amax: call(tile, a),
                                          reps=30)
            gbs = t * i * nbytes / tm.median_ms / 1e6
            rows.append(dict(kernel=name, tokens=t, width=i, block_r=tile[0],
                             block_c=tile[1], num_warps=tile[2], median_ms=tm.median_ms,
                             p10_ms=tm.p10_ms, p90_ms=tm.p90_ms, gb_per_s=gbs,
                             of_copy=gbs / copy, how=how, same_bits=same))
            print(f"{name:<8} {tile[0]:>3}x{tile[1]:<3} w{tile[2]}  {tm.median_ms:6.3f} ms "
                  f"({tm.p10_ms:.3f}-{tm.p90_ms:.3f})  {gbs:5.0f} GB/s  "
                  f"{gbs / copy:4.0%} of copy  same={same}", flush=True)
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": copy,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
