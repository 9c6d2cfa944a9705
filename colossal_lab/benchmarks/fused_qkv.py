"""Switch 3 benchmark: fused projections, from the GEMMs up to the training step."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from colossal_lab.benchmarks.harness import Benchmark, case_line, flag, opt
from colossal_lab.benchmarks.norm_measure import _Traffic
from colossal_lab.benchmarks.steps import Setup
from colossal_lab.config import Switches, preset
from colossal_lab.measure import timing
from colossal_lab.measure.hardware import measure_copy_gbps, measure_matmul_tflops
from colossal_lab.ops import swiglu as projections

NAME = "fused_qkv"
TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
GEMM_PROVIDERS = ("separate", "fused", "fused-gemm")
SWIGLU_PROVIDERS = ("eager", "compile", "triton")
SWIGLU_CASES = ((16384, 11008), (4096, 11008), (65536, 11008), (16384, 5632))
"""(tokens, i) of the SwiGLU rows; the first is the step's shape (4 × 4096 tokens)."""
PARTS = ("gemm", "swiglu")
"""The kernel parts; the training step is `fused_qkv_step`, its own run and file."""

_BASE = {"enable_flash_attention": True, "enable_fused_normalization": "triton"}
SETUPS = (
    Setup("proj-separate", "separate q/k/v and gate/up GEMMs",
          switches=Switches(**_BASE, enable_fused_projections=False)),
    Setup("proj-fused", "fused QKV and gate/up GEMMs, eager SwiGLU",
          switches=Switches(**_BASE, enable_fused_projections="eager")),
    Setup("proj-fused-triton", "fused GEMMs + our Triton SwiGLU",
          switches=Switches(**_BASE, enable_fused_projections="triton")),
)
"""Switch 1 (best attention) and switch 2 (our Triton RMSNorm) on in every setup."""


