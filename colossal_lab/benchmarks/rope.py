"""RoPE: eager, torch.compile, our Triton kernel and Liger-Kernel's, side by side."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from colossal_lab.benchmarks.harness import Benchmark, case_line, flag, opt
from colossal_lab.benchmarks.norm_measure import _Traffic
from colossal_lab.kernels import runs_on
from colossal_lab.kernels.rope import rope_triton
from colossal_lab.measure import timing
from colossal_lab.measure.hardware import measure_copy_gbps
from colossal_lab.model import RotaryEmbedding, apply_rotary

NAME = "rope"
PROVIDERS = ("eager", "compile", "triton", "liger")
LAYOUTS = ("separate", "fused")
SEQ = (2048, 4096, 8192)
HEADLINE = ("llama-7b", 4096)
"""(model, S) of the summary table: the profiled step's shape."""
STEP_LAYERS = 8
"""Decoder layers of the profiled step (`llama-7b-8l`): the summary scales to them."""
THETA = 10000.0


@dataclass(frozen=True)
class Shape:
    """The attention heads of one model, at a batch size."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int


MODELS = {
    "llama-7b": Shape(4, 32, 32, 128),
    "tinyllama": Shape(4, 32, 4, 64),
    "llama3-8b": Shape(4, 32, 8, 128),
}
QUICK_MODELS = {"tiny-gqa": Shape(2, 4, 2, 16)}
QUICK_SEQ = (8,)


# ----------------------------------------------------------------------------- the bytes


def moved_bytes(shape: Shape, seq: int, elem: int = 2) -> tuple[int, int]:
    """(forward, backward) bytes an ideal kernel moves, N = B·S·(Hq + Hkv)·D:

    forward   read q, k; write q_rot, k_rot; read the cos/sin half-tables once
              2·N·e + 2·S·(D/2)·4
    backward  read dq_rot, dk_rot; write dq, dk; the tables     the same
    """
    n = shape.batch * seq * (shape.heads + shape.kv_heads) * shape.head_dim
    tables = 2 * seq * (shape.head_dim // 2) * 4
    return 2 * n * elem + tables, 2 * n * elem + tables


def _leaves(shape: Shape, seq: int, layout: str, dtype, device, generator=None):
    """Leaf tensors that require grad, and the q (B, S, Hq, D), k (B, S, Hkv, D) views
    of them that RoPE reads."""
    B, Hq, Hkv, D = shape.batch, shape.heads, shape.kv_heads, shape.head_dim

    def rnd(*s):
        if torch.device(device).type == "meta":  # shapes only: traffic counting
            return torch.empty(*s, dtype=dtype, device=device, requires_grad=True)
        t = torch.randn(*s, generator=generator, device=device)
        return t.to(dtype).requires_grad_()

    if layout == "separate":
        q, k = rnd(B, seq, Hq, D), rnd(B, seq, Hkv, D)
        return (q, k), q, k
    if layout != "fused":
        raise ValueError(f"layout={layout!r}; choose from {LAYOUTS}")
    qkv = rnd(B, seq, (Hq + 2 * Hkv) * D)
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # column views: strided rows
    return (qkv,), q.unflatten(-1, (Hq, D)), k.unflatten(-1, (Hkv, D))


def eager_traffic(shape: Shape, seq: int, layout: str = "separate",
                  dtype=torch.bfloat16) -> dict:
    """Bytes and aten ops of the eager path (`model.apply_rotary` on the transposed
    views), forward and backward, counted op by op on meta tensors (nothing is
    allocated). For "fused" the backward includes what autograd adds to bring the
    gradient back to the (B, S, (Hq + 2·Hkv)·D) qkv output: a transposing copy and the
    concatenation of dq, dk and the (zero) dv. The kernel docstring quotes these."""
    class _Counted(_Traffic):
        """`_Traffic`, with `_unsafe_view` (a reshape's view, whose schema does not
        say it aliases) moving nothing, as on the device."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._unsafe_view.default:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    cos = torch.empty(seq, shape.head_dim, device="meta")
    leaves, q, k = _leaves(shape, seq, layout, dtype, "meta")
    with _Counted() as fwd:
        outs = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, cos)
    grads = [torch.empty_like(o) for o in outs]
    with _Counted() as bwd:
        torch.autograd.grad(outs, leaves, grads)
    return {"fwd_bytes": fwd.nbytes, "bwd_bytes": bwd.nbytes, "fwd_kernels": fwd.kernels,
            "bwd_kernels": bwd.kernels}


