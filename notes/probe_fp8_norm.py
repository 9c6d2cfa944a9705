"""RMSNorm writing its output in fp8 (`kernels.rms_norm_fp8`, `ops.fp8_norm`) against the
composed path (the Triton norm writing y, then the projection's cast) on the GPU, at
llama-7b: 16,384 tokens, hidden 4096, bf16, delayed scaling, `_scaled_mm` GEMMs. A
working tool for notes/finale.md (the fp8 step), not a results file.

    python notes/probe_fp8_norm.py OUT.json [--reps 20] [--tokens 16384]

(a) Bits of the kernel, with a residual and without, against `add_rms_norm_forward` /
`rms_norm_forward` followed by `fp8_cast_transpose`: the cast per tile of
`rms_norm_fp8.CAST_TILES` (BLOCK_T, BLOCK_C: two passes, at the norm kernel's warps)
and as autotuned, its q, qᵀ, h, rstd, inv_scale and amax as counts of differing
elements (0 expected); the amax pass of dynamic scaling per tile of `rms_norm_fp8.TILES`
(one pass and two) and as autotuned, its amax (the tiles the autotuners chose are
recorded). The amax pass at one-pass tiles of other warps too, which may reduce a row
in another order (its amax may differ in the last bit): whether they are faster says
what holding the norm kernel's warps costs.
(b) Time of the norm + cast pair (`timing.time_kernels`, CUDA-graph replay): composed
(norm kernel, then cast kernel) against the fused cast per tile and autotuned, and the
amax pass per tile and autotuned; GB/s from the DRAM bytes each moves (bf16: composed
12 with a residual, 8 without; fused 8 and 4 bytes an element of y; the amax pass 4 and
2; two passes re-read h, or x, from L2 on top) against the copy rate.
(c) The two nodes the norms feed, with the norm inside (`fp8_fuse_norm`) against the
norm followed by the same node: the qkv projection + RoPE (32 + 2 x 32 heads of 128)
and the MLP (gate/up 2 x 11008): the forward+backward time (CUDA events, reps
alternating between the paths) and, after two steps, the count of differing elements
of every output and gradient and whether the histories agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import torch.nn as nn

from colossal_lab.kernels import fp8_cast, rms_norm_fp8
from colossal_lab.kernels._norm_common import launch_config
from colossal_lab.kernels.rms_norm import add_rms_norm_forward, rms_norm_forward
from colossal_lab.measure import hardware, timing
from colossal_lab.ops import fp8, fp8_mlp, fp8_qkv
from colossal_lab.ops.norm import RMSNorm

E4 = torch.float8_e4m3fn
EPS = 1e-6


def _pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def _differ(a, b) -> int:
    if a is None or b is None:
        return 0 if a is None and b is None else -1
    if a.dtype == E4:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return int((a != b).sum().item())


def _tile_name(what, block_t, block_c, tile_warps=None, norm_warps=None):
    passes = f"2 passes x {block_c} cols" if block_c else "1 pass"
    return f"{what} {block_t} tokens, {passes}, {tile_warps or norm_warps} warps"


def _chosen(warps, cast):
    """The tile the autotuner of the cast (or of the amax pass) chose at `warps`."""
    best = rms_norm_fp8._autotuned(warps, cast).best_config
    return [best.kwargs["BLOCK_T"], best.kwargs["BLOCK_C"]]


def _kernels(T, d, res_on, reps, copy_gbps):
    """(a) and (b) for one case: rows of bits and times."""
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(T, d, device="cuda", dtype=torch.bfloat16) if res_on else None
    w = (torch.rand(d, device="cuda") + 0.5).bfloat16()
    src = torch.tensor([2.0, 3.5], device="cuda")  # a history (delayed scaling)
    warps = launch_config(d, x.dtype, small=False).num_warps
    ar = torch.zeros(1, device="cuda")
    if res is None:
        (y, rstd), h = rms_norm_forward(x, w, EPS), None
    else:
        y, h, rstd = add_rms_norm_forward(x, res, w, EPS)
    ref = (*fp8_cast.fp8_cast_transpose(y, E4, src, amax_out=ar), h, rstd, ar)
    cast_tiles = [*rms_norm_fp8.CAST_TILES, None]  # None: the autotuner's choice
    amax_tiles = [*rms_norm_fp8.TILES, None]
    amax_tiles += [(t, 0, wp) for t in (4, 8, 16) for wp in (4, 16) if wp != warps]
    bits, amax_bits, rows, chosen = [], [], [], {}
    for tile in cast_tiles:
        af = torch.zeros(1, device="cuda")
        out = (*rms_norm_fp8.rms_norm_fp8(x, res, w, EPS, E4, src, amax_out=af, tile=tile),
               af)
        bits.append(dict(tile=tile, **{k: _differ(a, b) for k, a, b in zip(
            ("q", "qt", "inv", "h", "rstd", "amax"), out, ref)}))
    chosen["cast"] = _chosen(warps, True)
    for tile in amax_tiles:
        amax_bits.append(dict(tile=tile, amax_pass=_differ(rms_norm_fp8.rms_norm_fp8_amax(
            x, res, w, EPS, tile=tile), ar)))
    chosen["amax"] = _chosen(warps, False)
    print("bits", json.dumps(bits), "amax pass", json.dumps(amax_bits), "autotuned",
          chosen, flush=True)
    n = T * d
    moved = {"composed": (12 if res_on else 8) * n, "fused": (8 if res_on else 4) * n,
             "amax pass": (4 if res_on else 2) * n}

    def composed():
        yy = rms_norm_forward(x, w, EPS)[0] if res is None else \
            add_rms_norm_forward(x, res, w, EPS)[0]
        fp8_cast.fp8_cast_transpose(yy, E4, src)

    cases = [("composed: norm + cast", "composed", composed)]
    for tile in cast_tiles:
        name = "fused, autotuned" if tile is None else _tile_name("fused", *tile, warps)
        cases.append((name, "fused", lambda tile=tile: rms_norm_fp8.rms_norm_fp8(
            x, res, w, EPS, E4, src, tile=tile)))
    for tile in amax_tiles:
        name = "amax pass, autotuned" if tile is None else \
            _tile_name("amax pass", *tile, warps)
        cases.append((name, "amax pass", lambda tile=tile: rms_norm_fp8.rms_norm_fp8_amax(
            x, res, w, EPS, tile=tile)))
    for name, kind, fn in cases:
        t, how = timing.time_kernels(fn, reps=reps)
        gbps = moved[kind] / t.median_ms / 1e6
        rows.append(dict(kernel=name, median_ms=t.median_ms, p10_ms=t.p10_ms,
                         p90_ms=t.p90_ms, gb_per_s=gbps, of_copy=gbps / copy_gbps, how=how))
        print(f"{name:<40} {t.median_ms:6.3f} ms ({t.p10_ms:.3f}-{t.p90_ms:.3f})  "
              f"{gbps:5.0f} GB/s  {gbps / copy_gbps:4.0%} of copy", flush=True)
    return dict(residual=res_on, norm_warps=warps, autotuned_tile=chosen, bits=bits,
                amax_bits=amax_bits, kernels=rows)


def _node_step(block, path, mods, x, res, cos, sin, heads):
    """One forward+backward of the qkv + RoPE node or the MLP node behind the norm,
    with the norm inside ("fused") or in front ("composed"): outputs and gradients."""
    norm, *projs = mods
    xi, ri = x.detach().requires_grad_(), res.detach().requires_grad_()
    for m in mods:
        m.weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if path == "fused":
            outs = fp8_qkv.fp8_qkv_rope(xi, projs[0], *heads, cos, sin, norm, ri) \
                if block == "qkv" else fp8_mlp.fp8_swiglu_mlp(xi, *projs, norm, ri)
        else:
            normed, h = norm(xi, residual=ri)
            outs = (*fp8_qkv.fp8_qkv_rope(normed, projs[0], *heads, cos, sin), h) \
                if block == "qkv" else (fp8_mlp.fp8_swiglu_mlp(normed, *projs), h)
    torch.autograd.backward(list(outs), [torch.full_like(o, 1e-3) for o in outs])
    return [o.detach() for o in outs] + [xi.grad, ri.grad] + [m.weight.grad for m in mods]


def _nodes(T, reps):
    """(c): the qkv + RoPE node and the MLP node, norm inside against norm then node."""
    d, n_q, n_kv, hd, inter = 4096, 32, 32, 128, 11008
    B, S = max(1, T // 4096), min(T, 4096)
    pos = torch.arange(S, dtype=torch.float32, device="cuda")[:, None]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32, device="cuda") / hd)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    cos, sin = ang.cos(), ang.sin()
    cfg = fp8.Fp8Config(scaling="delayed", backend="scaled_mm", fuse_norm=True)
    out = {}
    for block, widths in (("qkv", [(d, (n_q + 2 * n_kv) * hd)]),
                          ("mlp", [(d, 2 * inter), (inter, d)])):
        torch.manual_seed(0)
        norm = RMSNorm(d, backend="triton").cuda().bfloat16()
        projs = [fp8.Fp8Linear.from_linear(
            nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16), cfg)
            for i, o in widths]
        paths = {"fused": (norm, *projs), "composed": copy.deepcopy((norm, *projs))}
        args = (torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16),
                torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16), cos, sin,
                (n_q, n_kv))
        for _ in range(2):  # the first step starts the histories
            a, b = (_node_step(block, p, paths[p], *args) for p in ("fused", "composed"))
        bits = {"outputs_and_grads": [_differ(u, v) for u, v in zip(a, b)],
                "histories": all(torch.equal(p._scalers[r].history, q._scalers[r].history)
                                 for p, q in zip(paths["fused"][1:], paths["composed"][1:])
                                 for r in ("x", "w", "grad"))}
        times = {"fused": [], "composed": []}
        for i in range(reps + 3):
            for path in ("fused", "composed")[:: 1 if i % 2 else -1]:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                _node_step(block, path, paths[path], *args)
                e1.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times[path].append(e0.elapsed_time(e1))
        out[block] = {"bits": bits, **{p: dict(
            median_ms=statistics.median(t), p10_ms=_pct(t, 0.1), p90_ms=_pct(t, 0.9),
            reps=len(t)) for p, t in times.items()}}
        print(block, json.dumps(out[block]), flush=True)
        del paths, norm, projs
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--skip-nodes", action="store_true", help="(a) and (b) only")
    args = ap.parse_args()
    T, d = args.tokens, 4096
    copy_gbps = hardware.measure_copy_gbps()
    out = {"device": torch.cuda.get_device_name(), "tokens": T, "hidden": d,
           "copy_gbps": copy_gbps,
           "cases": [_kernels(T, d, r, 30, copy_gbps) for r in (True, False)]}
    if not args.skip_nodes:
        out["nodes"] = _nodes(T, args.reps)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
