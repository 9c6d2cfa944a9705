"""Switch 2 benchmark: fused normalisation, every provider side by side in one process.

Ops: `rms_norm`, `layer_norm` and `add_rms_norm` (h = x + residual, then RMSNorm). For
each (op, hidden, tokens) the providers eager / torch / compile / triton / liger / apex
(the last two when installed) and, for `add_rms_norm`, "separate" (a torch add, then our
Triton RMSNorm: what the fused add saves) are timed forward, backward and both, in bf16.

The norms are memory-bound, so the unit is effective bandwidth: the bytes an ideal
kernel must move divided by the time (formulas in `moved_bytes`, next to the timing),
the same bytes for every provider. A provider that moves more (eager's fp32
intermediates) shows up as fewer GB/s. The copy bandwidth measured in the same run is
the ceiling.

    python -m colossal_lab bench fused_norm          # -> results/<gpu>/fused_norm.json
    python -m colossal_lab bench fused_norm --quick  # tiny shapes, CPU smoke test
    python -m colossal_lab bench fused_norm --tune   # launch parameters of our kernels
    python -m colossal_lab.benchmarks.fused_norm     # the same without the CLI
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colossal_lab.hardware import measure_copy_gbps
from colossal_lab.results import save_results
from colossal_lab.switches import norm
from colossal_lab.timing import gbps, time_fn, time_kernels

OPS = ("rms_norm", "layer_norm", "add_rms_norm")
PROVIDERS = ("eager", "torch", "compile", "triton", "liger", "apex", "separate")
HIDDEN = (1024, 2048, 4096, 8192, 16384)
TOKENS = (4096, 16384, 65536)
HEADLINE = (16384, 4096)
"""(tokens, hidden) of the summary table and of the first compile (see `run`)."""
MAX_CASE_BYTES = 8 << 30
"""Skip cases whose inputs, outputs and gradients exceed this (eager needs more)."""
EPS = 1e-6


# ----------------------------------------------------------------------------- the bytes


def moved_bytes(op: str, tokens: int, hidden: int, elem: int = 2,
                w_elem: int | None = None) -> tuple[int, int]:
    """(forward, backward) bytes an ideal kernel moves; N = tokens·hidden, e = `elem`.

    rms_norm      fwd: read x, w; write y, rstd             2Ne + wH + 4T
                  bwd: read x, dy, w, rstd; write dx, dw    3Ne + 2wH + 4T
    layer_norm    fwd: read x, w, b; write y, mean, rstd    2Ne + 2wH + 8T
                  bwd: read x, dy, w, mean, rstd; write dx, dw, db   3Ne + 3wH + 8T
    add_rms_norm  fwd: read x, residual, w; write h, y, rstd          4Ne + wH + 4T
                  bwd: read dy, dh_in, h, w, rstd; write dh (= dx = dresidual), dw
                                                                       4Ne + 2wH + 4T
    fwd+bwd is the sum: the forward's outputs are written, the backward reads them.
    """
    n, w, t = tokens * hidden, (w_elem or elem) * hidden, tokens
    if op == "rms_norm":
        return 2 * n * elem + w + 4 * t, 3 * n * elem + 2 * w + 4 * t
    if op == "layer_norm":
        return 2 * n * elem + 2 * w + 8 * t, 3 * n * elem + 3 * w + 8 * t
    if op == "add_rms_norm":
        return 4 * n * elem + w + 4 * t, 4 * n * elem + 2 * w + 4 * t
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


class _Traffic(TorchDispatchMode):
    """Sums, over every aten op that runs, the bytes of its tensor inputs and outputs:
    the traffic of an unfused execution with no cache reuse. Views move nothing."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        is_view = not schema.is_mutable and any(r.alias_info is not None
                                                for r in schema.returns)
        if not is_view:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                       if isinstance(t, torch.Tensor)]
            # an expanded (stride-0) tensor is read once from its storage
            self.nbytes += sum(min(t.numel() * t.element_size(),
                                   t.untyped_storage().nbytes()) for t in tensors)
            self.kernels += 1
        return out