# ----------------------------------------------------------------------------- providers


def _eager(q, k, cos, sin):
    """The plain model: transpose to (B, H, S, D) views, then `apply_rotary`."""
    S = q.shape[1]
    return apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos[:S], sin[:S])


def _triton(q, k, cos, sin):
    q_rot, k_rot = rope_triton(q, k, cos, sin)  # (B, S, H, D), contiguous
    return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


def _liger(q, k, cos, sin):
    from liger_kernel.ops.rope import LigerRopeFunction  # lazy: optional package

    S = q.shape[1]
    out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos[None, :S],
                                  sin[None, :S])
    return out[0], out[1]  # newer versions also return cos and sin


def provider_fn(provider: str):
    """(q, k, cos, sin) -> (q_rot, k_rot) as (B, H, S, D) tensors, for `provider`.

    "compile" is compiled afresh, static shapes, after a dynamo reset: each case gets
    the graph a training run of fixed shape gets, and never meets dynamo's
    recompilation limit (past which it would run eager under the "compile" label)."""
    if provider == "compile":
        torch._dynamo.reset()
        return torch.compile(_eager, dynamic=False)
    fns = {"eager": _eager, "triton": _triton, "liger": _liger}
    if provider not in fns:
        raise ValueError(f"unknown provider {provider!r}; choose from {PROVIDERS}")
    return fns[provider]


def liger_available() -> bool:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction  # noqa: F401  # lazy: optional
    except Exception:  # not installed, or no GPU build of Triton
        return False
    return True


def providers_here(device) -> list[str]:
    """Providers that can run on `device`: ours needs a GPU or the interpreter, Liger a
    GPU and the package."""
    out = ["eager", "compile"]
    if runs_on(device):
        out.append("triton")
    if torch.device(device).type == "cuda" and liger_available():
        out.append("liger")
    return out


# ------------------------------------------------------------------------------- timing


_time = timing.eager_and_graph  # eager and graph-replay ms, side by side


