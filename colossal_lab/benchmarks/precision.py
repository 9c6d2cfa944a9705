"""Switch 6 benchmark: precision, from the GEMM to the training step to the loss curve."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from colossal_lab import precision as P
from colossal_lab.benchmarks.curves import FINAL_WINDOW, Curve
from colossal_lab.benchmarks.curves import run_curves as train_curves
from colossal_lab.benchmarks.harness import Benchmark, Invocation, flag, opt, row_line
from colossal_lab.benchmarks.steps import Setup, run_setups, step_config
from colossal_lab.config import ModelConfig, Switches, tiny
from colossal_lab.measure.results import load_results
from colossal_lab.measure.timing import tflops, time_kernels
from colossal_lab.ops import fp8

LINEARS = (("q/k/v/o_proj", 4096, 4096), ("qkv_proj", 4096, 12288),
           ("gate/up_proj", 4096, 11008), ("gate_up_proj", 4096, 22016),
           ("down_proj", 11008, 4096), ("lm_head", 4096, 32000))
"""(name, in_features K, out_features N) of LLaMA-7B's linears, fused ones included."""
TOKENS = (4096, 8192, 16384, 32768)
PARTS = ("gemm", "step", "curve")

BASE = dict(enable_flash_attention=True, enable_fused_normalization="triton",
            enable_fused_projections=True)
"""Switches 1-3 on in every step setup: only the precision changes."""


def _setup(name, label, precision, extra=None, **kw) -> Setup:
    return Setup(name, label, switches=Switches(**BASE, precision=precision,
                                                extra=extra or {}), **kw)


SETUPS = (
    _setup("fp32", "fp32, PyTorch's default (no TF32)", "fp32", warmup=1),
    _setup("tf32", "fp32 weights, TF32 matmuls", "tf32"),
    _setup("bf16", "bf16 autocast, fp32 weights", "bf16"),
    _setup("bf16-pure", "bf16 weights, fp32 master weights", "bf16-pure"),
    _setup("fp16", "fp16 autocast, dynamic loss scaling", "fp16"),
    _setup("fp8", "fp8 linears, dynamic scaling", "fp8"),
    _setup("fp8-delayed", "fp8 linears, delayed scaling", "fp8",
           {"fp8_scaling": "delayed"}),
)

CURVE_CFG = ModelConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=6, num_attention_heads=12,
                        num_key_value_heads=12, max_position_embeddings=1024)
"""The loss-curve model: ~55M parameters, every linear fp8-eligible."""
CURVE_RUN = dict(batch=16, seq_len=512, steps=300, lr=6e-4, max_files=600, log_every=50,
                 eval_batches=8)
CURVE_SETUPS = (("fp32", "fp32", {}), ("bf16", "bf16", {}), ("fp8", "fp8", {}),
                ("fp8-delayed", "fp8", {"fp8_scaling": "delayed"}))


# ----------------------------------------------------------------------------- GEMMs


def _linear_fn(provider: str, x, w, dy):
    """A callable doing one forward (+ backward) of `provider` on x (M, K), w (N, K)."""
    dev = x.device.type
    if provider == "bf16_mm":
        xb, wb = x.detach().to(torch.bfloat16), w.detach().to(torch.bfloat16)
        return lambda: torch.mm(xb, wb.t())
    if provider == "fp8_scaled_mm":
        sx = fp8.amax_to_scale(x.abs().amax(), fp8.E4M3)
        sw = fp8.amax_to_scale(w.abs().amax(), fp8.E4M3)
        xq, wq = fp8.quantize(x, sx, fp8.E4M3), fp8.quantize(w, sw, fp8.E4M3)
        ix, iw = (1 / sx).reshape(1), (1 / sw).reshape(1)
        return lambda: fp8.scaled_mm(xq, wq.t(), ix, iw, torch.bfloat16,
                                     use_fast_accum=True)
    if provider == "bf16_linear":
        def bf16_linear():
            with P.autocast("bf16", dev):
                y = F.linear(x, w)
            return torch.autograd.grad(y, (x, w), dy)
        return bf16_linear
    scaling = "delayed" if provider == "fp8_linear_delayed" else "dynamic"
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device)
    lin.weight = w
    mod = fp8.Fp8Linear.from_linear(lin, fp8.Fp8Config(scaling=scaling))

    def fp8_linear():
        with P.autocast("bf16", dev):
            y = mod(x)
        return torch.autograd.grad(y, (x, w), dy)
    return fp8_linear


GEMM_PROVIDERS = ("bf16_mm", "fp8_scaled_mm", "bf16_linear", "fp8_linear",
                  "fp8_linear_delayed")
_BASELINE = {"fp8_scaled_mm": "bf16_mm", "fp8_linear": "bf16_linear",
             "fp8_linear_delayed": "bf16_linear"}


