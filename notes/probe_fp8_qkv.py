"""The fp8 qkv projection with RoPE's backward cast fused in (`ops.fp8_qkv`) against the
composed path (Fp8Linear, then `RotaryQKVFunction`) on the GPU, at llama-7b's attention
input: 16,384 tokens, hidden 4096, 32 + 2 x 32 heads of 128, bf16 autocast, `_scaled_mm`.
A working tool for notes/finale.md (the fp8 step), not a results file.

    python notes/probe_fp8_qkv.py OUT.json [--reps 20] [--tokens 16384]

(a) Bits: one step of each path, delayed scaling: q, k, v, dx, dW and the histories,
counted as differing elements (0 expected).
(b) Time, CUDA events, the reps alternating between the paths: the projection + RoPE
forward and backward; then the kernels alone: `rope_fp8_backward` per tile of
`rope_fp8.TILES` and as autotuned, against RoPE's backward kernel followed by
`fp8_cast_transpose`, with the bytes each moves (fused: 2 read + 1 + 1 written per
element of dqkv; composed: 2 + 2, then 2 + 1 + 1).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import torch.nn as nn

from colossal_lab.kernels import fp8_cast, rope_fp8
from colossal_lab.kernels import rope as rope_k
from colossal_lab.kernels.rope import half_tables, rope_qkv_triton
from colossal_lab.measure import hardware, timing
from colossal_lab.ops import fp8, fp8_qkv


def _pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    d, n_q, n_kv, hd = 4096, 32, 32, 128
    B, S = args.tokens // 4096 or 1, min(args.tokens, 4096)
    W = (n_q + 2 * n_kv) * hd
    torch.manual_seed(0)
    cfg = fp8.Fp8Config(scaling="delayed", backend="scaled_mm")
    fused = fp8.Fp8Linear.from_linear(
        nn.Linear(d, W, bias=False, device="cuda", dtype=torch.bfloat16), cfg)
    comp = copy.deepcopy(fused)
    pos = torch.arange(S, dtype=torch.float32, device="cuda")[:, None]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32, device="cuda") / hd)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(B, S, h, hd, device="cuda", dtype=torch.bfloat16) * 1e-3
             for h in (n_q, n_kv, n_kv)]

    def step(path, m):
        xi = x.detach().requires_grad_()
        m.weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fp8_qkv.fp8_qkv_rope(xi, m, n_q, n_kv, cos, sin) if path == "fused" \
                else rope_qkv_triton(m(xi), n_q, n_kv, cos, sin)
        torch.autograd.backward(list(out), grads)
        return (*(t.detach() for t in out), xi.grad, m.weight.grad)

    out = {"device": torch.cuda.get_device_name(), "tokens": B * S}
    for _ in range(2):  # the first step starts the histories
        a, b = step("fused", fused), step("composed", comp)
    out["bits"] = {name: int((u.float() != v.float()).sum().item())
                   for name, u, v in zip(("q", "k", "v", "dx", "dW"), a, b)}
    out["bits"]["histories"] = all(
        torch.equal(fused._scalers[r].history, comp._scalers[r].history)
        for r in ("x", "w", "grad"))
    print("bits", out["bits"], flush=True)

    times = {"fused": [], "composed": []}
    for i in range(args.reps + 3):
        for path, m in (("fused", fused), ("composed", comp))[:: 1 if i % 2 else -1]:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(path, m)
            e1.record()
            torch.cuda.synchronize()
            if i >= 3:
                times[path].append(e0.elapsed_time(e1))
    out["step"] = {p: dict(median_ms=statistics.median(t), p10_ms=_pct(t, 0.1),
                           p90_ms=_pct(t, 0.9), reps=len(t)) for p, t in times.items()}
    print("fwd+bwd", out["step"], flush=True)

    dq, dk, dv = grads
    cos_h, sin_h = half_tables(cos, sin, S, hd)
    src = torch.tensor([1e-3, 4e-3], device="cuda")
    copy_gbps = hardware.measure_copy_gbps()
    n = B * S * W
    rows = []

    # the composed backward's kernels: RoPE's backward into dqkv, then the cast
    dqkv = torch.empty(B, S, W, device="cuda", dtype=torch.bfloat16)
    q_in, k_in, v_in = rope_k.split_heads(dqkv, n_q, n_kv)

    def composed():
        rope_k._launch(dq, dk, cos_h, sin_h, backward=True, q_out=q_in, k_out=k_in, v=dv,
                       v_out=v_in)
        fp8_cast.fp8_cast_transpose(dqkv.view(B * S, W), torch.float8_e5m2, src)

    t, how = timing.time_kernels(composed, reps=30)
    rows.append(dict(kernel="composed: rope backward + cast", median_ms=t.median_ms,
                     p10_ms=t.p10_ms, p90_ms=t.p90_ms, gb_per_s=n * 8 / t.median_ms / 1e6,
                     how=how))
    ld = fp8_cast.padded(B * S)
    for tile in [*rope_fp8.TILES, None]:  # None: the autotuner's choice
        def fused_kernel(tile=tile):
            rope_fp8._launch(dq, dk, dv, cos_h, sin_h, torch.float8_e5m2, src, None, True,
                             True, ld, tile)
        t, how = timing.time_kernels(fused_kernel, reps=30)
        name = "fused, autotuned" if tile is None else f"fused {tile[0]} tokens, {tile[1]} warps"
        rows.append(dict(kernel=name, tile=tile, median_ms=t.median_ms, p10_ms=t.p10_ms,
                         p90_ms=t.p90_ms, gb_per_s=n * 4 / t.median_ms / 1e6, how=how))
    for r in rows:
        r["of_copy"] = r["gb_per_s"] / copy_gbps
        print(f"{r['kernel']:<34} {r['median_ms']:6.3f} ms ({r['p10_ms']:.3f}-"
              f"{r['p90_ms']:.3f})  {r['gb_per_s']:5.0f} GB/s  {r['of_copy']:4.0%} of copy",
              flush=True)
    out["kernels"], out["copy_gbps"] = rows, copy_gbps
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
