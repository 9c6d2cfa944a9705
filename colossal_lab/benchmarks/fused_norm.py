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

Issue #14's sweep (`sweep`): `--group rms_norm` (the hidden-size sweep, bf16 and fp32,
-> fused_norm.json) and `--group models` (LayerNorm, add+RMSNorm, SwiGLU at LLaMA
sizes -> fused_norm_models.json), graph-replay and eager timings in every row, host
time per call (`host_us`), run in chunks under a per-command time limit:

    python -m colossal_lab bench fused_norm --group rms_norm --dry-run   # cases, chunks
    python -m colossal_lab bench fused_norm --group rms_norm --hidden 4096 --resume
    python -m colossal_lab bench fused_norm --host-parts   # our host time, part by part
    python -m colossal_lab bench fused_norm --tune --dtypes bfloat16 float32
    python -m colossal_lab bench fused_norm --write-table  # -> kernels/norm_table.py

`targets(rows)` checks the issue's done-when on the saved rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colossal_lab.measure.hardware import measure_copy_gbps
from colossal_lab.measure.results import save_results
from colossal_lab.measure.timing import gbps, in_turns, time_fn, time_kernels
from colossal_lab.ops import norm
from colossal_lab.training.train import gc_between_steps

OPS = ("rms_norm", "layer_norm", "add_rms_norm", "swiglu")
PROVIDERS = ("eager", "torch", "compile", "triton", "triton-native", "liger", "apex",
             "separate")
HIDDEN = (1024, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 12288, 13824, 16384)
ODD_HIDDEN = (1000, 3000, 5000, 11008)
"""Sizes that are no multiple of 16 or of a power of two: masked tiles, no 16-byte
loads where the row stride is not divisible by 16 elements."""
TOKENS = (1024, 4096, 16384, 65536)
DTYPES = ("bfloat16", "float32")
MODEL_SIZES = {"llama-7b": (4096, 11008), "llama-13b": (5120, 13824),
               "llama-70b": (8192, 28672), "tinyllama": (2048, 5632)}
"""(hidden, intermediate) of the models issue #14 names: the norms run at the hidden
size, SwiGLU at the intermediate size."""
GROUPS = {"rms_norm": "fused_norm", "models": "fused_norm_models"}
"""--group: "rms_norm", the hidden-size sweep (HIDDEN + ODD_HIDDEN x TOKENS x DTYPES);
"models": LayerNorm, add+RMSNorm and SwiGLU at MODEL_SIZES x TOKENS x DTYPES. The
value is the results file each saves to by default (`--name`)."""
CHUNK_BUDGET_S = 300.0
"""--dry-run's chunks: estimated GPU seconds per command line, well under a 600 s limit
(the estimate leaves out Triton's JIT and process start-up)."""
SWEEP_PROVIDERS = ("torch", "triton", "triton-native", "liger")
"""Providers of the sweep (those installed): ours against the library kernels. For
RMSNorm, "triton-native" is ours as it ships (the C++ path of `kernels.native`, the
default on CUDA) and "triton" the same kernels launched from Python (the path the C++
one replaces per call; for the other ops "triton" is ours as it ships)."""
SWEEP_EAGER_AT = (16384, "bfloat16")
"""(tokens, dtype) at which the default sweep also times "eager", the unfused reference
Hugging Face runs: one row per hidden size, for chapter 02's fused-against-eager
comparison. Everywhere would cost more GPU time than the rest of the sweep."""
HEADLINE = (16384, 4096)
"""(tokens, hidden) of the summary table and of the first compile (see `run`)."""
MAX_CASE_BYTES = 24 << 30
"""Skip cases whose inputs, outputs and gradients exceed this (eager needs more; an
H200 holds 141 GB, so the whole RMSNorm sweep runs: 64k x 16384 fp32 is 16 GiB)."""
EPS = 1e-6
HOST_SHAPES = ((16, 2048), (16, 16384))
"""(tokens, hidden) of the host-time rows: few tokens, so the GPU drains the queue
faster than the host fills it and the loop times the host alone."""
HOST_CALLS = 200
"""fwd+bwd calls per host-time loop."""
EST_FIXED_S, EST_REPLAYS, EST_START_S = 1.5, 400, 20.0
"""--dry-run's estimate per provider and case: set-up, JIT and captures (s), plus this
many passes over the case's fwd+bwd bytes at 3 TB/s (graph replays and do_bench); and
per command: start-up, the copy ceiling and the host-time rows (s)."""


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
    swiglu        fwd: read gate, up; write h (N = tokens·i)   3Ne
                  bwd: read dh, gate, up; write dgate, dup      5Ne
    fwd+bwd is the sum: the forward's outputs are written, the backward reads them.
    """
    n, w, t = tokens * hidden, (w_elem or elem) * hidden, tokens
    if op == "rms_norm":
        return 2 * n * elem + w + 4 * t, 3 * n * elem + 2 * w + 4 * t
    if op == "layer_norm":
        return 2 * n * elem + 2 * w + 8 * t, 3 * n * elem + 3 * w + 8 * t
    if op == "add_rms_norm":
        return 4 * n * elem + w + 4 * t, 4 * n * elem + 2 * w + 4 * t
    if op == "swiglu":  # hidden = i; fwd: read gate, up; write h. bwd: read dh, gate,
        return 3 * n * elem, 5 * n * elem  # up; write dgate, dup
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
    if op == "swiglu":  # "torch": silu(gate) * up on views, what Hugging Face runs
        from colossal_lab.ops import swiglu as projections

        name = {"torch": "eager", "eager": "eager"}.get(provider, provider)
        return lambda gu: projections.swiglu(gu, backend=name)
    if provider == "triton-native":  # RMSNorm only: per-call work in C++
        from colossal_lab.kernels import native
        from colossal_lab.kernels.rms_norm import rms_norm_triton

        if native.module() is None:
            raise RuntimeError(f"the native path cannot be built: {native.why_not()}")

        def through_cpp(x, w):
            with native.forced():  # the first call of a shape registers it (Python)
                return rms_norm_triton(x, w, EPS)

        return through_cpp
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
    if op == "rms_norm" and provider == "triton":  # the Python path, not the C++ one
        from colossal_lab.kernels import native

        def through_python(x, w):
            with native.disabled():  # (the forward's choice holds for its backward)
                return norm.rms_norm(x, w, EPS, backend=provider)

        return through_python
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

    if op == "swiglu":  # hidden = i: one (tokens, 2i) [gate | up] input
        gu = rnd(tokens, 2 * hidden)
        return (gu,), (torch.randn(tokens, hidden, generator=g, device=device).to(dtype),)
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
    """Time one provider on one case: forward, backward (on a retained graph) and both,
    as CUDA-graph replays (`fwd_ms`, ...: the kernels). The sweep adds eager timings
    with `eager_in_turns`. A failure becomes an `error` field; the other timings are
    kept."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    row = {"kind": "op", "op": op, "provider": provider, "tokens": tokens,
           "hidden": hidden, "dtype": str(dtype).replace("torch.", "")}
    fwd_bytes, bwd_bytes = moved_bytes(op, tokens, hidden, dtype.itemsize)
    row.update(fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes)
    errors = []
    try:
        fn = _provider_fn(op, provider)
        inputs, grads = _inputs(op, tokens, hidden, dtype, device)
        # also compiles ("compile") and JITs ("triton"); no graph of it may stay alive:
        # a leaf's gradient accumulator, kept by a live graph, keeps the stream it was
        # made on (here the default one), and later backwards run it there, which
        # invalidated torch's fwd+bwd captures on the H200 (its "AccumulateGrad node's
        # stream does not match" warning) so the row fell back to events
        torch.autograd.grad(_as_tuple(fn(*inputs)), inputs, grads)
    except Exception as e:  # an op a provider lacks, out of memory, ...
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row
    fwd, fwd_bwd = _eager_calls(fn, inputs, grads)
    timings, methods = {}, {}
    for name, make in (("fwd", lambda: fwd), ("fwd_bwd", lambda: fwd_bwd),
                       ("bwd", lambda: _backward_only(fn, inputs, grads))):
        try:  # graph replay: kernel time without Python launch gaps, else eager
            t, how = time_kernels(make(), device=device)
            timings[name] = t.median_ms
            methods[f"{name}_ms"] = how
        except Exception as e:
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            timings[name] = None
    row["timing"] = "/".join(dict.fromkeys(methods.values()))
    if len(set(methods.values())) > 1:  # which pass fell back (`pass_timing`)
        row["timing_by_pass"] = methods
    # effective bandwidth = bytes an ideal kernel moves / time (see moved_bytes)
    for name, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes),
                         ("fwd_bwd", fwd_bytes + bwd_bytes)):
        ms = timings[name]
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = gbps(nbytes, ms) if ms else None
    if errors:
        row["error"] = "; ".join(errors)
    return row