@dataclass(frozen=True)
class Shape:
    """The projection shapes of one model."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, preset_name: str) -> Shape:
        c = preset(preset_name)
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                   c.head_dim, c.intermediate_size)

    def sizes(self, proj: str) -> list[int]:
        if proj == "qkv":
            return list(projections.qkv_sizes(self.heads, self.kv_heads, self.head_dim))
        if proj == "gate_up":
            return [self.intermediate] * 2
        raise ValueError(f"proj={proj!r}; choose 'qkv' or 'gate_up'")


MODELS = {"llama-7b": Shape.of("llama-7b"), "1b": Shape.of("1b")}
QUICK_MODELS = {"tiny-gqa": Shape(64, 4, 2, 16, 172)}


# ------------------------------------------------------------------------------ timing


_time = timing.eager_and_graph  # eager and graph-replay ms, side by side


# ------------------------------------------------------------------------------- GEMMs


def gemm_case(model: str, shape: Shape, proj: str, tokens: int, dtype, device,
              providers=GEMM_PROVIDERS) -> list[dict]:
    """Every provider on one (model, projection, tokens) case, side by side."""
    sizes = shape.sizes(proj)
    n, d = sum(sizes), shape.hidden
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=device) * scale).to(dtype)

    x = rnd(tokens, d).requires_grad_()
    ws = [rnd(s, d, scale=0.02).requires_grad_() for s in sizes]
    w_fused = torch.cat([w.detach() for w in ws]).requires_grad_()
    dys = [rnd(tokens, s) for s in sizes]
    dy_fused = torch.cat(dys, dim=-1)
    fwd_flops = 2 * tokens * d * n
    base = {"kind": "gemm", "model": model, "proj": proj, "tokens": tokens, "hidden": d,
            "out_features": n, "split": "+".join(map(str, sizes)),
            "dtype": str(dtype).replace("torch.", ""), "fwd_flops": fwd_flops,
            "fwd_bwd_flops": 3 * fwd_flops}

    fns = {
        "separate": (lambda: [F.linear(x, w) for w in ws], [x, *ws], dys),
        "fused": (lambda: F.linear(x, w_fused).split(sizes, dim=-1), [x, w_fused], dys),
        "fused-gemm": (lambda: [F.linear(x, w_fused)], [x, w_fused], [dy_fused]),
    }
    rows = []
    for p in providers:
        fwd, inputs, grads = fns[p]
        row = {**base, "provider": p}
        try:
            f = _time(fwd, device)
            fb = _time(lambda fwd=fwd, inputs=inputs, grads=grads:
                       torch.autograd.grad(list(fwd()), inputs, grads), device)
        except Exception as e:  # out of memory, ...
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            continue
        row.update(fwd_ms=f["ms"], fwd_bwd_ms=fb["ms"], fwd_eager_ms=f["eager_ms"],
                   fwd_bwd_eager_ms=fb["eager_ms"], timing=f["timing"],
                   fwd_tflops=timing.tflops(fwd_flops, f["ms"]),
                   fwd_bwd_tflops=timing.tflops(3 * fwd_flops, fb["ms"]))
        rows.append(row)
    sep = next((r for r in rows if r["provider"] == "separate" and "error" not in r), None)
    for r in rows:  # > 1: faster than three separate GEMMs, in this same run
        if sep is not None and "error" not in r:
            for k in ("fwd", "fwd_bwd", "fwd_eager", "fwd_bwd_eager"):
                r[f"{k}_speedup"] = sep[f"{k}_ms"] / r[f"{k}_ms"]
    return rows


# ------------------------------------------------------------------------------ SwiGLU


def swiglu_bytes(tokens: int, inter: int, elem: int = 2) -> tuple[int, int]:
    """(forward, backward) bytes an ideal SwiGLU moves on a (T, 2i) input:
    forward reads g, u and writes h (3·T·i·e); backward reads g, u, dh and writes dg, du
    (5·T·i·e)."""
    n = tokens * inter * elem
    return 3 * n, 5 * n


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `fn(*inputs)`
    (a view of an input counts its whole storage, once)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def eager_traffic(tokens: int, inter: int, dtype=torch.bfloat16) -> dict:
    """Bytes and aten ops of the eager SwiGLU on views, forward and backward, counted
    op by op on meta tensors (`norm_measure._Traffic`: nothing is allocated)."""

    gu = torch.randn(tokens, 2 * inter, device="meta", dtype=dtype, requires_grad=True)
    with _Traffic() as fwd:
        h = projections.swiglu_fused_ref(gu)
    dh = torch.randn(tokens, inter, device="meta", dtype=dtype)
    with _Traffic() as bwd:
        torch.autograd.grad(h, gu, dh)
    return {"fwd_bytes": fwd.nbytes, "bwd_bytes": bwd.nbytes, "fwd_kernels": fwd.kernels,
            "bwd_kernels": bwd.kernels}


def swiglu_case(provider: str, tokens: int, inter: int, dtype, device) -> dict:
    """One SwiGLU provider: forward, backward (retained graph) and both, in GB/s."""
    fwd_bytes, bwd_bytes = swiglu_bytes(tokens, inter, dtype.itemsize)
    row = {"kind": "swiglu", "provider": provider, "tokens": tokens,
           "intermediate": inter, "dtype": str(dtype).replace("torch.", ""),
           "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes}
    g = torch.Generator(device=device).manual_seed(0)
    gu = (torch.randn(tokens, 2 * inter, generator=g, device=device) * 2).to(dtype)
    gu.requires_grad_()
    dh = torch.randn(tokens, inter, generator=g, device=device).to(dtype)

    def fwd():
        return projections.swiglu(gu, provider)

    try:
        torch.autograd.grad(fwd(), gu, dh)  # compiles ("compile"), JITs ("triton")
        row["saved_bytes"] = saved_bytes(fwd)
        out = fwd()
        timings = {"fwd": _time(fwd, device),
                   "bwd": _time(lambda: torch.autograd.grad(out, gu, dh, retain_graph=True),
                                device),
                   "fwd_bwd": _time(lambda: torch.autograd.grad(fwd(), gu, dh), device)}
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return row
    row["timing"] = "/".join(dict.fromkeys(t["timing"] for t in timings.values()))
    for k, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes),
                      ("fwd_bwd", fwd_bytes + bwd_bytes)):
        row[f"{k}_ms"] = timings[k]["ms"]
        row[f"{k}_gbps"] = timing.gbps(nbytes, timings[k]["ms"])
    return row


# --------------------------------------------------------------------------------- run


def run(quick: bool = False, *, parts=PARTS, models=None, tokens=None) -> list[dict]:
    """Every part, providers side by side in this process.

    `quick`: a tiny GQA shape on the CPU (fp32), the step on the tiny preset.

    Two kinds of rows in one results file (`kind`), and the training step in its own:

    - "gemm": the q/k/v and gate/up projections of LLaMA-7B (d 4096, 32 heads, no GQA,
      i 11008) and TinyLlama-1.1B (d 2048, GQA 32:4, D 64, i 5632) over 1k … 64k tokens,
      bf16, forward and forward+backward. Providers side by side:
      "separate" (one GEMM per projection; the backward accumulates dX over them),
      "fused" (one GEMM, the output split into views as the model does; the backward
      concatenates the pieces' gradients first) and "fused-gemm" (one GEMM with one output
      gradient: the GEMMs alone, what the Triton SwiGLU's fused gradient gives gate/up).
      FLOPs = 2·T·d·N forward and 3× that forward+backward (N: summed output width).
    - "swiglu": silu(gate)·up on the fused (T, 2i) output, providers eager / compile /
      triton, in effective GB/s (3·T·i·e bytes forward, 5·T·i·e backward: what an ideal
      kernel moves) against the device copy ceiling, plus the bytes each keeps for the
      backward.
    - the `llama-7b-8l` step (seq 4096, batch 4, bf16) with switches 1 and 2 on and the
      projections separate, fused, and fused + Triton SwiGLU (`SETUPS`, each in its own
      process): `python -m colossal_lab bench fused_qkv_step` -> fused_qkv_step.json.

    Kernels are timed as CUDA-graph replays (`timing.time_cuda_graph`: the kernels alone,
    L2 flushed before each replay) and, in the `*_eager_ms` columns, eagerly with
    `do_bench` (Python launches included: where three launches cost more than one).

        python -m colossal_lab bench fused_qkv          # -> results/<gpu>/fused_qkv.json
        python -m colossal_lab bench fused_qkv --quick  # tiny shapes on the CPU, not saved
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = QUICK_MODELS if quick else {m: MODELS[m] for m in (models or MODELS)}
    tokens = tokens or ((64, 128) if quick else TOKENS)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if "gemm" in parts:
            for model, shape in shapes.items():
                for proj in ("qkv", "gate_up"):
                    for t in tokens:
                        case = gemm_case(model, shape, proj, t, dtype, device)
                        rows += case
                        print(format_gemm(case), flush=True)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
        if "swiglu" in parts:
            cases = ((64, 172), (100, 33)) if quick else SWIGLU_CASES
            provs = ("eager", "triton") if quick else SWIGLU_PROVIDERS
            for t, i in cases:
                for p in provs:
                    row = swiglu_case(p, t, i, dtype, device)
                    rows.append(row)
                    print(format_swiglu(row), flush=True)
            t, i = cases[0]
            rows.append({"kind": "traffic", "provider": "eager", "tokens": t,
                         "intermediate": i, **eager_traffic(t, i, dtype),
                         "fused_fwd_bytes": swiglu_bytes(t, i, dtype.itemsize)[0],
                         "fused_bwd_bytes": swiglu_bytes(t, i, dtype.itemsize)[1]})
    rows.append({"kind": "ceiling", "copy_gbps": measure_copy_gbps(device=device),
                 "matmul_tflops": measure_matmul_tflops(
                     n=256 if quick else None,
                     dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)})
    print(summary(rows))
    return rows


def format_gemm(case: list[dict]) -> str:
    r0 = case[0]
    head = f"  {r0['model']:<9}{r0['proj']:<8}{r0['tokens']:>6} tok"
    return case_line(head + "  f+b: ", case, lambda r: f"{r['provider']} "
                     f"{r['fwd_bwd_tflops']:.3g} TF/s x{r.get('fwd_bwd_speedup', 1):.2f}")


def format_swiglu(r: dict) -> str:
    head = f"  swiglu {r['provider']:<8}{r['tokens']:>6} x {r['intermediate']:<6}"
    if "error" in r:
        return f"{head} failed: {r['error'][:90]}"
    return (f"{head} {r['fwd_gbps']:.4g} / {r['bwd_gbps']:.4g} / {r['fwd_bwd_gbps']:.4g}"
            f" GB/s (fwd, bwd, both), saves {r['saved_bytes'] / 2**20:.1f} MiB")


def summary(rows: list[dict]) -> str:
    """Fused / separate speed-up per case (forward+backward, graph-timed), the SwiGLU
    providers at the step's shape, and the step rows."""
    lines = []
    gemm = [r for r in rows if r.get("kind") == "gemm" and "error" not in r]
    if gemm:
        lines.append("GEMMs, forward+backward speed-up over separate (kernels; eager):")
        for (model, proj) in dict.fromkeys((r["model"], r["proj"]) for r in gemm):
            for p in GEMM_PROVIDERS[1:]:
                sel = sorted((r for r in gemm if (r["model"], r["proj"], r["provider"])
                              == (model, proj, p)), key=lambda r: r["tokens"])
                cells = " ".join(f"{r['fwd_bwd_speedup']:.3f}/{r['fwd_bwd_eager_speedup']:.3f}"
                                 for r in sel)
                lines.append(f"  {model:<9}{proj:<8}{p:<11}{cells}")
    sw = [r for r in rows if r.get("kind") == "swiglu" and "error" not in r]
    ceiling = next((r for r in rows if r.get("kind") == "ceiling"), {})
    if sw:
        t, i = sw[0]["tokens"], sw[0]["intermediate"]
        lines.append(f"SwiGLU {t} x {i}, GB/s (fwd, bwd, both); copy ceiling "
                     f"{ceiling.get('copy_gbps', 0):.0f} GB/s:")
        for r in sw:
            if (r["tokens"], r["intermediate"]) == (t, i):
                lines.append(f"  {r['provider']:<9}" + "".join(
                    f" {r[k]:>9.4g}" for k in ("fwd_gbps", "bwd_gbps", "fwd_bwd_gbps")))
    return "\n".join(lines) or "(no measurements)"


def config_of() -> dict:
    return {"models": {k: asdict(v) for k, v in MODELS.items()}, "tokens": list(TOKENS),
            "dtype": "bf16", "gemm_providers": list(GEMM_PROVIDERS),
            "swiglu_providers": list(SWIGLU_PROVIDERS),
            "swiglu_cases": [list(c) for c in SWIGLU_CASES],
            "timing": "CUDA graph replay (median, L2 flushed before each; 10-100 reps) and "
                      "eager do_bench (50 ms) in *_eager_ms",
            "gemm_flops": "2·T·d·N forward, 3x forward+backward",
            "swiglu_gbps": "bytes an ideal kernel moves / time; see swiglu_bytes()"}


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny shapes (CPU smoke test)",
    options=[opt("--parts", nargs="*", choices=PARTS, default=list(PARTS)),
             opt("--models", nargs="*", choices=list(MODELS)),
             opt("--tokens", nargs="*", type=int, help=f"default {TOKENS}"),
             flag("name")],
    run=lambda a: run(a.quick, parts=tuple(a.parts), models=a.models,
                      tokens=tuple(a.tokens) if a.tokens else None),
    config=lambda a: config_of())
main = BENCH.main


if __name__ == "__main__":
    main()