def traffic_bytes(op: str, tokens: int, hidden: int, dtype=torch.bfloat16,
                  w_dtype=None) -> dict:
    """Bytes (and aten ops) of the eager reference, forward and backward, counted op by
    op on meta tensors (no memory, no compute). The module docstrings quote these."""
    dev = "meta"
    x = torch.randn(tokens, hidden, dtype=dtype, device=dev, requires_grad=True)
    w = torch.randn(hidden, dtype=w_dtype or dtype, device=dev, requires_grad=True)
    if op == "rms_norm":
        inputs, fn = (x, w), lambda x, w: norm.rms_norm_ref(x, w, EPS)
    elif op == "layer_norm":
        b = torch.randn(hidden, dtype=w_dtype or dtype, device=dev, requires_grad=True)
        inputs, fn = (x, w, b), lambda x, w, b: norm.layer_norm_ref(x, w, b, EPS)
    else:
        r = torch.randn(tokens, hidden, dtype=dtype, device=dev, requires_grad=True)
        inputs, fn = (x, r, w), lambda x, r, w: norm.add_rms_norm_ref(x, r, w, EPS)
    with _Traffic() as fwd:
        outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    with _Traffic() as bwd:
        torch.autograd.grad(outs, inputs, grads)
    return {"fwd_bytes": fwd.nbytes, "bwd_bytes": bwd.nbytes,
            "fwd_kernels": fwd.kernels, "bwd_kernels": bwd.kernels}


# ------------------------------------------------------------------------------- timing


def _provider_fn(op: str, provider: str):
    if provider == "separate":  # the unfused baseline of the fused add
        from colossal_lab.kernels.rms_norm import rms_norm_triton

        def separate(x, r, w):
            h = x + r
            return rms_norm_triton(h, w, EPS), h

        return separate
    if provider == "compile":  # no fallback to torch here: a failure must show as one
        compiled = norm._compiled(op)
        if op == "rms_norm":
            return lambda x, w: compiled(x, w, EPS)
        if op == "layer_norm":
            return lambda x, w, b: compiled(x, w, b, EPS)
        return lambda x, r, w: compiled(x, r, w, EPS)
    if op == "rms_norm":
        return lambda x, w: norm.rms_norm(x, w, EPS, backend=provider)
    if op == "layer_norm":
        return lambda x, w, b: norm.layer_norm(x, w, b, EPS, backend=provider)
    return lambda x, r, w: norm.add_rms_norm(x, r, w, EPS, backend=provider)


def _inputs(op: str, tokens: int, hidden: int, dtype, device):
    """Random inputs (never zeros) that require grad, and the upstream gradients."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=g, device=device) * scale + shift
        return t.to(dtype).requires_grad_(True)

    x, w = rnd(tokens, hidden), rnd(hidden, scale=0.1, shift=1.0)
    if op == "rms_norm":
        inputs = (x, w)
    elif op == "layer_norm":
        inputs = (x, w, rnd(hidden, scale=0.1))
    else:
        inputs = (x, rnd(tokens, hidden), w)
    n_out = 2 if op == "add_rms_norm" else 1
    grads = tuple(torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
                  for _ in range(n_out))
    return inputs, grads


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def measure(op: str, provider: str, tokens: int, hidden: int, dtype=torch.bfloat16,
            device=None) -> dict:
    """Time one provider on one case: forward, backward (on a retained graph) and both.
    A failure becomes an `error` field; the other timings are kept."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    row = {"kind": "op", "op": op, "provider": provider, "tokens": tokens,
           "hidden": hidden, "dtype": str(dtype).replace("torch.", "")}
    fwd_bytes, bwd_bytes = moved_bytes(op, tokens, hidden, dtype.itemsize)
    row.update(fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes)
    errors = []
    try:
        fn = _provider_fn(op, provider)
        inputs, grads = _inputs(op, tokens, hidden, dtype, device)
        outs = _as_tuple(fn(*inputs))  # also compiles ("compile") and JITs ("triton")
        torch.autograd.grad(outs, inputs, grads)
    except Exception as e:  # an op a provider lacks, out of memory, ...
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row

    def fwd():
        return fn(*inputs)

    def fwd_bwd():
        # autograd.grad, not .backward(): no accumulation kernels into .grad
        return torch.autograd.grad(_as_tuple(fn(*inputs)), inputs, grads)

    timings, methods = {}, []
    for name, make in (("fwd", lambda: fwd), ("fwd_bwd", lambda: fwd_bwd),
                       ("bwd", lambda: _backward_only(fn, inputs, grads))):
        try:  # graph replay: kernel time without Python launch gaps, else eager
            t, how = time_kernels(make(), device=device)
            timings[name] = t.median_ms
            methods.append(how)
        except Exception as e:
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            timings[name] = None
    row["timing"] = "/".join(dict.fromkeys(methods))
    # effective bandwidth = bytes an ideal kernel moves / time (see moved_bytes)
    for name, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes),
                         ("fwd_bwd", fwd_bytes + bwd_bytes)):
        ms = timings[name]
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = gbps(nbytes, ms) if ms else None
    if errors:
        row["error"] = "; ".join(errors)
    return row