def _eager_calls(fn, inputs, grads):
    """(forward, forward + backward) of one provider as a user calls them."""
    def fwd():
        return fn(*inputs)

    def fwd_bwd():
        # autograd.grad, not .backward(): no accumulation kernels into .grad
        return torch.autograd.grad(_as_tuple(fn(*inputs)), inputs, grads)

    return fwd, fwd_bwd


EAGER_ROUNDS = 3
EAGER_TIMING = ("{how} of fwd and fwd+bwd launched from Python, the providers of a case "
                "in turns ({rounds} rounds, order rotated each round; median of the "
                "rounds), garbage collector paused")


def eager_in_turns(op: str, rows: list[dict], tokens: int, hidden: int,
                   dtype=torch.bfloat16, device=None, *, rounds: int = EAGER_ROUNDS,
                   rep_ms: float = 25.0) -> list[dict]:
    """Add eager timings (`eager_fwd_ms`, `eager_fwd_bwd_ms`: do_bench, as a user times
    a call) to the op rows of one case, one row per provider, with the providers timed
    in turns: each round times every provider once, in an order rotated from round to
    round, and a row keeps the median of its rounds.

    Where a call is host-bound (few tokens, or an eager fwd+bwd whose host work outlasts
    its kernels) its eager time is host time, and host time drifts within a process
    (`host_rows`): timed one provider after the other, a drift between two providers'
    turns would land in their ratio. In turns it shifts them alike. The providers share
    one set of inputs (the same values `_inputs` gives each). `timed_as` says how each
    field was taken; a provider that fails gets an `error`."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fwd_bytes, bwd_bytes = moved_bytes(op, tokens, hidden, dtype.itemsize)
    todo = [r for r in rows if r.get("kind") == "op" and "skipped" not in r
            and r.get("fwd_bwd_ms") is not None]
    if not todo:
        return rows
    inputs, grads = _inputs(op, tokens, hidden, dtype, device)
    calls, times = {}, {}
    for r in todo:
        try:
            calls[r["provider"]] = _eager_calls(_provider_fn(op, r["provider"]), inputs,
                                                grads)
            times[r["provider"]] = {"fwd": [], "fwd_bwd": []}
        except Exception as e:
            r["error"] = f"eager: {type(e).__name__}: {str(e)[:200]}"
    order = list(calls)
    with gc_between_steps():
        for turn in in_turns(order, rounds):
            for p in turn:
                for name, f in zip(("fwd", "fwd_bwd"), calls[p]):
                    try:
                        times[p][name].append(time_fn(f, device=device, warmup_ms=5,
                                                      rep_ms=rep_ms).median_ms)
                    except Exception as e:
                        row = next(r for r in todo if r["provider"] == p)
                        row["error"] = f"eager {name}: {type(e).__name__}: {str(e)[:200]}"
    for r in todo:
        for name, nbytes in (("fwd", fwd_bytes), ("fwd_bwd", fwd_bytes + bwd_bytes)):
            got = sorted(times.get(r["provider"], {}).get(name, []))
            ms = got[len(got) // 2] if len(got) == rounds else None
            r[f"eager_{name}_ms"] = ms
            r[f"eager_{name}_gbps"] = gbps(nbytes, ms) if ms else None
        r["timed_as"] = {
            **(r["timing_by_pass"] if r.get("timing_by_pass") else
               {"fwd_ms/bwd_ms/fwd_bwd_ms": r.get("timing")}),
            "eager_fwd_ms/eager_fwd_bwd_ms": EAGER_TIMING.format(
                how="do_bench" if device.type == "cuda" else "perf_counter", rounds=rounds)}
    return rows


def _backward_only(fn, inputs, grads):
    """The backward alone, on a graph of `fn`'s forward kept alive. On a GPU the forward
    runs on a stream of its own, which `time_cuda_graph` then captures on
    (`capture_stream`): autograd runs each backward op on its forward op's stream, and
    with the forward on the default stream torch's F.rms_norm backward (16384 x 1000
    fp32, H200) invalidated every "thread_local" capture, so its row fell back."""
    stream = torch.cuda.Stream(inputs[0].device) if inputs[0].is_cuda else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(inputs[0].device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        outs = _as_tuple(fn(*inputs))
    if stream is not None:
        torch.cuda.current_stream(inputs[0].device).wait_stream(stream)

    def bwd():
        return torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    bwd.capture_stream = stream
    return bwd


def pass_timing(row: dict, field: str = "fwd_bwd_ms") -> str | None:
    """How `row`'s `field` (fwd_ms, bwd_ms, fwd_bwd_ms) was timed: its own label where
    the passes differ (`timing_by_pass`), else the row's `timing`."""
    return (row.get("timing_by_pass") or {}).get(field, row.get("timing"))


def _case_bytes(op: str, tokens: int, hidden: int, elem: int) -> int:
    """Inputs, outputs, upstream and input gradients of one case (fused version)."""
    n_tensors = {"rms_norm": 4, "layer_norm": 4, "add_rms_norm": 7, "swiglu": 6}[op]
    return n_tensors * tokens * hidden * elem


HOST_TIMING = ("perf_counter around {calls} fwd+bwd calls enqueued without synchronising, "
               "/ calls; median of {repeats} loops, the providers' loops interleaved "
               "(provider order rotated each round); garbage collector paused; "
               "synchronised before and after each loop")


