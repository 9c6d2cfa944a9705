"""Loss switch benchmark: lm_head + cross-entropy, eager against fused, time and memory."""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from colossal_lab import precision as P
from colossal_lab.benchmarks.harness import Benchmark, flag, opt, row_line
from colossal_lab.kernels import runs_on
from colossal_lab.measure import timing
from colossal_lab.ops.cross_entropy import (
    cross_entropy_ref,
    default_chunk_tokens,
    fused_linear_cross_entropy,
)

NAME = "cross_entropy"
PROVIDERS = ("eager", "compile", "triton", "liger")
CASES = ((16384, 4096, 32000), (16384, 4096, 128256))
"""(tokens, hidden, vocab)."""
PRECISIONS = ("bf16", "bf16-pure")
QUICK_CASES = ((64, 32, 301),)
IGNORED_FRACTION = 0.05
"""Share of labels set to ignore_index (padding), so that every provider handles it."""


# --------------------------------------------------------------------------- providers


@functools.cache
def _compiled():
    return torch.compile(lambda h, w, y: cross_entropy_ref(h @ w.t(), y))


@functools.cache
def _liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # lazy: optional

    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100)


def _loss_fn(provider: str):
    """(hidden, weight, labels) -> mean loss, for one provider."""
    if provider == "eager":
        return lambda h, w, y: cross_entropy_ref(h @ w.t(), y)
    if provider == "compile":
        return _compiled()
    if provider == "triton":
        return functools.partial(fused_linear_cross_entropy, backend="triton")
    if provider == "liger":
        liger = _liger()

        def fn(h, w, y):
            out = liger(w, h, y)
            return out[0] if isinstance(out, tuple) else out  # newer: (loss, z_loss)
        return fn
    raise ValueError(f"provider={provider!r}; choose from {PROVIDERS}")