def _backward_only(fn, inputs, grads):
    outs = _as_tuple(fn(*inputs))

    def bwd():
        return torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    return bwd


def _case_bytes(op: str, tokens: int, hidden: int, elem: int) -> int:
    """Inputs, outputs, upstream and input gradients of one case (fused version)."""
    n_tensors = {"rms_norm": 4, "layer_norm": 4, "add_rms_norm": 7}[op]
    return n_tensors * tokens * hidden * elem


def providers_here(op: str, device) -> list[str]:
    """Providers that run here without falling back to another one."""
    avail = norm.available_backends(device)
    out = [p for p in PROVIDERS[:-1] if p in avail]
    if op == "add_rms_norm" and "triton" in avail:
        out.append("separate")
    return out


# ---------------------------------------------------------------------------------- run


def run(quick: bool = False, *, ops=OPS, providers=None, hidden=HIDDEN, tokens=TOKENS,
        dtype=torch.bfloat16) -> list[dict]:
    """Every provider on every case, side by side in this process, plus the copy
    ceiling and the eager reference's counted traffic.

    `quick`: tiny shapes, providers eager / torch / triton (a CPU smoke test).
    LayerNorm and the fused add run at the headline token count only (every hidden
    size): the token grid is RMSNorm's, which is what LLaMA runs.
    The headline case (16384 x 4096) runs first, so "compile" specialises its first,
    static graph to it; later shapes reuse dynamo's dynamic-shape recompilation, as a
    user's training run would.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick:
        hidden, tokens = (64, 100), (8,)
        providers = providers or ("eager", "torch", "triton", "separate")
    cases = sorted(((t, h) for h in hidden for t in tokens),
                   key=lambda c: (c != HEADLINE, c[1], c[0]))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dtype and fallback notices
        for op in ops:
            names = [p for p in providers_here(op, device)
                     if providers is None or p in providers]
            for t, h in cases:
                if _case_bytes(op, t, h, dtype.itemsize) > MAX_CASE_BYTES:
                    continue
                if op != "rms_norm" and not quick and t != HEADLINE[0]:
                    continue  # the full token grid for RMSNorm; the others at one size
                for p in names:
                    row = measure(op, p, t, h, dtype, device)
                    rows.append(row)
                    print(format_row(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for op in ops:
            t, h = HEADLINE if not quick else (cases[0])
            traffic = traffic_bytes(op, t, h, dtype)
            fused = moved_bytes(op, t, h, dtype.itemsize)
            rows.append({"kind": "traffic", "op": op, "provider": "eager", "tokens": t,
                         "hidden": h, "dtype": str(dtype).replace("torch.", ""),
                         **traffic, "fused_fwd_bytes": fused[0],
                         "fused_bwd_bytes": fused[1]})
    rows.append({"kind": "ceiling", "copy_gbps": measure_copy_gbps(device=device)})
    print(summary(rows))
    return rows


def format_row(r: dict) -> str:
    head = f"  {r['op']:<13}{r['provider']:<9}{r['tokens']:>6} x {r['hidden']:<6}"
    if r.get("fwd_bwd_gbps") is None:
        return f"{head} failed: {r.get('error', '?')[:90]}"

    cols = "".join(_num(r.get(k), 8) for k in ("fwd_gbps", "bwd_gbps", "fwd_bwd_gbps"))
    return f"{head}{cols} GB/s (fwd, bwd, both)"


def _num(v, width: int) -> str:
    """GB/s: integers on a GPU, three significant digits for the CPU's small numbers."""
    text = "-" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return (" " + text).rjust(width)


