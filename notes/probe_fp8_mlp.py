"""The fp8 MLP with the SwiGLU's casts fused in (`ops.fp8_mlp`) against the composed path
(Fp8Linear, Triton SwiGLU, Fp8Linear) on the GPU, at llama-7b's MLP: 16,384 tokens,
hidden 4096, gate/up 2 x 11008, bf16 parameters, bf16 autocast, `_scaled_mm` GEMMs.
A working tool for notes/finale.md (the fp8 step), not a results file.

    python notes/probe_fp8_mlp.py OUT.json [--reps 30] [--tokens 16384]

(a) Correctness, per scaling ("delayed", "dynamic"): the fused kernels' fp8 bytes (both
layouts), amax and inverse scale against the Triton SwiGLU followed by the cast kernel;
then three forward+backward steps of each path from the same weights and inputs: y, dx,
dW_gate_up, dW_down and every amax history, as the count of differing elements and the
largest difference relative to the largest value (both 0 where the two paths quantise
the same numbers, which they do wherever the two kernels' fp32 SwiGLU math agrees).

(b) Time of one MLP forward+backward of each path (CUDA events around each rep, after
warm-up; the reps alternate between the paths): median, p10, p90 in ms; and of the
activation kernels alone (SwiGLU + cast against the fused kernel, forward and backward).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import torch.nn as nn


def _pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def _stats(ms: list[float]) -> dict:
    return dict(median_ms=statistics.median(ms), p10_ms=_pct(ms, 0.1), p90_ms=_pct(ms, 0.9),
                reps=len(ms))


def _diff(a, b) -> dict:
    a, b = a.float(), b.float()
    scale = b.abs().max().item() or 1.0
    return dict(differ=int((a != b).sum().item()), of=a.numel(),
                max_rel=(a - b).abs().max().item() / scale)


def _modules(d, i, scaling):
    from colossal_lab.ops import fp8

    cfg = fp8.Fp8Config(scaling=scaling, backend="scaled_mm")
    gu = nn.Linear(d, 2 * i, bias=False, device="cuda", dtype=torch.bfloat16)
    dn = nn.Linear(i, d, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        gu.weight.normal_(0, d ** -0.5)
        dn.weight.normal_(0, i ** -0.5)
    fused = (fp8.Fp8Linear.from_linear(gu, cfg), fp8.Fp8Linear.from_linear(dn, cfg))
    return fused, tuple(copy.deepcopy(m) for m in fused)


def _step(path, mods, x, dy):
    from colossal_lab.kernels.swiglu import swiglu_triton
    from colossal_lab.ops import fp8_mlp

    for m in mods:
        m.weight.grad = None
    x.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fp8_mlp.fp8_swiglu_mlp(x, *mods) if path == "fused" else \
            mods[1](swiglu_triton(mods[0](x)))
    y.backward(dy)
    return y


def check_kernels(t, i) -> dict:
    from colossal_lab.kernels import fp8_cast, swiglu_fp8
    from colossal_lab.kernels.swiglu import swiglu_backward, swiglu_forward

    gu = (torch.randn(t, 2 * i, device="cuda") * 3).bfloat16()
    dh = torch.randn(t, i, device="cuda").bfloat16()
    src = torch.rand(16, device="cuda") * 4 + 1
    out = {}
    for name, fused, ref in (
            ("forward", lambda a: swiglu_fp8.swiglu_fp8_forward(gu, torch.float8_e4m3fn, src,
                                                                amax_out=a),
             lambda a: fp8_cast.fp8_cast_transpose(swiglu_forward(gu), torch.float8_e4m3fn,
                                                   src, amax_out=a)),
            ("backward", lambda a: swiglu_fp8.swiglu_fp8_backward(dh, gu, torch.float8_e5m2,
                                                                  src, amax_out=a),
             lambda a: fp8_cast.fp8_cast_transpose(swiglu_backward(dh, gu),
                                                   torch.float8_e5m2, src, amax_out=a))):
        af, ar = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        (q, qt, inv), (rq, rqt, rinv) = fused(af), ref(ar)
        out[name] = dict(q_bytes_differ=int((q.view(torch.uint8) != rq.view(torch.uint8))
                                            .sum().item()),
                         qt_bytes_differ=int((qt.view(torch.uint8) != rqt.view(torch.uint8))
                                             .sum().item()),
                         padding_zero=bool((qt[:, t:].view(torch.uint8) == 0).all().item()),
                         amax=[af.item(), ar.item()], inv_scale=[inv.item(), rinv.item()])
    return out


def check_paths(t, d, i, scaling) -> dict:
    torch.manual_seed(0)
    fused, comp = _modules(d, i, scaling)
    steps = []
    for step, mag in enumerate((1.0, 1.0, 4.0)):
        x = (torch.randn(t, d, device="cuda") * mag).bfloat16().requires_grad_()
        dy = (torch.randn(t, d, device="cuda") * mag * 1e-3).bfloat16()
        yf = _step("fused", fused, x, dy).detach()
        dxf = x.grad.clone()
        yc = _step("composed", comp, x, dy).detach()
        row = dict(step=step, y=_diff(yf, yc), dx=_diff(dxf, x.grad),
                   dW_gate_up=_diff(fused[0].weight.grad, comp[0].weight.grad),
                   dW_down=_diff(fused[1].weight.grad, comp[1].weight.grad))
        row["histories_equal"] = all(
            torch.equal(a._scalers[r].history, b._scalers[r].history)
            for a, b in zip(fused, comp) for r in ("x", "w", "grad"))
        steps.append(row)
        print(scaling, row, flush=True)
    return dict(scaling=scaling, steps=steps)


def _events(fns: dict, reps: int, warmup: int = 5) -> dict:
    """CUDA events around each call; the reps interleave the functions."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    ms = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms[k].append(a.elapsed_time(b))
    return {k: _stats(v) for k, v in ms.items()}