def measure_gemm(name: str, k: int, n: int, m: int, device) -> list[dict]:
    """Every provider on one (M tokens, K, N) case; the activation is bf16 (what the
    previous layer hands over under autocast), the weight fp32 (the master)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter(torch.randn(n, k, generator=g, device=device) * 0.02)
    dy = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
    rows = []
    for p in GEMM_PROVIDERS:
        fwd_bwd = "linear" in p
        row = {"kind": "gemm", "provider": p, "linear": name, "tokens": m,
               "in_features": k, "out_features": n, "pass": "fwd_bwd" if fwd_bwd else "fwd"}
        try:
            fn = _linear_fn(p, x, w, dy)
            fn()
            t, row["timing"] = time_kernels(fn, device=device)  # graph replay where it works
            ms = t.median_ms
            flops = (6 if fwd_bwd else 2) * m * n * k  # fwd: y; bwd: dx and dW
            row.update(ms=ms, tflops=tflops(flops, ms))
        except Exception as e:  # out of memory, no fp8 on this GPU, ...
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    by = {r["provider"]: r for r in rows}
    for p, base in _BASELINE.items():
        if by[p].get("tflops") and by[base].get("tflops"):
            by[p]["speedup_vs_bf16"] = by[p]["tflops"] / by[base]["tflops"]
    return rows


def run_gemm(quick: bool = False) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    linears = (("small", 64, 48), ("wide", 48, 96)) if quick else LINEARS
    tokens = (48,) if quick else TOKENS
    rows = []
    for name, k, n in linears:
        for m in tokens:
            for r in measure_gemm(name, k, n, m, device):
                rows.append(r)
                print(format_gemm(r), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_gemm(r: dict) -> str:
    head = f"  {r['linear']:<13}{r['tokens']:>6} x {r['in_features']}->{r['out_features']:<6}" \
           f"{r['provider']:<20}"
    sp = f"  x{r['speedup_vs_bf16']:.2f} vs bf16" if "speedup_vs_bf16" in r else ""
    return row_line(head, r, lambda r: f"{r['tflops']:8.1f} TFLOP/s ({r['pass']}){sp}", 80)


# ----------------------------------------------------------------------------- steps


def run_steps(quick: bool = False, setups=SETUPS) -> list[dict]:
    if quick:  # tiny model with widths fp8 can take, in this process
        setups = [s for s in setups if s.name != "fp8-delayed"]
        rows = run_setups([_quick(s) for s in setups], preset_name="tiny", seq_len=32,
                          batch=2, isolate=False, tag="precision")
    else:
        rows = run_setups(setups, preset_name="llama-7b-8l", seq_len=4096, batch=4,
                          tag="precision")
    for r in rows:
        r["kind"] = "step"
        r["mfu_peak"] = "dense bf16 datasheet peak"
        if r.get("precision") == "fp8" or r.get("setup", "").startswith("fp8"):
            r["mfu_note"] = "vs bf16 peak"
    return rows


def _quick(s: Setup) -> Setup:
    sw = s.switches.replace(enable_flash_attention=False, enable_fused_normalization=False,
                            enable_fused_projections=False)
    return dataclasses.replace(s, switches=sw)


# ------------------------------------------------------------------------ loss curves


def run_curves(quick: bool = False) -> list[dict]:

    if quick:
        cfg = tiny().replace(intermediate_size=176)  # every width a multiple of 16
        run = dict(batch=4, seq_len=32, steps=6, lr=3e-3, max_files=20, log_every=3,
                   eval_batches=1)
        base = {}
    else:
        cfg, run, base = CURVE_CFG, CURVE_RUN, BASE
        if not torch.cuda.is_available():
            base = {}
    curves = [Curve(name, Switches(**base, precision=precision, extra=extra),
                    fields={"scaling": extra.get("fp8_scaling")})
              for name, precision, extra in CURVE_SETUPS]
    return train_curves(curves, cfg, run, reference="bf16")


# ------------------------------------------------------------------------------- main


def run(quick: bool = False, parts=PARTS) -> list[dict]:
    """The parts asked for, in order (each row has a `kind`).

    Three parts, each saved to its own file with its own provenance,
    `results/<gpu>/precision_<part>.json` (rows carry a `kind`):

    * ``gemm``: LLaMA-7B's linear shapes (d=4096 → 4096 / 12288 / 11008 / 22016 / 32000
      and 11008 → 4096) over 4k–32k tokens. Raw GEMMs (bf16 `torch.mm` against fp8
      `torch._scaled_mm` on pre-cast operands, forward only) and whole linears (bf16
      autocast `F.linear` against our `Fp8Linear`, forward + backward, casts included,
      dynamic and delayed scaling), side by side; TFLOP/s = 2·M·N·K (forward) or 6·M·N·K
      (forward + backward) over the time; fp8 rows carry `speedup_vs_bf16`.
    * ``step``: the `llama-7b-8l` training step (seq 4096, batch 4, switches 1–3 on) in
      fp32 (PyTorch's default: no TF32), tf32, bf16, bf16-pure, fp16 and fp8 (dynamic,
      delayed), each in its own process via
      `benchmarks.steps`; MFU is always against the dense **bf16** peak (`mfu_peak`), also
      for fp8 ("MFU vs bf16 peak"), so the rows compare.
    * ``curve``: a ~55M-parameter LLaMA (every width a multiple of 16, so fp8 really
      runs everywhere) trained on the real-text corpus for a few hundred steps in fp32,
      bf16 and fp8, same seed and data order; the curve, the final loss (mean of the last
      `FINAL_WINDOW` steps) and its relative difference from bf16.

        python -m colossal_lab bench precision                 # all three (~8 min, H200)
        python -m colossal_lab bench precision --parts gemm    # one part, one file
        python -m colossal_lab bench precision --quick         # CPU smoke test, seconds
    """
    rows = []
    if "gemm" in parts:
        rows += run_gemm(quick)
    if "step" in parts:
        rows += run_steps(quick)
    if "curve" in parts:
        rows += run_curves(quick)
    print(summary(rows))
    return rows


def summary(rows: list[dict]) -> str:
    """The headline ratios: fp8/bf16 GEMM and step speed, and the loss difference."""
    lines = ["precision summary"]
    lin = [r for r in rows if r.get("kind") == "gemm" and r.get("speedup_vs_bf16")]
    for p in ("fp8_scaled_mm", "fp8_linear", "fp8_linear_delayed"):
        sel = [r["speedup_vs_bf16"] for r in lin if r["provider"] == p]
        if sel:
            lines.append(f"  {p:<20} x{min(sel):.2f} .. x{max(sel):.2f} vs bf16 "
                         f"({len(sel)} shapes)")
    steps = {r["setup"]: r for r in rows if r.get("kind") == "step" and "error" not in r}
    for name, r in steps.items():
        ratio = r["tokens_per_s"] / steps["bf16"]["tokens_per_s"] if "bf16" in steps else 0
        lines.append(f"  step {name:<12} {r['tokens_per_s']:>10,.0f} tok/s  MFU "
                     f"{r['mfu']:.1%} (vs bf16 peak)  x{ratio:.2f} vs bf16")
    for r in rows:
        if r.get("kind") == "loss_curve":
            lines.append(f"  curve {r['setup']:<12} final loss {r['final_loss']:.4f} "
                         f"({r['rel_diff_vs_bf16']:+.2%} vs bf16)")
    return "\n".join(lines)


def config_of() -> dict:
    return {**step_config(), "linears": [list(x) for x in LINEARS], "tokens": list(TOKENS),
            "gemm_timing": "CUDA graph replay, median of 100, L2 flushed (events where "
                           "capture fails: row 'timing')",
            "gemm_tflops": "2·M·N·K forward, 6·M·N·K forward+backward",
            "linear_inputs": "x bf16, weight fp32 (master), bf16 autocast",
            "fp8": "e4m3 forward, e5m2 gradients, per-tensor scales, fast accumulation "
                   "forward only",
            "step_switches": BASE,
            "curve_model": {k: getattr(CURVE_CFG, k) for k in
                            ("vocab_size", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads")},
            "curve_run": CURVE_RUN, "final_window": FINAL_WINDOW,
            "mfu_peak": "dense bf16 datasheet peak, for every precision (fp8: vs bf16 peak)"}


def file_name(part: str, base: str = "precision") -> str:
    """Each part in its own results file, so each keeps the provenance of its run."""
    return f"{base}_{part}"


def load(gpu: str | None = None) -> list[dict]:
    """The rows of every recorded part (each file's rows keep their `kind`)."""

    return [r for part in PARTS for r in load_results(file_name(part), gpu).rows]


def _save_parts(call: Invocation) -> None:
    """Each part measured and saved in turn: a crash loses one part."""
    if call.args.quick:
        run(True, tuple(call.args.parts))
        return
    for part in call.args.parts:
        call.save(run(False, (part,)), name=file_name(part, call.args.name),
                  config=config_of(),
                  command=f"python -m colossal_lab bench precision --parts {part}")


BENCH = Benchmark(
    "precision", __doc__, quick_help="tiny shapes (CPU smoke test)",
    options=[opt("--parts", nargs="*", choices=PARTS, default=list(PARTS)),
             flag("name", default="precision", help="file names: NAME_<part>.json")],
    execute=_save_parts)
main = BENCH.main


if __name__ == "__main__":
    main()