def host_rows(op: str, providers, tokens: int, hidden: int, dtype=torch.bfloat16,
              device=None, *, calls: int = 200, repeats: int = 5) -> list[dict]:
    """Host time of one eager forward+backward per provider: `calls` of them enqueued
    back to back with no synchronisation inside the loop, the loop's wall time /
    `calls`, median of `repeats` loops. At few tokens the GPU finishes each call before
    the host has enqueued the next, so the loop never waits on a full launch queue: it
    times the host work (Python, autograd, allocations, launchers).

    Host time drifts within a process and between processes (one op measured 95 us in
    one process and 160 us in another), so the providers are timed in turns, loop by
    loop, with the order rotated each round: a drift then shifts them alike and their
    difference, which the target is about, holds. On a CPU the ops also run: meaningless
    as host time, kept as a smoke test (`device` says so)."""
    import time

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, calls_of, per_call = {}, {}, {}
    for p in providers:
        rows[p] = {"kind": "host", "op": op, "provider": p, "tokens": tokens,
                   "hidden": hidden, "dtype": str(dtype).replace("torch.", ""),
                   "device": device.type,
                   "host_timing": HOST_TIMING.format(calls=calls, repeats=repeats)}
        try:
            fn = _provider_fn(op, p)
            inputs, grads = _inputs(op, tokens, hidden, dtype, device)

            def call(fn=fn, inputs=inputs, grads=grads):
                return torch.autograd.grad(_as_tuple(fn(*inputs)), inputs, grads)

            for _ in range(10):
                call()
            calls_of[p], per_call[p] = call, []
        except Exception as e:
            rows[p]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    order = list(calls_of)
    with gc_between_steps():
        for turn in in_turns(order, repeats):
            for p in turn:
                try:
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        calls_of[p]()
                    per_call[p].append((time.perf_counter() - t0) / calls * 1e6)
                    sync()
                except Exception as e:
                    rows[p]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for p, times in per_call.items():
        if times and "error" not in rows[p]:
            times.sort()
            rows[p].update(host_us=times[len(times) // 2], host_us_min=times[0])
    return [rows[p] for p in providers]


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` only counts the launch."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.launches += 1


def _per_call_us(fn, calls: int, repeats: int = 7) -> float:
    """Best of `repeats` loops of `calls` calls, µs per call (no synchronisation)."""
    import time

    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def host_parts(tokens: int = 4, hidden: int = 64, dtype=torch.bfloat16, device=None,
               calls: int = 2000) -> list[dict]:
    """Host time per call of our RMSNorm and of its parts, next to F.rms_norm's, at a
    tiny shape (the device never holds the host up). The Triton launches are replaced
    by a counter (`_NoLaunch`), so "ours, launches stubbed" is our Python alone:
    autograd Function, checks, launch config, allocations. On a GPU, "ours" minus it is
    what Triton's launchers cost; on a CPU the launcher cannot run (the interpreter
    replaces it) and F.rms_norm also computes, so only our parts are host time there."""
    import torch.nn.functional as F

    from colossal_lab.kernels import _norm_common as nc
    from colossal_lab.kernels import rms_norm as rk

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    (x, w), (dy,) = _inputs("rms_norm", tokens, hidden, dtype, device)
    x2d, wd = x.detach(), w.detach()
    partials = torch.zeros(1, 4, hidden, device=device)

    class Empty(torch.autograd.Function):  # the floor of any autograd.Function
        @staticmethod
        def forward(ctx, x, w):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dy):
            return dy, None

    def grad(f):
        return lambda: torch.autograd.grad(f(), (x, w), dy, allow_unused=True)

    timed = {"F.rms_norm fwd+bwd": grad(lambda: F.rms_norm(x, (hidden,), w, EPS)),
             "empty autograd.Function fwd+bwd": grad(lambda: Empty.apply(x, w))}
    if device.type == "cuda":
        timed["ours fwd+bwd"] = grad(lambda: rk.rms_norm_triton(x, w, EPS))
    rows = [{"part": k, "us": _per_call_us(f, calls)} for k, f in timed.items()]
    stubs = {(m, n): _NoLaunch() for m in (rk, nc) for n in dir(m)
             if n.endswith("_kernel")}
    saved = {k: getattr(*k) for k in stubs}
    try:
        for (m, n), stub in stubs.items():
            setattr(m, n, stub)
        parts = {
            "ours fwd+bwd, launches stubbed": grad(lambda: rk.rms_norm_triton(x, w, EPS)),
            "ours fwd+bwd via norm.rms_norm, launches stubbed":
                grad(lambda: norm.rms_norm(x, w, EPS, backend="triton")),
            "check_input + check_param": lambda: (nc.check_input(x2d),
                                                  nc.check_param(wd, hidden, x2d, "w")),
            "as_rows": lambda: nc.as_rows(x2d, hidden),
            "launch_config": lambda: nc.launch_config(hidden, dtype),
            "persistent_programs": lambda: nc.persistent_programs(64, 1, 4, device),
            "torch.empty (tokens, hidden)": lambda: torch.empty(
                (tokens, hidden), dtype=dtype, device=device),
            "sum_partials, launch stubbed": lambda: nc.sum_partials(partials, wd),
            "partials.sum(0).to(w.dtype) (before)": lambda: partials[0].sum(0).to(dtype),
            "resolve_backend('triton')": lambda: norm.resolve_backend("triton", device),
        }
        rows += [{"part": k, "us": _per_call_us(f, calls)} for k, f in parts.items()]
        for stub in stubs.values():
            stub.launches = 0
        torch.autograd.grad(rk.rms_norm_triton(x, w, EPS), (x, w), dy)
        launches = sum(s.launches for s in stubs.values())
    finally:
        for (m, n), kernel in saved.items():
            setattr(m, n, kernel)
    base = {"kind": "host_part", "tokens": tokens, "hidden": hidden,
            "dtype": str(dtype).replace("torch.", ""), "device": device.type,
            "triton_launches_per_fwd_bwd": launches,
            "how": f"perf_counter, best of 7 loops of {calls} calls, no synchronisation"}
    return [{**base, **r} for r in rows]


# ------------------------------------------------------------------ the sweep, in chunks


def sweep_cases(group: str = "rms_norm", *, hidden=None, tokens=None, dtypes=DTYPES,
                ops=None) -> list[tuple[str, int, int, str]]:
    """(op, tokens, hidden, dtype) of a `--group` (see GROUPS), headline case first
    (the compile provider's static graph), then by dtype, hidden, tokens. `hidden`
    and `tokens` replace the group's sizes (for every op: name one with `ops`)."""
    if group == "rms_norm":
        widths = {"rms_norm": sorted(set(HIDDEN) | set(ODD_HIDDEN))}
    elif group == "models":
        h = sorted({m[0] for m in MODEL_SIZES.values()})
        i = sorted({m[1] for m in MODEL_SIZES.values()})
        widths = {"layer_norm": h, "add_rms_norm": h, "swiglu": i}
    else:
        raise ValueError(f"unknown group {group!r}; choose from {GROUPS}")
    cases = [(op, t, h, d) for op, hs in widths.items() for d in dtypes
             for h in (hidden or hs) for t in (tokens or TOKENS)
             if ops is None or op in ops]
    return sorted(cases, key=lambda c: ((c[1], c[2]) != HEADLINE or c[3] != "bfloat16",
                                        c[0], DTYPES.index(c[3]) if c[3] in DTYPES else 9,
                                        c[2], c[1]))


def skip_reason(op: str, tokens: int, hidden: int, dtype: str) -> str | None:
    """Why a case is not run (its memory), or None."""
    nbytes = _case_bytes(op, tokens, hidden, getattr(torch, dtype).itemsize)
    if nbytes > MAX_CASE_BYTES:
        return (f"inputs, outputs and gradients need {nbytes / 2**30:.1f} GiB > "
                f"MAX_CASE_BYTES {MAX_CASE_BYTES / 2**30:.0f} GiB")
    return None


def estimate_s(case, n_providers: int) -> float:
    """Rough GPU seconds of one case (`EST_FIXED_S`, `EST_REPLAYS`); 0 when skipped."""
    op, t, h, d = case
    if skip_reason(*case):
        return 0.0
    fwd, bwd = moved_bytes(op, t, h, getattr(torch, d).itemsize)
    return n_providers * (EST_FIXED_S + EST_REPLAYS * (fwd + bwd) / 3e12)


def plan_chunks(cases, n_providers: int, budget_s: float = CHUNK_BUDGET_S
                ) -> list[list]:
    """Cases split, in order, into chunks whose estimates stay under `budget_s`, each
    a whole (op, dtype, hidden) so that `--hidden`/`--dtypes`/`--ops` can name it."""
    groups: dict[tuple, list] = {}
    for c in cases:
        groups.setdefault((c[0], c[3], c[2]), []).append(c)
    chunks, cur, cur_s = [], [], 0.0
    for g in groups.values():
        g_s = sum(estimate_s(c, n_providers) for c in g)
        new_command = not cur or (cur[-1][0], cur[-1][3]) != (g[0][0], g[0][3])
        g_s += EST_START_S if new_command else 0.0
        if cur and cur_s + g_s > budget_s:
            chunks.append(cur)
            cur, cur_s = [], 0.0
            g_s += 0.0 if new_command else EST_START_S
        cur += g
        cur_s += g_s
    return chunks + ([cur] if cur else [])


def chunk_estimate_s(chunk, n_providers: int) -> float:
    """Estimated seconds of one chunk's command line, each command's start-up included."""
    commands = len({(c[0], c[3]) for c in chunk})
    return commands * EST_START_S + sum(estimate_s(c, n_providers) for c in chunk)


def chunk_command(chunk, group: str, name: str, first: bool = False,
                  extra: str = "") -> str:
    """The command line that runs `chunk` (one op and dtype per command, with the
    chunk's hidden sizes and token counts named); all but the `first` command of a run
    append to the results file (--resume). `extra`: flags every command carries (the
    run's --providers, and --resume/--redo when the run continues a saved sweep)."""
    parts = []
    for (op, d), cs in _by(chunk, lambda c: (c[0], c[3])).items():
        hs = " ".join(str(h) for h in dict.fromkeys(c[2] for c in cs))
        ts = " ".join(str(t) for t in sorted({c[1] for c in cs}))
        resume = "" if first and not parts or "--resume" in extra.split() else \
            " --resume"
        parts.append(f"python -m colossal_lab bench fused_norm --group {group} "
                     f"--ops {op} --dtypes {d} --hidden {hs} --tokens {ts} "
                     f"--name {name}{resume}{extra and ' ' + extra}")
    return " && ".join(parts)


def _by(items, key) -> dict:
    out: dict = {}
    for it in items:
        out.setdefault(key(it), []).append(it)
    return out


def dry_run(cases, providers, group: str, name: str,
            budget_s: float = CHUNK_BUDGET_S, extra: str = "") -> str:
    """The case list, what is skipped and why, the estimated GPU time, and command
    lines that run it in chunks of < `budget_s`: the first starts the results file
    afresh, the others append (--resume; so does a chunk run again after a cut).
    `extra`: flags every command carries (`chunk_command`); with --resume in it, the
    first command continues the saved file too."""
    n = len(providers)
    lines = [f"fused_norm --group {group}: {len(cases)} cases x {n} providers "
             f"({', '.join(providers)})"]
    for c in cases:
        why = skip_reason(*c)
        lines.append(f"  {c[0]:<13}{c[1]:>6} x {c[2]:<6}{c[3]:<9}"
                     + (f" skipped: {why}" if why else f" ~{estimate_s(c, n):.0f} s"))
    total = sum(estimate_s(c, n) for c in cases)
    chunks = plan_chunks(cases, n, budget_s)
    lines.append(f"estimate {total:.0f} s of GPU time (rough: {EST_FIXED_S} s per "
                 f"provider-case + {EST_REPLAYS} passes at 3 TB/s); {len(chunks)} "
                 f"chunks of < {budget_s:.0f} s:")
    lines += [f"  [{chunk_estimate_s(ch, n):.0f} s] "
              f"{chunk_command(ch, group, name, first=i == 0, extra=extra)}"
              for i, ch in enumerate(chunks)]
    return "\n".join(lines)


def case_key(r: dict) -> tuple:
    return (r.get("kind"), r.get("op"), r.get("provider"), r.get("tokens"),
            r.get("hidden"), r.get("dtype"))


def sweep(cases, providers=None, *, host: bool = True, on_row=None,
          done: set | None = None, host_shapes=None, host_calls: int | None = None
          ) -> list[dict]:
    """Every provider on every case, graph replay and eager side by side, each row
    with the copy ceiling measured once in this process; then, with `host`, the host
    time of every provider at `host_shapes` (default `HOST_SHAPES`, `HOST_CALLS` calls)
    for each op and dtype. `done` (case keys) is skipped; `on_row(rows)` gets the rows
    so far after each case (save them)."""
    host_shapes = host_shapes or HOST_SHAPES
    host_calls = host_calls or HOST_CALLS
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    done = done or set()
    copy = measure_copy_gbps(device=device)
    rows = [{"kind": "ceiling", "copy_gbps": copy}]  # also in every row: its run's

    def names(op, tokens=None, dtype=None):
        want = providers or SWEEP_PROVIDERS
        if op == "swiglu":
            return [p for p in ("torch", "compile", "triton") if p in want]
        if providers is None and (tokens, dtype) == SWEEP_EAGER_AT:
            want = ("eager", *want)
        return [p for p in providers_here(op, device) if p in want]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for op, t, h, d in cases:
            dtype = getattr(torch, d)
            new = []
            free_gib = (torch.cuda.mem_get_info()[0] / 2**30 if device.type == "cuda"
                        else None)  # before the case: a leak shows as a falling column
            for p in names(op, t, d):
                if ("op", op, p, t, h, d) in done:
                    continue
                why = skip_reason(op, t, h, d)
                if why:
                    new.append({"kind": "op", "op": op, "provider": p, "tokens": t,
                                "hidden": h, "dtype": d, "skipped": why})
                    continue
                row = measure(op, p, t, h, dtype, device)
                row.update(copy_gbps=copy, gpu_free_gib=free_gib)
                new.append(row)
            eager_in_turns(op, new, t, h, dtype, device)
            for row in new:
                if "skipped" not in row:
                    print(format_row(row), flush=True)
            rows += new
            if new and on_row is not None:
                on_row(rows)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        if host:
            for op, d in dict.fromkeys((c[0], c[3]) for c in cases):
                for t, h in host_shapes:
                    todo = [p for p in names(op) if ("host", op, p, t, h, d) not in done]
                    if not todo:
                        continue
                    new = host_rows(op, todo, t, h, getattr(torch, d), device,
                                    calls=host_calls, repeats=5 if host_calls > 20 else 1)
                    for row in new:
                        print(f"  host {op:<13}{row['provider']:<14}{t:>6} x {h:<6}{d:<9}"
                              f"{row.get('host_us', float('nan')):8.1f} us", flush=True)
                    rows += new
                    if on_row is not None:  # saved shape by shape: a cut run keeps them
                        on_row(rows)
    return rows


# ------------------------------------------------------------------------ the targets


def targets(rows: list[dict], *, op: str = "rms_norm", min_eager_tokens: int = 16384,
            copy_share: float = 0.85, host_gap_us: float = 20.0, ours: str = "triton"
            ) -> list[dict]:
    """Issue #14's done-when, evaluated on sweep rows: one dict per check with `check`,
    `ok` (None when no row can tell), `worst` and where (`at`), and `failing`.

    `ours` is the provider held to them ("triton", the Python path; "triton-native",
    the C++ path RMSNorm ships with by default).

    1. graph replay: ours >= 1.0 x torch in fwd+bwd at every point;
    2. eager (do_bench) >= 1.0 x torch at every point with >= `min_eager_tokens`;
    3. ours >= `copy_share` of the copy bandwidth at 16384 x 4096 bf16, fwd+bwd;
    4. one eager fwd+bwd's host time within `host_gap_us` of torch's, at every host row.

    A point of check 1 where ours' or torch's fwd+bwd was not timed by graph replay
    (a capture failed and events timed it instead, `pass_timing`) fails the check
    ("not_graph_replay" in `failing`)."""
    ops = [r for r in rows if r.get("kind") == "op" and r.get("op") == op]
    pairs = {}
    for r in ops:
        pairs.setdefault((r["tokens"], r["hidden"], r["dtype"]), {})[r["provider"]] = r

    def ratio_check(name, field, keep, graph=False):
        worst, at, failing, n = None, None, [], 0
        for k, prov in sorted(pairs.items()):
            mine, ref = prov.get(ours, {}), prov.get("torch", {})
            if not keep(k, mine) or not mine.get(field) or not ref.get(field):
                continue
            n += 1
            other = {p: pass_timing(r, field) for p, r in ((ours, mine), ("torch", ref))
                     if pass_timing(r, field) != "cuda_graph"}
            if graph and other:  # a timing that fell back is a failed check, not a pass
                failing.append({"at": k, "not_graph_replay": other})
                continue
            x = ref[field] / mine[field]  # time ratio: > 1 means ours is faster
            if worst is None or x < worst:
                worst, at = x, k
            if x < 1.0:
                failing.append({"at": k, "ratio": round(x, 3)})
        return {"check": name, "ok": (not failing) if n else None, "points": n,
                "worst": worst, "at": at, "failing": failing}

    out = [ratio_check("graph replay fwd+bwd >= 1.0x torch at every point", "fwd_bwd_ms",
                       lambda k, r: True, graph=True),
           ratio_check(f"eager fwd+bwd >= 1.0x torch at >= {min_eager_tokens} tokens",
                       "eager_fwd_bwd_ms", lambda k, r: k[0] >= min_eager_tokens)]
    head = pairs.get((*HEADLINE, "bfloat16"), {}).get(ours, {})
    share = (head["fwd_bwd_gbps"] / head["copy_gbps"]
             if head.get("fwd_bwd_gbps") and head.get("copy_gbps") else None)
    low = share is not None and share < copy_share
    out.append({"check": f">= {copy_share:.0%} of copy at {HEADLINE[0]} x {HEADLINE[1]} "
                         "bf16 fwd+bwd", "ok": None if share is None else not low,
                "points": int(share is not None), "worst": share,
                "at": (*HEADLINE, "bfloat16"),
                "failing": [{"share": round(share, 3)}] if low else []})
    hosts = {}
    for r in rows:
        if r.get("kind") == "host" and r.get("op") == op and "host_us" in r:
            key = (r["tokens"], r["hidden"], r["dtype"])
            hosts.setdefault(key, {})[r["provider"]] = r
    gaps = [(k, v[ours]["host_us"] - v["torch"]["host_us"]) for k, v in
            sorted(hosts.items()) if ours in v and "torch" in v]
    worst_gap = max(gaps, key=lambda g: g[1], default=None)
    out.append({"check": f"eager fwd+bwd host time <= torch's + {host_gap_us:.0f} us",
                "ok": all(g <= host_gap_us for _, g in gaps) if gaps else None,
                "points": len(gaps), "worst": worst_gap[1] if worst_gap else None,
                "at": worst_gap[0] if worst_gap else None,
                "failing": [{"at": k, "gap_us": round(g, 1)} for k, g in gaps
                            if g > host_gap_us]})
    return out


def providers_here(op: str, device) -> list[str]:
    """Providers that run here without falling back to another one."""
    avail = norm.available_backends(device)
    out = [p for p in PROVIDERS[:-1] if p in avail]
    if op == "rms_norm" and "triton" in avail and torch.device(device).type == "cuda":
        out.insert(out.index("triton") + 1, "triton-native")
    if op == "add_rms_norm" and "triton" in avail:
        out.append("separate")
    return out


# ---------------------------------------------------------------------------------- run


RUN_HIDDEN, RUN_TOKENS = (1024, 2048, 4096, 8192, 16384), (4096, 16384, 65536)
"""`run`'s grid: every provider, bf16 (the sweep of issue #14 is `sweep`)."""
NORM_OPS = OPS[:3]
"""`run`'s ops: the norms (SwiGLU is in the sweep's "models" group)."""


def run(quick: bool = False, *, ops=NORM_OPS, providers=None, hidden=RUN_HIDDEN,
        tokens=RUN_TOKENS, dtype=torch.bfloat16) -> list[dict]:
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


TUNE_HIDDEN = (1024, 2048, 4096, 8192, 16384)
"""One hidden size per table bucket (`launch_config` keys by next_power_of_2(H)): the
power of two itself; sizes between two (5120, 13824) get their bucket's entry."""


TUNE_SMALL_TOKENS = 4096
"""At this many tokens or fewer `--tune` times whole launches for the table's
".../small" entries (`_tune_small`), which `launch_config` takes at up to
`_norm_common.SMALL_ROWS` rows; tune at 1024 tokens (the sweep's smallest)."""
MIN_ROWS_CANDIDATES = (1, 2, 4, 8, 16, 32)
TUNE_SMALL_ROWS = (1, 2, 4, 8)
"""Rows per tile `_tune_small` tries (those with rows x next_power_of_2(H) <= 16384)."""
TUNE_SMALL_WARPS = (2, 4, 8)
SMALL_MARGIN = 0.05
"""A ".../small" entry is written only where its launch beat the one that ran without
it (`_tune_small`'s "current" row, same run) by this share: at a few microseconds the
same launch timed twice differs by 2-3% (H200, 1024 x 1024)."""


def tune(tokens=(16384,), hidden=TUNE_HIDDEN, dtypes=(torch.bfloat16,)) -> list[dict]:
    """Time our RMSNorm launchers over their launch parameters (forward: rows per tile
    and warps; backward: also programs per SM, pipelining stages or our register
    prefetch; at <= `TUNE_SMALL_TOKENS` tokens the backward's rows per program) and
    print the best of each next to the default. `--write-table` turns the winners into
    `kernels/norm_table.py`. About 30 s per hidden size, dtype and token count on an
    H200."""
    if not torch.cuda.is_available():
        raise SystemExit("--tune times GPU kernels: it needs a CUDA device")
    device = torch.device("cuda")
    tokens = (tokens,) if isinstance(tokens, int) else tuple(tokens)
    rows = []
    for t in tokens:
        for dtype in dtypes:
            for h in hidden:
                rows += _tune_hidden(t, h, dtype, device)
                torch.cuda.empty_cache()
    rows.append({"kind": "ceiling", "tokens": None, "hidden": None, "dtype": None,
                 "copy_gbps": measure_copy_gbps(device=device)})
    return rows


def _timed(row: dict, nbytes: int, fn, *, graph: bool = False) -> dict:
    """A tuning row with its time and GB/s: eager (do_bench), or with `graph` by
    CUDA-graph replay (`time_kernels`, which says how in `timing`); a launch that cannot
    run (out of registers or shared memory) becomes an `error`."""
    try:
        if graph:
            t, row["timing"] = time_kernels(fn)
        else:
            t = time_fn(fn)
        row.update(ms=t.median_ms, gbps=gbps(nbytes, t.median_ms))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return row


def _tune_hidden(tokens: int, h: int, dtype, device) -> list[dict]:
    from colossal_lab.kernels._norm_common import launch_config
    from colossal_lab.kernels.rms_norm import rms_norm_backward, rms_norm_forward

    x = torch.randn(tokens, h, device=device).to(dtype)
    w = torch.randn(h, device=device).to(dtype)
    dy = torch.randn_like(x)
    _, rstd = rms_norm_forward(x, w, EPS)
    fwd_bytes, bwd_bytes = moved_bytes("rms_norm", tokens, h, dtype.itemsize)
    default = launch_config(h, dtype)
    base = {"kind": "tune", "tokens": tokens, "hidden": h,
            "dtype": str(dtype).replace("torch.", "")}

    rows = []
    if tokens <= TUNE_SMALL_TOKENS:
        return _tune_small(x, w, dy, rstd, base, fwd_bytes, bwd_bytes, device)
    candidates = sorted({1, max(1, default.rows // 2), default.rows, 2 * default.rows})
    for r in candidates:
        for nw in (4, 8, 16, 32):
            if r * default.block > 32768:
                continue
            cfg = launch_config(h, rows=r, num_warps=nw)
            rows.append(_timed({**base, "pass": "fwd", "rows": r, "num_warps": nw},
                               fwd_bytes,
                               lambda c=cfg: rms_norm_forward(x, w, EPS, config=c)))
            if nw == 32:
                continue
            for pps in (1, 2, 4):
                for stages, pf in ((1, False), (2, False), (1, True)):
                    row = {**base, "pass": "bwd", "rows": r, "num_warps": nw,
                           "programs_per_sm": pps, "num_stages": stages, "prefetch": pf}
                    rows.append(_timed(row, bwd_bytes, lambda c=cfg, p=pps, s=stages, f=pf:
                                      rms_norm_backward(dy, x, w, rstd, config=c,
                                                        programs_per_sm=p, num_stages=s,
                                                        prefetch=f)))
    _print_best(rows, base, default, ("fwd", "bwd"))
    return rows


def _small_candidates(n_rows: int, h: int, device) -> tuple[list, list]:
    """The launches `_tune_small` times: forward (rows, warps); backward (rows, warps,
    programs per SM, fewest rows per program), one per distinct grid."""
    from colossal_lab.kernels._norm_common import next_power_of_2, persistent_programs

    block = next_power_of_2(h)
    tiles = [r for r in TUNE_SMALL_ROWS if r * block <= 16384]
    fwd = [(r, nw) for r in tiles for nw in TUNE_SMALL_WARPS]
    bwd, grids = [], set()
    for r in tiles:
        for nw in TUNE_SMALL_WARPS:
            for pps in (1, 2, 4):
                for m in MIN_ROWS_CANDIDATES:
                    programs = persistent_programs(n_rows, r, nw, device, pps, m)
                    if (r, nw, programs) not in grids:
                        grids.add((r, nw, programs))
                        bwd.append((r, nw, pps, m, programs))
    return fwd, bwd


def _tune_small(x, w, dy, rstd, base, fwd_bytes, bwd_bytes, device) -> list[dict]:
    """`--tune` at `TUNE_SMALL_TOKENS` tokens or fewer: whole launches (tile, warps and,
    for the backward, the grid), each timed by CUDA-graph replay with L2 flushed, as
    the sweep times the ops: a call here lasts a few microseconds, so eager timing
    would time the launches. The winners become the table's ".../small" entries
    (`_norm_common.SMALL_ROWS`). The launch that runs without them is timed too
    (`current`)."""
    from colossal_lab.kernels._norm_common import launch_config, persistent_programs
    from colossal_lab.kernels.rms_norm import rms_norm_backward, rms_norm_forward

    base = {**base, "kind": "tune-small"}  # its own kind: a save keeps the "tune" rows
    h, dtype = base["hidden"], x.dtype

    rows = []
    for pas in ("fwd", "bwd"):  # what runs today, for the printout and the notes
        cfg = launch_config(h, dtype, backward=pas == "bwd", small=True)
        row = {**base, "pass": pas, "rows": cfg.rows, "num_warps": cfg.num_warps,
               "current": cfg.source}
        if pas == "bwd":
            row.update(programs_per_sm=cfg.programs_per_sm,
                       min_rows_per_program=cfg.min_rows_per_program,
                       num_stages=cfg.num_stages, prefetch=cfg.prefetch,
                       programs=persistent_programs(x.shape[0], cfg.rows, cfg.num_warps,
                                                    device, cfg.programs_per_sm,
                                                    cfg.min_rows_per_program))
        rows.append(_timed(row, fwd_bytes if pas == "fwd" else bwd_bytes,
                           (lambda c=cfg: rms_norm_forward(x, w, EPS, config=c))
                           if pas == "fwd" else
                           (lambda: rms_norm_backward(dy, x, w, rstd)), graph=True))
    fwd, bwd = _small_candidates(x.shape[0], h, device)
    for r, nw in fwd:
        cfg = launch_config(h, rows=r, num_warps=nw)
        rows.append(_timed({**base, "pass": "fwd", "rows": r, "num_warps": nw}, fwd_bytes,
                           lambda c=cfg: rms_norm_forward(x, w, EPS, config=c), graph=True))
    for r, nw, pps, m, programs in bwd:
        cfg = launch_config(h, rows=r, num_warps=nw)
        row = {**base, "pass": "bwd", "rows": r, "num_warps": nw, "programs_per_sm": pps,
               "min_rows_per_program": m, "num_stages": 1, "prefetch": False,
               "programs": programs}
        rows.append(_timed(row, bwd_bytes, lambda c=cfg, p=pps, mr=m: rms_norm_backward(
            dy, x, w, rstd, config=c, programs_per_sm=p, num_stages=1, min_rows=mr,
            prefetch=False), graph=True))
    for pas in ("fwd", "bwd"):
        cur = next(r for r in rows if r["pass"] == pas and "current" in r)
        ok = [r for r in rows if r["pass"] == pas and "current" not in r and "ms" in r]
        best = min(ok, key=lambda r: r["ms"], default=None)
        if best is not None and "ms" in cur:
            print(f"  {base['tokens']} x {h:<6} {base['dtype']} {pas} (small): current "
                  f"{cur['ms'] * 1e3:.2f} us ({cur['current']}); best "
                  f"{best['ms'] * 1e3:.2f} us {_launch_of(best)}", flush=True)
    return rows


def _launch_of(row: dict) -> dict:
    keys = ("rows", "num_warps", "programs_per_sm", "min_rows_per_program", "programs")
    return {k: row[k] for k in keys if k in row}


def _print_best(rows, base, default, passes) -> None:
    for pas in passes:
        ok = [r for r in rows if r["pass"] == pas and "gbps" in r]
        best = max(ok, key=lambda r: r["gbps"], default=None)
        print(f"  {base['tokens']} x {base['hidden']:<6} {base['dtype']} {pas}: default "
              f"{default}; best {best}", flush=True)


def save_tune(name: str, rows: list[dict], command: str) -> Path:
    """Save tuning rows into `results/<gpu>/<name>.json`, replacing the (hidden, dtype)
    an earlier invocation measured and keeping the others: --tune runs in chunks."""
    from colossal_lab.measure.results import merge_rows

    merged = merge_rows(name, rows, ("kind", "tokens", "hidden", "dtype"))
    return save_results(name, merged, config=config_of(dtype="per row"), command=command)


def table_from_tune(rows: list[dict]) -> dict[str, dict[str, int]]:
    """The fastest launch per (bucket, dtype, pass) of tuning rows, keyed as
    `_norm_common.table_entry` looks it up: "<next_power_of_2(H)>/<dtype>/<pass>".
    Tile, warps, programs per SM and stages come from the largest token count tuned;
    a backward's `min_rows_per_program` from the smallest one tuned for it (rows that
    vary it alone, from before `_tune_small`). Whole launches tuned at few tokens
    (`_tune_small`'s rows) give "<bucket>/<dtype>/<pass>/small", the fastest at the
    smallest token count tuned, where it beats the "current" launch by `SMALL_MARGIN`;
    where it does not and the current launch was itself a small entry, that one stays
    (so a second tune does not drop an entry its own winner could not clearly beat)."""
    from colossal_lab.kernels._norm_common import next_power_of_2

    def key(r):
        return f"{next_power_of_2(r['hidden'])}/{r.get('dtype', 'bfloat16')}/{r['pass']}"

    tuned = [r for r in rows if r.get("kind") in ("tune", "tune-small") and r.get("gbps")
             and "current" not in r]
    current = {(key(r), r["tokens"]): r for r in rows
               if r.get("kind") == "tune-small" and "current" in r and r.get("ms")}
    best: dict[str, dict] = {}
    small: dict[str, dict] = {}
    few: dict[str, dict] = {}  # whole launches tuned at few tokens: ".../small"
    for r in tuned:
        k = key(r)
        if r["kind"] == "tune-small":
            cur = few.get(k)
            if cur is None or (r["tokens"], -r["gbps"]) < (cur["tokens"], -cur["gbps"]):
                few[k] = r
            continue
        if "min_rows_per_program" in r:
            cur = small.get(k)
            if cur is None or (r["tokens"], -r["gbps"]) < (cur["tokens"], -cur["gbps"]):
                small[k] = r
            continue
        cur = best.get(k)
        if cur is None or (r.get("tokens", 0), r["gbps"]) > (cur.get("tokens", 0),
                                                             cur["gbps"]):
            best[k] = r
    fields = {"fwd": ("rows", "num_warps"),
              "bwd": ("rows", "num_warps", "programs_per_sm", "num_stages", "prefetch")}
    table = {k: {f: r[f] for f in fields[r["pass"]] if f in r} for k, r in best.items()}
    for k, r in small.items():
        table.setdefault(k, {})["min_rows_per_program"] = r["min_rows_per_program"]
    fields["bwd"] += ("min_rows_per_program",)
    for k, r in few.items():
        cur = current.get((k, r["tokens"]))
        if cur is None or r["ms"] <= cur["ms"] * (1 - SMALL_MARGIN):
            win = r  # a clear win over the launch that ran
        elif str(cur["current"]).endswith("/small"):
            win = cur  # the small entry that ran stays unless clearly beaten
        else:
            continue
        table[f"{k}/small"] = {f: win[f] for f in fields[r["pass"]]
                               if win.get(f) is not None}
    return dict(sorted(table.items()))


def write_table(tune_name: str = "fused_norm_tune", path: Path | None = None) -> Path:
    """Rewrite `colossal_lab/kernels/norm_table.py` with the tuned entries of the GPU
    whose `results/<gpu>/<tune_name>.json` is found (this GPU's, else the reference's),
    keeping other GPUs' entries."""
    import pprint
    import textwrap

    from colossal_lab.kernels import norm_table
    from colossal_lab.measure.results import load_results

    res = load_results(tune_name)
    gpu = res.provenance["gpu"]  # torch's device name: what `launch_config` looks up
    tables = {**norm_table.TABLES, gpu: table_from_tune(res.rows)}
    path = path or Path(norm_table.__file__)
    doc = (norm_table.__doc__ or "").strip()
    body = textwrap.indent(pprint.pformat(tables, width=88, sort_dicts=True), "    ")
    path.write_text(f'"""{doc}\n"""\n\n# from {res._file_label()}, commit '
                    f"{str(res.provenance.get('git_sha'))[:10]}\n"
                    f"TABLES: dict[str, dict[str, dict[str, int | bool]]] = (\n{body}\n)\n")
    return path


# -------------------------------------------------------------------------------- main


def config_of(dtype="bf16", group: str | None = None) -> dict:
    cfg = {"dtype": dtype, "weight_dtype": dtype, "eps": EPS,
           "timing": "CUDA graph replay, median of 100, L2 flushed before each "
                     "(eager do_bench where a provider cannot be captured: row 'timing')",
           "backward": "torch.autograd.grad on a retained graph (no .grad accumulation)",
           "gbps": "bytes an ideal kernel moves / time; see moved_bytes()",
           "max_case_gib": MAX_CASE_BYTES / 2**30,
           "compile": "torch.compile default (static first graph at the headline shape, "
                      "then dynamic shapes)"}
    if group is not None:  # the sweep: both timings in every row, host-time rows
        cfg.update(group=group, dtype="per row", weight_dtype="the input's",
                   eager_timing="do_bench of fwd and fwd+bwd launched from Python "
                                "(eager_*_ms), next to the graph replays, the garbage "
                                "collector paused (rows since 2026-12-03: their "
                                "timed_as says so); since 2026-12-03 (eighth "
                                "session) the providers of a case in turns "
                                "(eager_in_turns)",
                   host_timing="kind 'host' rows: each row's host_timing (host_rows())")
    return cfg


def main(argv=None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--tune", action="store_true", help="launch-parameter sweep (GPU)")
    p.add_argument("--write-table", action="store_true",
                   help="write kernels/norm_table.py from results/<gpu>/<name>_tune.json")
    p.add_argument("--group", choices=list(GROUPS),
                   help="issue #14's sweep: graph and eager timings, host time, chunks")
    p.add_argument("--ops", nargs="*", choices=OPS)
    p.add_argument("--providers", nargs="*", choices=PROVIDERS)
    p.add_argument("--hidden", nargs="*", type=int,
                   help=f"default {HIDDEN} + {ODD_HIDDEN}")
    p.add_argument("--tokens", nargs="*", type=int, help=f"default {TOKENS}")
    p.add_argument("--dtypes", nargs="*", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--resume", action="store_true",
                   help="keep the cases already in results/<gpu>/<name>.json (same "
                        "config), measure and append the rest")
    p.add_argument("--redo", action="store_true",
                   help="with --resume: measure the selected cases (--ops, --hidden, "
                        "--tokens, --dtypes) again, and the host rows of their ops and "
                        "dtypes, replacing the rows kept for them")
    p.add_argument("--host-parts", action="store_true",
                   help="host time of our RMSNorm's parts vs F.rms_norm (tiny shape)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the cases, a time estimate and chunked commands; no GPU")
    p.add_argument("--name", help="results file name (keep partial runs apart); "
                   f"default fused_norm, with --group {GROUPS}")
    a = p.parse_args(argv)
    a.name = a.name or GROUPS.get(a.group, "fused_norm")
    command = " ".join(["python -m colossal_lab bench fused_norm", *argv])
    if a.host_parts:
        rows = [r for d in a.dtypes for r in host_parts(dtype=getattr(torch, d))]
        for r in rows:
            print(f"  {r['dtype']:<9}{r['us']:9.2f} us  {r['part']}")
        if not a.quick:
            path = save_results(f"{a.name}_host", rows, config=config_of(dtype="per row"),
                                command=command)
            print(f"saved {path}")
        return
    if a.write_table:
        print(f"wrote {write_table(f'{a.name}_tune')}")
        return
    if a.tune:
        rows = tune(tuple(a.tokens) if a.tokens else (16384,),
                    tuple(a.hidden) if a.hidden else TUNE_HIDDEN,
                    dtypes=tuple(getattr(torch, d) for d in a.dtypes))
        path = save_tune(f"{a.name}_tune", rows, command)
        print(f"saved {path}")
        return
    if a.redo and not (a.resume and a.group):
        p.error("--redo replaces rows of a saved sweep: it goes with --group and --resume")
    if a.group is None:
        if a.resume or a.dry_run:
            p.error("--resume and --dry-run go with --group (the chunked sweep)")
        rows = run(a.quick, ops=tuple(a.ops or NORM_OPS), providers=a.providers,
                   hidden=tuple(a.hidden or RUN_HIDDEN),
                   tokens=tuple(a.tokens or RUN_TOKENS))
        if not a.quick:
            path = save_results(a.name, rows, config=config_of(), command=command)
            print(f"saved {path}")
        return
    run_group(a, p, command)


def run_group(a, p, command: str) -> None:
    """`--group`: the sweep of issue #14, resumable, in chunks."""
    if a.quick:  # CPU smoke test of the whole path: tiny shapes, nothing saved
        cases = sweep_cases(a.group, hidden=None, tokens=(8,), dtypes=a.dtypes,
                            ops=a.ops)
        cases = [(op, t, 100 if op != "swiglu" else 70, d) for op, t, h, d in cases
                 if h == min(c[2] for c in cases if c[0] == op)]
    else:
        cases = sweep_cases(a.group, hidden=a.hidden, tokens=a.tokens, dtypes=a.dtypes,
                            ops=a.ops)
    providers = a.providers  # None: the sweep's own (with "eager" at SWEEP_EAGER_AT)
    if a.dry_run:
        extra = [*(["--providers", *providers] if providers else []),
                 *(["--resume"] if a.resume else []), *(["--redo"] if a.redo else [])]
        print(dry_run(cases, providers or list(SWEEP_PROVIDERS), a.group, a.name,
                      extra=" ".join(extra)))
        return
    if a.quick:
        rows = sweep(cases, providers, host_shapes=((4, 64),), host_calls=3)
        for t in targets(rows):
            print(f"  {t['check']}: {t['ok']} (worst {t['worst']})")
        return
    from colossal_lab.measure.results import load_results, resumed_rows

    config, kept = config_of(group=a.group), []
    if a.resume:
        try:
            old = load_results(a.name, gpu=_slug())
        except FileNotFoundError:
            old = None  # the first chunk: nothing to keep
        if old is not None:
            kept, config = resumed_rows(a.name, old, config, p.error, what="results file",
                                        may_change=("eager_timing", "host_timing"),
                                        retry=measured_by(cases))
            if a.redo:
                kept = redo_rows(kept, cases)
            print(f"[fused_norm] resuming: {len(kept)} rows kept", flush=True)

    def save(rows):
        save_results(a.name, kept + rows, config=config, command=command)

    rows = sweep(cases, providers, on_row=save, done={case_key(r) for r in kept})
    save(rows)
    both = any(r.get("provider") == "triton-native" for r in kept + rows)
    for ours in ("triton", "triton-native") if both else ("triton",):
        for t in targets(kept + rows, ours=ours):
            print(f"  {ours}: {t['check']}: {t['ok']} (worst {t['worst']} at {t['at']})")
    print(f"saved {len(kept + rows)} rows")


def measured_by(cases):
    """Whether a run of `cases` measures a row: an op row of one of its cases, a host
    row of one of its (op, dtype) pairs (what `--redo` replaces, and the failed rows a
    resume may drop)."""
    points = {(op, t, h, d) for op, t, h, d in cases}
    pairs = {(op, d) for op, _, _, d in cases}

    def measures(r: dict) -> bool:
        if r.get("kind") == "op":
            return (r.get("op"), r.get("tokens"), r.get("hidden"), r.get("dtype")) in points
        return r.get("kind") == "host" and (r.get("op"), r.get("dtype")) in pairs

    return measures


def redo_rows(kept: list[dict], cases) -> list[dict]:
    """`kept` without the rows `--redo` measures again (`measured_by`)."""
    again = measured_by(cases)
    return [r for r in kept if not again(r)]


def _slug() -> str:
    from colossal_lab.measure import hardware

    return hardware.detect().slug


if __name__ == "__main__":
    main()