def _inputs(tokens: int, hidden: int, vocab: int, precision: str, device):
    g = torch.Generator(device=device).manual_seed(0)
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    w_dtype = torch.bfloat16 if precision == "bf16-pure" and device.type == "cuda" \
        else torch.float32
    h = torch.randn(tokens, hidden, generator=g, device=device).to(act).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, device=device) * hidden ** -0.5)
    w = w.to(w_dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    drop = torch.rand(tokens, generator=g, device=device) < IGNORED_FRACTION
    return h, w, y.masked_fill(drop, -100)


def _context(precision: str, device):
    if precision == "bf16" and device.type == "cuda":
        return P.autocast("bf16", "cuda")
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------ timing


_time = timing.eager_and_graph  # eager and graph-replay ms, side by side


def case(provider: str, tokens: int, hidden: int, vocab: int, precision: str,
         device) -> dict:
    """One provider on one case: forward+backward time and peak extra memory."""
    fwd_flops = 2 * tokens * hidden * vocab
    row = {"provider": provider, "tokens": tokens, "hidden": hidden, "vocab": vocab,
           "precision": precision, "fwd_flops": fwd_flops, "fwd_bwd_flops": 3 * fwd_flops,
           "logits_fp32_gib": tokens * vocab * 4 / 2**30}
    if provider == "triton":
        row["chunk_tokens"] = default_chunk_tokens(tokens, vocab, 2)
    try:
        loss_fn = _loss_fn(provider)
        h, w, y = _inputs(tokens, hidden, vocab, precision, device)
        row.update(hidden_dtype=str(h.dtype).replace("torch.", ""),
                   weight_dtype=str(w.dtype).replace("torch.", ""))

        def fwd_bwd():
            with _context(precision, device):
                loss = loss_fn(h, w, y)
            return torch.autograd.grad(loss, (h, w))

        fwd_bwd()  # compiles, JITs
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated() / 2**30
            timing.reset_peak_memory(device)
            fwd_bwd()
            row["peak_extra_gib"] = timing.peak_memory_gib(device) - base
        with _context(precision, device):
            row["loss"] = loss_fn(h, w, y).item()
        t = _time(fwd_bwd, device)
    except Exception as e:  # not installed, out of memory, ...
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return row
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row.update(fwd_bwd_ms=t["ms"], fwd_bwd_eager_ms=t["eager_ms"], timing=t["timing"],
               fwd_bwd_tflops=timing.tflops(3 * fwd_flops, t["ms"]))
    return row


def _ratios(rows: list[dict]) -> None:
    """Speed-up and memory against "eager" on the same case, in this same run."""
    for r in rows:
        base = next((b for b in rows if b["provider"] == "eager" and "error" not in b
                     and all(b[k] == r[k] for k in ("tokens", "hidden", "vocab",
                                                     "precision"))), None)
        if base is None or "error" in r:
            continue
        r["speedup"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        r["eager_speedup"] = base["fwd_bwd_eager_ms"] / r["fwd_bwd_eager_ms"]
        if "peak_extra_gib" in r and base.get("peak_extra_gib"):
            r["memory_ratio"] = r["peak_extra_gib"] / base["peak_extra_gib"]


# --------------------------------------------------------------------------------- run


def run(quick: bool = False, *, providers=None, cases=None, precisions=None) -> list[dict]:
    """Every provider on every case, side by side in this process.

    `quick`: one tiny case on the CPU in fp32, providers eager and triton (the kernel
    under the interpreter).

    One case per (tokens N, hidden d, vocabulary V, precision): N = 16384 tokens (our
    LLaMA-7B-8L step: 4 × 4096), d = 4096, V = 32000 (LLaMA-2) and 128256 (LLaMA-3).
    Precision "bf16" is the step's: fp32 weight, bf16 hidden states, matmuls under bf16
    autocast; "bf16-pure" has a bf16 weight and no autocast. Providers side by side:

    - "eager": `cross_entropy_ref(hidden @ weightᵀ)`, the plain model: (N, V) bf16
      logits, fp32 F.cross_entropy.
    - "compile": `torch.compile` of the same function.
    - "triton": ours, `fused_linear_cross_entropy(..., backend="triton")`: chunks of
      tokens, our Triton loss kernel writing dlogits in place, no (N, V) tensor.
    - "liger": Liger-Kernel's `LigerFusedLinearCrossEntropyLoss`, when importable.

    Each is timed forward+backward (gradients of hidden and weight): as CUDA-graph replays
    where capture works (`timing.time_kernels`; a provider that synchronises, e.g. with
    `.item()`, cannot be captured and is timed with events, said in `timing`) and eagerly
    with `do_bench` (`fwd_bwd_eager_ms`). Peak memory is what one forward+backward adds on
    top of the inputs (`timing.reset_peak_memory` / `peak_memory_gib`), with the (N, V)
    fp32 logits' size beside it for scale. FLOPs: 2·N·d·V forward (the lm_head GEMM),
    3× that forward+backward; the loss's own bytes are in `colossal_lab.kernels.cross_entropy`.

        python -m colossal_lab.benchmarks.cross_entropy          # results/<gpu>/cross_entropy.json
        python -m colossal_lab.benchmarks.cross_entropy --quick  # tiny case on the CPU, not saved
    """

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick:
        providers = providers or ("eager", "triton" if runs_on(device) else "compile")
        cases, precisions = cases or QUICK_CASES, precisions or ("bf16",)
    providers = providers or PROVIDERS
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for n, d, v in cases or CASES:
            for prec in precisions or PRECISIONS:
                for p in providers:
                    row = case(p, n, d, v, prec, device)
                    rows.append(row)
                    print(format_row(row), flush=True)
    _ratios(rows)
    print(summary(rows))
    return rows


def format_row(r: dict) -> str:
    head = f"  {r['provider']:<8}{r['tokens']:>6} x {r['hidden']:<5} V {r['vocab']:<7}" \
           f"{r['precision']:<10}"
    mem = f", +{r['peak_extra_gib']:.2f} GiB" if "peak_extra_gib" in r else ""
    return row_line(head, r, lambda r: f" {r['fwd_bwd_ms']:.3f} ms fwd+bwd ({r['timing']}){mem}")


def summary(rows: list[dict]) -> str:
    """Per case: time, speed-up over eager and peak extra memory of every provider."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return "(no measurements)"
    lines = ["forward+backward ms (speed-up over eager), peak extra GiB:"]
    for key in dict.fromkeys((r["tokens"], r["hidden"], r["vocab"], r["precision"])
                             for r in ok):
        cells = []
        for r in ok:
            if (r["tokens"], r["hidden"], r["vocab"], r["precision"]) == key:
                mem = f" {r['peak_extra_gib']:.2f}" if "peak_extra_gib" in r else ""
                cells.append(f"{r['provider']} {r['fwd_bwd_ms']:.3f} "
                             f"(x{r.get('speedup', 1):.2f}){mem}")
        lines.append(f"  N {key[0]} d {key[1]} V {key[2]} {key[3]}: " + "; ".join(cells))
    return "\n".join(lines)


def config_of() -> dict:
    return {"cases": [list(c) for c in CASES], "precisions": list(PRECISIONS),
            "providers": list(PROVIDERS), "ignored_fraction": IGNORED_FRACTION,
            "timing": "CUDA graph replay (median, L2 flushed before each; 10-100 reps) "
                      "where capturable, else events; eager do_bench (50 ms) in "
                      "fwd_bwd_eager_ms",
            "memory": "peak allocated during one forward+backward minus allocated "
                      "before it (the inputs)",
            "flops": "2·N·d·V forward, 3x forward+backward"}


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny case (CPU smoke test)",
    options=[flag("providers", choices=PROVIDERS),
             opt("--precisions", nargs="*", choices=PRECISIONS), flag("name")],
    run=lambda a: run(a.quick, providers=tuple(a.providers) if a.providers else None,
                      precisions=tuple(a.precisions) if a.precisions else None),
    config=lambda a: config_of())
main = BENCH.main


if __name__ == "__main__":
    main()
