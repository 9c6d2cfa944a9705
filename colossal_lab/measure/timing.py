"""Timing that is right on a GPU and usable on a CPU.

GPU work is asynchronous: a host clock around a launch measures the launch, not the
kernel. On CUDA we time with `triton.testing.do_bench` (CUDA events, L2 flushed between
runs, warm-up first) for kernels, and with CUDA events around whole iterations for
training steps. On a CPU we use `time.perf_counter`. Every figure is a median of many
runs with its spread, never one run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median and spread of repeated runs, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms else 0.0

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms (p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}, n={self.n})"


def _summary(times_ms: list[float]) -> Timing:
    if not times_ms:
        raise ValueError("no timings")
    s = sorted(times_ms)
    q = quantile_10_90(s)
    return Timing(statistics.median(s), q[0], q[1], len(s))


def quantile_10_90(times: list[float]) -> tuple[float, float]:
    """p10 and p90 of `times` (`statistics.quantiles`, deciles), kept inside the
    samples: with fewer than 9 samples the default method extrapolates past the
    smallest and largest, to below zero when the spread is wide."""
    s = sorted(times)
    if len(s) < 2:
        return s[0], s[0]
    q = statistics.quantiles(s, n=10)
    return max(q[0], s[0]), min(q[-1], s[-1])


def in_turns(items, rounds: int):
    """`rounds` orders of `items` for timing them in turns, each rotated one place from
    the one before (a, b, c; b, c, a; c, a, b; ...): a drift of the clocks or the host
    during a round then reaches every item, and no item always goes first."""
    items = list(items)
    for r in range(rounds):
        k = r % len(items) if items else 0
        yield items[k:] + items[:k]


def _on_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def time_cuda_graph(fn: Callable[[], object], *, reps: int = 100, warmup: int = 3,
                    capture_mode: str | None = None) -> Timing:
    """GPU time of `fn` captured once as a CUDA graph and replayed `reps` times, each
    replay bracketed by events with the L2 cache flushed before it.

    A short memory-bound op launched from Python can take less GPU time than its
    launches take CPU time; timed eagerly, the GPU then idles between kernels and the
    figure measures Python. In a training step those launches hide behind the matmuls
    that precede them, so graph replay times what the kernels themselves cost.
    `capture_mode`: the capture's error mode (`_capture`); `fn.capture_stream`, where
    set, the stream to capture on (a backward whose forward ran there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    _capture(fn, graph, capture_mode, getattr(fn, "capture_stream", None))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return _summary([a.elapsed_time(b) for a, b in zip(starts, ends)])


def _capture(fn: Callable[[], object], graph: torch.cuda.CUDAGraph,
             mode: str | None = None, stream: torch.cuda.Stream | None = None) -> None:
    """Capture `fn()` into `graph`, on a memory pool and a capture stream of its own
    (or `stream`), under CUDA's capture error `mode` (default `CAPTURE_MODES[0]`, or the
    environment's COLOSSAL_LAB_CAPTURE_MODE, which overrides every mode asked for).

    Why not plain `torch.cuda.graph(graph)`: a failed capture can leave the caching
    allocator sending the capture stream's allocations to that graph's pool, and
    `torch.cuda.graph` reuses one default capture stream for every capture, so every
    later capture allocates from an orphaned pool that `empty_cache()` never returns
    and a sweep's memory grows case by case. With each capture on its own pool and
    stream, and a failed one's pool routing ended here, free memory stays flat
    (`gpu_free_gib` in fused_norm.json)."""
    pool = torch.cuda.graph_pool_handle()
    try:
        mode = os.environ.get("COLOSSAL_LAB_CAPTURE_MODE") or mode or CAPTURE_MODES[0]
        with torch.cuda.graph(graph, pool=pool, stream=stream or torch.cuda.Stream(),
                              capture_error_mode=mode):
            fn()
    except Exception:
        try:
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        except Exception:  # capture_end got that far itself: nothing left to end
            pass
        raise


CAPTURE_MODES = ("thread_local", "global")
"""The capture error modes `time_kernels` tries, in turn. "thread_local" first: the
autograd engine's worker thread may touch CUDA during a capture. "global", torch's own
default, second: some captures fail under "thread_local" ("operation failed due to a
previous error during capture") and succeed under "global", such as the backward alone
of `F.rms_norm` replayed on a graph whose forward was built outside the capture. A row's
timing label does not say which mode captured it."""

CAPTURE_FAILED = "capture failed"
"""What a `time_kernels` label holds when the graph capture failed and events timed it."""


def time_kernels(fn: Callable[[], object], *, device=None, reps: int = 100,
                 captures: int = 2) -> tuple[Timing, str]:
    """The GPU time of `fn`'s kernels and how it was taken: CUDA-graph replay
    ("cuda_graph", `time_cuda_graph`), the capture tried up to `captures` times, each on
    a pool and stream of its own and under the next of `CAPTURE_MODES`; where every try
    fails, eagerly with `do_bench` ("events (capture failed: why)": Python launch gaps
    included, and said so); on a CPU a loop ("perf_counter"). Some passes fail every
    capture at some shapes (`CAPTURE_MODES`); such a row says so, and `--resume`
    measures it again (`results.fell_back`)."""
    if not _on_cuda(device):
        return time_fn(fn, device=device), "perf_counter"
    error: Exception = RuntimeError("no capture tried")
    for i in range(captures):
        try:
            return time_cuda_graph(fn, reps=reps,
                                   capture_mode=CAPTURE_MODES[i % len(CAPTURE_MODES)]
                                   ), "cuda_graph"
        except Exception as e:  # e.g. an op that cannot be captured: say which
            error = e
            try:  # (an invalidated capture's error is not sticky: try again)
                torch.cuda.synchronize()
            except Exception:
                pass
    why = str(error).strip().splitlines()[0][:80] if str(error).strip() else ""
    return time_fn(fn, device=device), f"events ({CAPTURE_FAILED}: " \
        f"{type(error).__name__}" + (f": {why})" if why else ")")


def time_fn(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_warmup: int = 2, cpu_reps: int = 10, device=None) -> Timing:
    """Time a short call (a kernel, an op, a fwd+bwd), Python launches included. GPU:
    `do_bench`; CPU: a loop. For the kernels alone see `time_kernels`."""
    if _on_cuda(device):
        from triton.testing import do_bench

        times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        return _summary(list(times))
    for _ in range(cpu_warmup):
        fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return _summary(times)


def time_iterations(step: Callable[[int], object], *, warmup: int = 3, iters: int = 20,
                    device=None, on_step: Callable[[int, float], None] | None = None,
                    before_step: Callable[[int], object] | None = None) -> Timing:
    """Time whole iterations (a training step) one by one; `step(i)` does iteration i.

    CUDA events bracket each iteration so each time is the GPU time of that step
    (synchronising after each). `before_step(i)` runs just before each timed step and
    `on_step(i, ms)` just after it, both outside the timed region.
    """
    cuda = _on_cuda(device)
    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    times = []
    for i in range(warmup, warmup + iters):
        if before_step is not None:
            before_step(i)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            step(i)
            ms = (time.perf_counter() - t0) * 1e3
        times.append(ms)
        if on_step is not None:
            on_step(i, ms)
    return _summary(times)


def peak_memory_gib(device=None) -> float | None:
    """Peak allocated memory since the last reset, in GiB (None on CPU)."""
    if not _on_cuda(device):
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def reset_peak_memory(device=None) -> None:
    if _on_cuda(device):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def tflops(flops: float, ms: float) -> float:
    """FLOPs done in `ms` milliseconds, as TFLOP/s."""
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    """Bytes moved in `ms` milliseconds, as GB/s (10^9)."""
    return nbytes / (ms * 1e-3) / 1e9


def eager_and_graph(fn: Callable[[], object], device) -> dict:
    """Both timings a user meets, in ms: eager (`time_fn`: do_bench for about 50
    milliseconds, or a CPU loop) as "eager_ms", and on a GPU CUDA-graph replay
    (`time_kernels`, as many replays as fit in ~0.1 s, 10 to 100) as "ms"; "timing"
    says how "ms" was taken."""
    eager = time_fn(fn, device=device, warmup_ms=10, rep_ms=50).median_ms
    if torch.device(device).type != "cuda":
        return {"ms": eager, "eager_ms": eager, "timing": "perf_counter"}
    reps = int(min(100, max(10, 100 / max(eager, 1e-3))))
    kernels, how = time_kernels(fn, device=device, reps=reps)
    return {"ms": kernels.median_ms, "eager_ms": eager, "timing": how}