def measure(model: str, shape: Shape, seq: int, layout: str, provider: str, dtype,
            device) -> dict:
    """One provider on one case: forward and forward + backward. A failure becomes an
    `error` field."""
    fwd_bytes, bwd_bytes = moved_bytes(shape, seq, dtype.itemsize)
    row = {"kind": "op", "model": model, "layout": layout, "provider": provider,
           **asdict(shape), "seq": seq, "dtype": str(dtype).replace("torch.", ""),
           "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes}
    try:
        g = torch.Generator(device=device).manual_seed(0)
        leaves, q, k = _leaves(shape, seq, layout, dtype, device, g)
        cos, sin = RotaryEmbedding(shape.head_dim, seq, THETA).to(device)(seq, device)
        fn = provider_fn(provider)
        outs = fn(q, k, cos, sin)  # compiles ("compile"), JITs ("triton", "liger")
        # the outputs' layout; drawn from `g`, not the default generator, which a
        # failed graph capture can leave unusable for the rest of the process
        grads = [torch.empty_like(o).normal_(generator=g) for o in outs]
        torch.autograd.grad(outs, leaves, grads)

        def fwd():
            return fn(q, k, cos, sin)

        def fwd_bwd():
            return torch.autograd.grad(fn(q, k, cos, sin), leaves, grads)

        t_fwd, t_both = _time(fwd, device), _time(fwd_bwd, device)
    except Exception as e:  # out of memory, a provider's unsupported shape, ...
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row
    row["timing"] = "/".join(dict.fromkeys((t_fwd["timing"], t_both["timing"])))
    # effective bandwidth = bytes an ideal kernel moves / time (see moved_bytes)
    for name, t, nbytes in (("fwd", t_fwd, fwd_bytes),
                            ("fwd_bwd", t_both, fwd_bytes + bwd_bytes)):
        row[f"{name}_ms"] = t["ms"]
        row[f"{name}_eager_ms"] = t["eager_ms"]
        row[f"{name}_gbps"] = timing.gbps(nbytes, t["ms"])
    return row


def _add_ratios(case: list[dict]) -> None:
    """`*_speedup`: eager's time over each provider's, in this same run (> 1: faster)."""
    base = next((r for r in case if r["provider"] == "eager" and "error" not in r), None)
    if base is None:
        return
    for r in case:
        if "error" not in r:
            for k in ("fwd", "fwd_bwd", "fwd_eager", "fwd_bwd_eager"):
                r[f"{k}_speedup"] = base[f"{k}_ms"] / r[f"{k}_ms"]


# ---------------------------------------------------------------------------------- run


def run(quick: bool = False, *, models=None, seqs=None, layouts=LAYOUTS,
        providers=None) -> list[dict]:
    """Every provider on every (model, S, layout), side by side in this process, plus
    the eager chain's counted traffic and the copy ceiling.

    `quick`: a tiny GQA shape on the CPU in fp32, providers eager and triton (the
    interpreter): a smoke test, not a measurement.

    Each case rotates q (B, S, Hq, D) and k (B, S, Hkv, D) with the model's fp32 (S, D)
    tables, in bf16, and hands the attention (B, H, S, D) tensors, as the model does:

    - "eager": `model.apply_rotary` on the transposed views (the plain model's path);
    - "compile": `torch.compile` of that same function;
    - "triton": ours, `kernels.rope.rope_triton` on the (B, S, H, D) layout, then a view
      transpose;
    - "liger": Liger-Kernel's `LigerRopeFunction` on the transposed views with (1, S, D)
      tables, when `liger_kernel` is installed. (It makes (B, S, H, D) copies of strided
      inputs and rotates contiguous ones in place, allocating nothing: in the "separate"
      layout it rotates the benchmark's inputs again at each call, harmless to the timing
      since a rotation keeps their norms.)

    Two input layouts: "separate" (q and k are their own contiguous tensors: separate
    projections) and "fused" (column slices of one (B, S, (Hq + 2·Hkv)·D) qkv output:
    switch 3; strided rows, and the gradient flows back into the one qkv gradient). The
    upstream gradients have the layout of each provider's outputs (`randn_like`), as an
    attention backward returns them.

    Shapes: LLaMA-7B (32 heads, D 128), TinyLlama (GQA 32:4, D 64) and LLaMA-3-8B (GQA
    32:8, D 128), batch 4, S 2048 / 4096 / 8192. Forward, and forward + backward (with
    `torch.autograd.grad`: no .grad accumulation), timed as CUDA-graph replays
    (`timing.time_kernels`: the kernels alone, L2 flushed before each) and eagerly
    (`timing.time_fn`, `*_eager_ms`: Python launches included). The unit is effective
    bandwidth, the bytes an ideal kernel moves (`moved_bytes`) over the time, the same for
    every provider, next to the device's copy ceiling; ratios are against "eager" in the
    same run. The eager chain's real traffic, counted op by op, is in the "traffic" rows.

        python -m colossal_lab.benchmarks.rope           # -> results/<gpu>/rope.json
        python -m colossal_lab.benchmarks.rope --quick   # tiny shapes on the CPU, not saved
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if quick:
        shapes, seqs = QUICK_MODELS, seqs or QUICK_SEQ
        providers = providers or ("eager", "triton")
    else:
        shapes = {m: MODELS[m] for m in (models or MODELS)}
        seqs = seqs or SEQ
    names = [p for p in providers_here(device) if providers is None or p in providers]
    # the headline shape first: its numbers come in before anything can go wrong
    cases = sorted(((m, s) for m in shapes for s in seqs),
                   key=lambda c: (c != HEADLINE, list(shapes).index(c[0]), c[1]))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for model, seq in cases:
            for layout in layouts:
                case = [measure(model, shapes[model], seq, layout, p, dtype, device)
                        for p in names]
                _add_ratios(case)
                rows += case
                print(format_case(case), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        model, seq = cases[0]
        for layout in layouts:
            rows.append({"kind": "traffic", "model": model, "layout": layout,
                         "provider": "eager", "seq": seq, **asdict(shapes[model]),
                         "dtype": str(dtype).replace("torch.", ""),
                         **eager_traffic(shapes[model], seq, layout, dtype),
                         "ideal_fwd_bytes": moved_bytes(shapes[model], seq,
                                                        dtype.itemsize)[0],
                         "ideal_bwd_bytes": moved_bytes(shapes[model], seq,
                                                        dtype.itemsize)[1]})
    rows.append({"kind": "ceiling", "copy_gbps": measure_copy_gbps(device=device)})
    print(summary(rows))
    return rows


def format_case(case: list[dict]) -> str:
    r0 = case[0]
    head = (f"  {r0['model']:<10}S {r0['seq']:<5} {r0['layout']:<9}")
    return case_line(head + " f+b: ", case, lambda r: f"{r['provider']} "
                     f"{r['fwd_bwd_ms']:.3g} ms x{r.get('fwd_bwd_speedup', 1):.2f}")


def summary(rows: list[dict]) -> str:
    """At the headline shape (else the first measured): ms, GB/s and ratios against
    eager and the copy ceiling, forward and forward + backward, per layout; and the
    forward + backward scaled to the profiled step's `STEP_LAYERS` layers."""
    ops = [r for r in rows if r.get("kind") == "op"]
    if not ops:
        return "(no measurements)"
    ceiling = next((r["copy_gbps"] for r in rows if r.get("kind") == "ceiling"), None)
    keys = {(r["model"], r["seq"]) for r in ops}
    model, seq = HEADLINE if HEADLINE in keys else (ops[0]["model"], ops[0]["seq"])
    copy = f"copy ceiling {ceiling:.0f} GB/s" if ceiling else "no copy ceiling"
    how = ops[0].get("timing", "?")
    lines = [f"RoPE, {model} at S {seq} ({ops[0]['dtype']}); ms ({how}), effective "
             f"GB/s, speed-up over eager; {copy}",
             f"  {'layout':<9}{'provider':<9}{'fwd ms':>9}{'f+b ms':>9}{'f+b GB/s':>10}"
             f"{'fwd x':>7}{'f+b x':>7}{'f+b/copy':>9}{f'x{STEP_LAYERS} layers':>12}"]
    for r in ops:
        if (r["model"], r["seq"]) != (model, seq):
            continue
        if "error" in r:
            lines.append(f"  {r['layout']:<9}{r['provider']:<9} failed")
            continue
        share = f"{r['fwd_bwd_gbps'] / ceiling:9.0%}" if ceiling else "-".rjust(9)
        lines.append(f"  {r['layout']:<9}{r['provider']:<9}{r['fwd_ms']:9.3g}"
                     f"{r['fwd_bwd_ms']:9.3g}{r['fwd_bwd_gbps']:10.4g}"
                     f"{r.get('fwd_speedup', 0):7.2f}{r.get('fwd_bwd_speedup', 0):7.2f}"
                     f"{share}{STEP_LAYERS * r['fwd_bwd_ms']:10.3g} ms")
    return "\n".join(lines)


# -------------------------------------------------------------------------------- main


def config_of() -> dict:
    return {"models": {k: asdict(v) for k, v in MODELS.items()}, "seq": list(SEQ),
            "layouts": list(LAYOUTS), "providers": list(PROVIDERS), "dtype": "bf16",
            "tables": "fp32 (S, D) half-split, theta 10000 (RotaryEmbedding)",
            "timing": "CUDA graph replay (median, L2 flushed before each; 10-100 reps); "
                      "eager do_bench (50 ms) in *_eager_ms",
            "backward": "torch.autograd.grad, upstream gradients in each provider's "
                        "output layout (randn_like)",
            "gbps": "bytes an ideal kernel moves / time; see moved_bytes()",
            "compile": "torch.compile(dynamic=False) afresh per case, after "
                       "torch._dynamo.reset()"}


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny shapes (CPU smoke test)",
    options=[opt("--models", nargs="*", choices=list(MODELS)),
             opt("--seq", nargs="*", type=int, help=f"default {SEQ}"),
             opt("--layouts", nargs="*", choices=LAYOUTS, default=list(LAYOUTS)),
             flag("providers", choices=PROVIDERS), flag("name")],
    run=lambda a: run(a.quick, models=a.models, seqs=tuple(a.seq) if a.seq else None,
                      layouts=tuple(a.layouts), providers=a.providers),
    config=lambda a: config_of())
main = BENCH.main

if __name__ == "__main__":
    main()
