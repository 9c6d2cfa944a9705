"""The fused-norm benchmark's one case: ideal bytes, counted traffic, providers, timing.

The norms are memory-bound, so the unit is effective bandwidth: the bytes an ideal
kernel must move divided by the time (`moved_bytes`, next to the timing), the same for
every provider; eager's real traffic is counted op by op (`traffic_bytes`). `measure`
times one provider at one (op, tokens, hidden, dtype), graph replay and eager;
`host_rows` the host time per call.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colossal_lab.kernels import _norm_common as nc
from colossal_lab.kernels import native
from colossal_lab.kernels import rms_norm as rk
from colossal_lab.kernels.rms_norm import rms_norm_triton
from colossal_lab.measure.timing import gbps, in_turns, time_fn, time_kernels
from colossal_lab.ops import norm
from colossal_lab.ops import swiglu as projections
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
"""(hidden, intermediate) of the LLaMA-family models: the norms run at the hidden
size, SwiGLU at the intermediate size."""
HEADLINE = (16384, 4096)
"""(tokens, hidden) of the summary table and of the first compile (see `run`)."""
MAX_CASE_BYTES = 24 << 30
"""Skip cases whose inputs, outputs and gradients exceed this (eager needs more; an
H200 holds 141 GB, so the whole RMSNorm sweep runs: 64k x 16384 fp32 is 16 GiB)."""
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

        name = {"torch": "eager", "eager": "eager"}.get(provider, provider)
        return lambda gu: projections.swiglu(gu, backend=name)
    if provider == "triton-native":  # RMSNorm only: per-call work in C++

        if native.module() is None:
            raise RuntimeError(f"the native path cannot be built: {native.why_not()}")

        def through_cpp(x, w):
            with native.forced():  # the first call of a shape registers it (Python)
                return rms_norm_triton(x, w, EPS)

        return through_cpp
    if provider == "separate":  # the unfused baseline of the fused add

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

    Host time drifts within a process and between processes (the same op by more than
    half from one process to the next), so the providers are timed in turns, loop by
    loop, with the order rotated each round: a drift then shifts them alike and their
    difference, which the target is about, holds. On a CPU the ops also run: meaningless
    as host time, kept as a smoke test (`device` says so)."""

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


def providers_here(op: str, device) -> list[str]:
    """Providers that run here without falling back to another one."""
    avail = norm.available_backends(device)
    out = [p for p in PROVIDERS[:-1] if p in avail]
    if op == "rms_norm" and "triton" in avail and torch.device(device).type == "cuda":
        out.insert(out.index("triton") + 1, "triton-native")
    if op == "add_rms_norm" and "triton" in avail:
        out.append("separate")
    return out


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
                                "collector paused (each row's timed_as says so), the "
                                "providers of a case in turns (eager_in_turns)",
                   host_timing="kind 'host' rows: each row's host_timing (host_rows())")
    return cfg


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