def time_paths(t, d, i, scaling, reps) -> dict:
    torch.manual_seed(0)
    fused, comp = _modules(d, i, scaling)
    x = torch.randn(t, d, device="cuda").bfloat16().requires_grad_()
    dy = (torch.randn(t, d, device="cuda") * 1e-3).bfloat16()
    res = _events({"fused": lambda: _step("fused", fused, x, dy),
                   "composed": lambda: _step("composed", comp, x, dy)}, reps)
    res["saved_ms"] = res["composed"]["median_ms"] - res["fused"]["median_ms"]
    print(scaling, "mlp fwd+bwd", res, flush=True)
    return res


def time_kernels(t, i, reps) -> dict:
    from colossal_lab.kernels import fp8_cast, swiglu_fp8
    from colossal_lab.kernels.swiglu import swiglu_backward, swiglu_forward

    gu = (torch.randn(t, 2 * i, device="cuda") * 3).bfloat16()
    dh = torch.randn(t, i, device="cuda").bfloat16()
    src = torch.rand(16, device="cuda") * 4 + 1
    amax = torch.zeros(1, device="cuda")
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    res = _events({
        "fwd composed (swiglu, cast)": lambda: fp8_cast.fp8_cast_transpose(
            swiglu_forward(gu), e4, src, amax_out=amax),
        "fwd fused": lambda: swiglu_fp8.swiglu_fp8_forward(gu, e4, src, amax_out=amax),
        "fwd fused, dynamic (amax pass + cast)": lambda: swiglu_fp8.swiglu_fp8_forward(
            gu, e4, swiglu_fp8.swiglu_fp8_forward_amax(gu)),
        "bwd composed (swiglu', cast)": lambda: fp8_cast.fp8_cast_transpose(
            swiglu_backward(dh, gu), e5, src, amax_out=amax),
        "bwd fused": lambda: swiglu_fp8.swiglu_fp8_backward(dh, gu, e5, src, amax_out=amax),
        "bwd fused, dynamic (amax pass + cast)": lambda: swiglu_fp8.swiglu_fp8_backward(
            dh, gu, e5, swiglu_fp8.swiglu_fp8_backward_amax(dh, gu)),
    }, reps)
    for k, v in res.items():
        print(f"{k:<40} {v['median_ms']:7.3f} ms  (p10 {v['p10_ms']:.3f}, p90 "
              f"{v['p90_ms']:.3f})", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    t, d, i = a.tokens, a.hidden, a.intermediate
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               tokens=t, hidden=d, intermediate=i)
    import triton

    out["triton"] = triton.__version__
    out["kernels_check"] = check_kernels(t, i)
    print("kernels", out["kernels_check"], flush=True)
    out["check"] = [check_paths(t, d, i, s) for s in ("delayed", "dynamic")]
    out["time_mlp"] = {s: time_paths(t, d, i, s, a.reps) for s in ("delayed", "dynamic")}
    out["time_kernels"] = time_kernels(t, i, a.reps)
    from colossal_lab.kernels import swiglu_fp8

    out["tiles_chosen"] = {  # the autotuner's pick for the last shape each kernel ran
        k: str(getattr(getattr(swiglu_fp8, k), "best_config", None))
        for k in ("_swiglu_fp8_forward_kernel", "_swiglu_fp8_backward_kernel")}
    print("tiles", out["tiles_chosen"], flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