def summary(rows: list[dict], tokens: int | None = None, hidden: int | None = None
            ) -> str:
    """Compact table at the headline shape (default: 16384 x 4096, else the largest
    measured): GB/s forward, backward, both; ratios against torch and the copy ceiling."""
    ops = [r for r in rows if r.get("kind") == "op"]
    if not ops:
        return "(no measurements)"
    ceiling = next((r["copy_gbps"] for r in rows if r.get("kind") == "ceiling"), None)
    if tokens is None:
        shapes = {(r["tokens"], r["hidden"]) for r in ops}
        tokens, hidden = HEADLINE if HEADLINE in shapes else max(shapes)
    copy = f"copy ceiling {ceiling:.0f} GB/s" if ceiling else "no copy ceiling"
    lines = [f"fused_norm at {tokens} x {hidden} ({ops[0]['dtype']}), effective GB/s; "
             f"{copy}"]
    lines.append(f"  {'op':<13}{'provider':<10}{'fwd':>7}{'bwd':>7}{'f+b':>7}"
                 f"{'f+b/torch':>11}{'f+b/copy':>10}")
    for op in OPS:
        sel = [r for r in ops
               if r["op"] == op and (r["tokens"], r["hidden"]) == (tokens, hidden)]
        torch_row = next((r for r in sel if r["provider"] == "torch"), None)
        for r in sel:
            if r.get("fwd_bwd_gbps") is None:
                lines.append(f"  {op:<13}{r['provider']:<10} failed")
                continue
            vs_torch = (r["fwd_bwd_gbps"] / torch_row["fwd_bwd_gbps"]
                        if torch_row and torch_row.get("fwd_bwd_gbps") else None)
            vs_copy = r["fwd_bwd_gbps"] / ceiling if ceiling else None

            ratio = f"{vs_torch:10.2f}x" if vs_torch is not None else "-".rjust(11)
            share = f"{vs_copy:10.0%}" if vs_copy is not None else "-".rjust(10)
            lines.append(f"  {op:<13}{r['provider']:<10}{_num(r['fwd_gbps'], 7)}"
                         f"{_num(r['bwd_gbps'], 7)}{_num(r['fwd_bwd_gbps'], 7)}"
                         f"{ratio}{share}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ tuning


def tune(tokens: int = 16384, hidden=(1024, 4096, 8192, 16384), dtype=torch.bfloat16
         ) -> list[dict]:
    """Time our RMSNorm launchers over their launch parameters (forward: rows per tile
    and warps; backward: also programs per SM and pipelining stages) and print the best
    of each next to the default. The winners go into `kernels._norm_common.DEFAULTS`.
    About a minute per hidden size on an H200."""
    if not torch.cuda.is_available():
        raise SystemExit("--tune times GPU kernels: it needs a CUDA device")
    device = torch.device("cuda")
    rows = []
    for h in hidden:
        rows += _tune_hidden(tokens, h, dtype, device)
        torch.cuda.empty_cache()
    rows.append({"kind": "ceiling", "copy_gbps": measure_copy_gbps(device=device)})
    return rows


def _tune_hidden(tokens: int, h: int, dtype, device) -> list[dict]:
    from colossal_lab.kernels._norm_common import launch_config
    from colossal_lab.kernels.rms_norm import rms_norm_backward, rms_norm_forward

    x = torch.randn(tokens, h, device=device).to(dtype)
    w = torch.randn(h, device=device).to(dtype)
    dy = torch.randn_like(x)
    _, rstd = rms_norm_forward(x, w, EPS)
    fwd_bytes, bwd_bytes = moved_bytes("rms_norm", tokens, h, dtype.itemsize)
    default = launch_config(h)
    base = {"kind": "tune", "tokens": tokens, "hidden": h}

    def timed(row, nbytes, fn):
        try:
            ms = time_fn(fn).median_ms
            row.update(ms=ms, gbps=gbps(nbytes, ms))
        except Exception as e:  # e.g. out of registers or shared memory
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        return row

    rows = []
    candidates = sorted({1, max(1, default.rows // 2), default.rows, 2 * default.rows})
    for r in candidates:
        for nw in (4, 8, 16, 32):
            if r * default.block > 32768:
                continue
            cfg = launch_config(h, rows=r, num_warps=nw)
            rows.append(timed({**base, "pass": "fwd", "rows": r, "num_warps": nw},
                              fwd_bytes,
                              lambda c=cfg: rms_norm_forward(x, w, EPS, config=c)))
            if nw == 32:
                continue
            for pps in (1, 2, 4):
                for stages in (1, 2):
                    row = {**base, "pass": "bwd", "rows": r, "num_warps": nw,
                           "programs_per_sm": pps, "num_stages": stages}
                    rows.append(timed(row, bwd_bytes, lambda c=cfg, p=pps, s=stages:
                                      rms_norm_backward(dy, x, w, rstd, config=c,
                                                        programs_per_sm=p, num_stages=s)))
    for pas in ("fwd", "bwd"):
        ok = [r for r in rows if r["pass"] == pas and "gbps" in r]
        best = max(ok, key=lambda r: r["gbps"], default=None)
        print(f"  H={h:<6} {pas}: default {default}; best {best}", flush=True)
    return rows


# -------------------------------------------------------------------------------- main


def config_of(dtype="bf16") -> dict:
    return {"dtype": dtype, "weight_dtype": dtype, "eps": EPS,
            "timing": "CUDA graph replay, median of 100, L2 flushed before each "
                      "(eager do_bench where a provider cannot be captured: row 'timing')",
            "backward": "torch.autograd.grad on a retained graph (no .grad accumulation)",
            "gbps": "bytes an ideal kernel moves / time; see moved_bytes()",
            "max_case_gib": MAX_CASE_BYTES / 2**30,
            "compile": "torch.compile default (static first graph at the headline shape, "
                       "then dynamic shapes)"}


def main(argv=None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--tune", action="store_true", help="launch-parameter sweep (GPU)")
    p.add_argument("--ops", nargs="*", choices=OPS, default=list(OPS))
    p.add_argument("--providers", nargs="*", choices=PROVIDERS)
    p.add_argument("--hidden", nargs="*", type=int, help=f"default {HIDDEN}")
    p.add_argument("--tokens", nargs="*", type=int, help=f"default {TOKENS}")
    p.add_argument("--name", default="fused_norm",
                   help="results file name (keep partial runs apart)")
    a = p.parse_args(argv)
    command = " ".join(["python -m colossal_lab bench fused_norm", *argv])
    if a.tune:
        rows = tune(a.tokens[0] if a.tokens else 16384,
                    tuple(a.hidden) if a.hidden else (1024, 4096, 8192, 16384))
        path = save_results(f"{a.name}_tune", rows, config=config_of(), command=command)
        print(f"saved {path}")
        return
    rows = run(a.quick, ops=tuple(a.ops), providers=a.providers,
               hidden=tuple(a.hidden or HIDDEN), tokens=tuple(a.tokens or TOKENS))
    if not a.quick:
        path = save_results(a.name, rows, config=config_of(), command=command)
        print(f"saved {path}")


if __name__ == "__main__":
    main()
