"""Which tile shape lets `fp8_cast_transpose` run nearest the copy rate: the cast of one
bf16 tensor to e4m3, both layouts and the amax, per (BLOCK_R, BLOCK_C, num_warps),
on the finale's shapes (16,384 tokens of llama-7b). A working tool for notes/finale.md
(the fp8 step's casts), not a results file.

    python notes/probe_fp8_cast_tiles.py OUT.json

Bytes counted: 2 read + 1 + 1 written per element. Each config's output is compared
bit for bit with the default tile's.
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from colossal_lab.kernels import fp8_cast as fc
from colossal_lab.measure import timing

SHAPES = {"x (norm out)": (16384, 4096), "h (swiglu out)": (16384, 11008),
          "dy qkv": (16384, 12288), "dy gate/up": (16384, 22016),
          "W qkv (bf16)": (12288, 4096), "W down (bf16)": (4096, 11008)}
CONFIGS = [(64, 64, 4), (64, 64, 8), (128, 64, 4), (64, 128, 4), (128, 128, 4),
           (128, 128, 8), (32, 128, 4), (128, 32, 4), (256, 64, 8), (64, 256, 8)]


def launch(x, dtype, amax_src, block_r, block_c, warps):
    rows, cols = x.shape
    ld = fc.padded(rows)
    y = torch.empty(rows, cols, dtype=dtype, device=x.device)
    yt = torch.empty(cols, ld, dtype=dtype, device=x.device)
    inv = torch.empty(1, dtype=torch.float32, device=x.device)
    amax_out = torch.zeros(1, dtype=torch.float32, device=x.device)
    fp8_max, mant, min_exp = fc._format(dtype)
    grid = (triton.cdiv(ld, block_r), triton.cdiv(cols, block_c))

    def run():
        fc._fp8_cast_transpose_kernel[grid](
            x, y, yt, amax_src, inv, amax_out, x.stride(0), rows, cols, ld,
            amax_src.numel(), FP8_MAX=fp8_max, MANT_BITS=mant, MIN_EXP=min_exp,
            EPS=fc.EPS, WRITE_Y=True, WRITE_YT=True, WRITE_AMAX=True, ROUND_IN_FP32=False,
            BLOCK_SRC=16, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return run, y, yt


def main(out: str) -> None:
    torch.manual_seed(0)
    rows = []
    for name, (r, c) in SHAPES.items():
        x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        amax_src = torch.rand(16, device="cuda") * 4 + 1
        ref = None
        for br, bc, w in CONFIGS:
            run, y, yt = launch(x, torch.float8_e4m3fn, amax_src, br, bc, w)
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = (y.view(torch.uint8).clone(), yt.view(torch.uint8).clone())
            same = bool(torch.equal(ref[0], y.view(torch.uint8))
                        and torch.equal(ref[1], yt.view(torch.uint8)))
            t, how = timing.time_kernels(run, reps=50)
            gbs = r * c * 4 / t.median_ms / 1e6
            rows.append(dict(shape=name, rows=r, cols=c, block_r=br, block_c=bc,
                             num_warps=w, median_ms=t.median_ms, p10_ms=t.p10_ms,
                             p90_ms=t.p90_ms, gb_per_s=gbs, how=how, same_bits=same))
            print(f"{name:<16} {br:>4}x{bc:<4} w{w}  {t.median_ms:7.3f} ms  "
                  f"{gbs:7.0f} GB/s  same={same}", flush=True)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
