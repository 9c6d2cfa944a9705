"""Profile a training step: `torch.profiler` with a schedule, a Chrome / Perfetto trace,
and a summary of where the step's time went.

The seed's recipe (chapter 10, section 11) wraps the training loop in
`torch.profiler.profile` with ``schedule(wait=1, warmup=2, active=3)`` and reads the
timeline in TensorBoard. `profile_steps` does the same around any `step(ids, labels)`
(`train.make_step`, `benchmarks.steps.build`), and writes one trace file that Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open; TensorBoard's profiler plugin
is deprecated. The data fetch of every step runs inside ``record_function("data")``, so
a slow data loader shows as a named range.

`summarize` reads the trace back and answers the questions the seed's checklist asks:

* **GPU time by kernel class** (`KERNEL_CLASSES`: GEMM, attention, norm, rope,
  activation, copies/casts, elementwise, loss, optimizer, communication, other), by
  kernel *name*, first matching pattern wins; and the top kernels.
* **Idle gaps**: the device window minus the union of its kernels. On a GPU,
  HolisticTraceAnalysis (`hta`) splits the idle time into *host wait* (the GPU waited
  for the CPU to launch: a host-bound step), *kernel wait* (the short gaps between
  back-to-back kernels) and *other*, and gives its temporal breakdown.
* **Data-loader stalls**: device idle time while the host was inside ``data``.
* **Communication**: with several GPUs, the communication kernels' time that no compute
  kernel overlaps (*exposed*, it lengthens the step) and the rest (*overlapped*); HTA's
  computation/communication overlap next to it.

A CPU trace has no kernels (HTA finds nothing to analyse in it): there the "device" is
the CPU, its kernels are the operators (`cat == "cpu_op"`, self time: an operator's time
less its children's), busy time is the union of the top-level operators and idle time
is the step spent outside any operator (Python, the autograd engine, Triton's
interpreter). The same classes and tables then describe a CPU step.

`roofline_points` places operators against the machine's ceilings: FLOPs and bytes
counted from the shapes the profiler records (``record_shapes=True``) for matmuls and
attention, and a memory-bound estimate for the rest; time from the kernels each
operator launched (GPU) or the operator itself (CPU). `plot_roofline` draws them.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import re
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# ----------------------------------------------------------------- kernel classes

KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", (r"nccl", r"c10d::", r"gloo", r"record_param_comms", r"all_?reduce",
                       r"all_?gather", r"reduce_?scatter", r"all_to_all", r"sendrecv")),
    ("optimizer", (r"multi_tensor_apply", r"adam", r"_foreach_", r"\bsgd", r"lamb(?!da)",
                   r"LpNorm", r"clip_grad")),
    ("loss", (r"cross_?entropy", r"nll_loss", r"log_?softmax", r"logsumexp")),
    ("attention", (r"flash", r"fmha", r"attention", r"attn", r"sdpa",
                   r"scaled_dot_product", r"softmax")),
    ("norm", (r"rms_?norm", r"layer_?norm", r"group_?norm", r"batch_?norm", r"rsqrt")),
    ("rope", (r"rope", r"rotary")),
    ("activation", (r"silu", r"swiglu", r"gelu", r"act_and_mul", r"\bglu")),
    ("GEMM", (r"gemm", r"xmma", r"cutlass", r"nvjet", r"cublas", r"^(void )?sm\d+_",
              r"ampere_", r"hopper_", r"volta_", r"turing_", r"splitk", r"gemv",
              r"triton_tem_", r"scaled_mm",
              r"^aten::(mm|addmm|bmm|baddbmm|addmv|matmul|linear|_scaled_mm)$")),
    ("copies/casts", (r"copy", r"(?<!broad)cast", r"memcpy", r"memset", r"fill", r"catarray",
                      r"^aten::(to|_to_copy|clone|contiguous|cat|zero_|zeros|ones|"
                      r"empty_like|index_put_|stack)$")),
    ("elementwise", (r"elementwise", r"reduce_kernel", r"triton_(poi|red|per)_",
                     r"^aten::(add|sub|mul|div|neg|pow|exp|log|sqrt|reciprocal|mean|sum|"
                     r"where|masked_fill|maximum|minimum|abs|clamp|lerp|addcmul|addcdiv|"
                     r"tanh|sigmoid|sin|cos|amax|max|min|ne|eq|lt|gt|sign|"
                     r"linalg_vector_norm|norm)_?$")),
)
"""(class, patterns) in the order they are tried; a kernel's class is the first whose
pattern occurs in its name (case-insensitive `re.search`), else "other". The order
matters where names share words:

* communication first (``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``), then the
  optimizer (``multi_tensor_apply_kernel<...FusedAdamW...>``, our ``_adamw_kernel``,
  ``aten::_fused_adamw_``; gradient clipping's ``LpNormFunctor`` before "norm");
* loss before attention: the cross-entropy's ``cunn_SoftMaxForward<...LogSoftMax...>``
  is a softmax too; any other softmax is attention's (naive attention);
* attention before GEMM: cuDNN's ``cudnn_generated_fort_native_sdpa_sm90_flash_...``
  carries an ``sm90`` like cuBLAS's ``sm90_xmma_gemm_...``; ``fmha_cutlassF_...``
  (memory-efficient attention) a ``cutlass``;
* norm, rope and activation before copies and elementwise: Inductor's fused
  ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0`` is an RMSNorm (``rsqrt``),
  ``triton_poi_fused_mul_silu_0`` a SwiGLU; PyTorch's
  ``elementwise_kernel<...silu_kernel...>`` an activation;
* copies before elementwise: ``elementwise_kernel<...direct_copy_kernel_cuda...>`` is
  a copy or a dtype cast, not arithmetic.

What names cannot tell: an eager RMSNorm is ``pow``, ``mean``, ``add``, ``rsqrt`` and
``mul`` kernels; only its ``rsqrt`` says "norm", the rest count as elementwise. The
embedding (``indexSelect...``, ``embedding_backward...``) and anything unknown is
"other". Names come from CUDA kernels (GPU traces) and from operators (CPU traces:
``aten::mm``, ``aten::_scaled_dot_product_flash_attention_for_cpu``, our autograd
Functions such as ``TritonRMSNormFunction``)."""

CLASSES = tuple(c for c, _ in KERNEL_CLASSES) + ("other",)
COLORS = dict(zip(CLASSES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                            "#8c564b", "#e377c2", "#2b2d7c", "#bcbd22", "#17becf",
                            "#c7c7c7")))
"""One colour per class, the same in every chart."""
_COMPILED = tuple((c, re.compile("|".join(p), re.IGNORECASE)) for c, p in KERNEL_CLASSES)


def classify(name: str) -> str:
    """The `KERNEL_CLASSES` class of a kernel or operator name ("other" if none)."""
    for cls, pattern in _COMPILED:
        if pattern.search(name):
            return cls
    return "other"


def short_name(name: str, width: int = 90) -> str:
    """A kernel name for a table: no leading ``void``, no ``at::native::`` or
    ``(anonymous namespace)::``, no argument list, at most `width` characters
    (templated CUDA names run to hundreds)."""
    name = re.sub(r"^void ", "", name)
    name = name.replace("(anonymous namespace)::", "").replace("at::native::", "")
    if name.endswith(")"):  # drop the argument list: the "(" that matches the last ")"
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] if i > 0 else name
                break
    return name if len(name) <= width else name[:width - 1] + "…"


# ----------------------------------------------------------------- profiling


@contextlib.contextmanager
def quiet_native_stderr():
    """Kineto writes ``profiler_start`` / ``profiler_stop`` lines straight to file
    descriptor 2, which a notebook shows as stderr. Capture the descriptor while the
    profiler starts and stops, and pass on every line that is not one of Kineto's
    informational ones (``INFO:``, ``USDT:``, ``STAGE:``)."""
    try:
        fd = 2
        saved = os.dup(fd)
    except OSError:  # no real descriptor (an embedded interpreter): nothing to quiet
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        import sys

        sys.stderr.flush()
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            keep = [ln for ln in text.splitlines()
                    if ln.strip() and not re.match(r"^(INFO|USDT|STAGE|WARNING):\d", ln)
                    and "ActivityProfiler" not in ln]
            if keep:
                print("\n".join(keep), file=sys.stderr)


@dataclass(frozen=True)
class Schedule:
    """`torch.profiler.schedule`'s phases: `wait` steps untraced, `warmup` traced and
    thrown away (the profiler's own start-up cost lands there), `active` recorded."""

    wait: int = 1
    warmup: int = 2
    active: int = 3

    @property
    def steps(self) -> int:
        return self.wait + self.warmup + self.active


def profile_steps(step: Callable, batches: Iterator, trace_path: str | Path, *,
                  schedule: Schedule = Schedule(), record_shapes: bool = True,
                  cuda: bool | None = None) -> Path:
    """Run `schedule.steps` training steps under `torch.profiler` and write the active
    steps' trace to `trace_path` (Chrome trace JSON; ``.json.gz`` compresses).

    `step(ids, labels)` is a training step (`train.make_step`); `batches` yields
    ``(ids, labels)``, fetched inside ``record_function("data")``. CUDA activity is
    recorded when `cuda` (default: when CUDA is available); the GPU is synchronized
    once, before the first recorded step, so that no earlier step's kernels run into
    the recorded window and the device window starts where the host's does."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.profiler import schedule as make_schedule

    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def on_ready(prof):
        prof.export_chrome_trace(str(trace_path))

    with quiet_native_stderr(), profile(
            activities=activities, record_shapes=record_shapes,
            schedule=make_schedule(wait=schedule.wait, warmup=schedule.warmup,
                                   active=schedule.active, repeat=1),
            # one cycle (repeat=1): keeping its events changes nothing in the trace and
            # spares the warning that a later cycle would clear them
            acc_events=True, on_trace_ready=on_ready) as prof:
        for i in range(schedule.steps):
            with record_function("data"):
                ids, labels = next(batches)
            step(ids, labels)
            if cuda and i == schedule.wait + schedule.warmup - 1:
                torch.cuda.synchronize()  # the GPU starts the recorded steps drained
            prof.step()
    if cuda:
        torch.cuda.synchronize()
    return trace_path


# ----------------------------------------------------------------- reading a trace


def load_trace(path: str | Path) -> dict:
    """A Chrome trace written by `torch.profiler` (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


@dataclass(frozen=True)
class Span:
    """One complete ("X") trace event; times in microseconds."""

    name: str
    cat: str
    ts: float
    dur: float
    pid: object
    tid: object
    args: dict

    @property
    def end(self) -> float:
        return self.ts + self.dur


def spans(trace: dict) -> list[Span]:
    return [Span(e.get("name", ""), e.get("cat") or "", float(e["ts"]), float(e["dur"]),
                 e.get("pid"), e.get("tid"), e.get("args") or {})
            for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and "ts" in e and "dur" in e]


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace categories of work that runs on the GPU."""


def union(intervals) -> list[tuple[float, float]]:
    """The union of `(start, end)` intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def overlap(a, b) -> float:
    """Total length of the intersection of two sets of intervals."""
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def self_times(ops: list[Span]) -> dict[int, float]:
    """Each operator's self time (its duration less its direct children's), by index
    into `ops`; nesting is per thread. Also marks top-level operators: see
    `top_level`."""
    out: dict[int, float] = {}
    by_thread: dict[tuple, list[int]] = defaultdict(list)
    for i, s in enumerate(ops):
        by_thread[(s.pid, s.tid)].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (ops[i].ts, -ops[i].dur))
        stack: list[int] = []
        for i in idx:
            while stack and ops[stack[-1]].end <= ops[i].ts:
                stack.pop()
            out[i] = ops[i].dur
            if stack:
                out[stack[-1]] -= ops[i].dur
            stack.append(i)
    return {i: max(0.0, t) for i, t in out.items()}


def top_level(ops: list[Span]) -> list[Span]:
    """The operators no other operator of their thread contains."""
    out = []
    by_thread: dict[tuple, list[Span]] = defaultdict(list)
    for s in ops:
        by_thread[(s.pid, s.tid)].append(s)
    for group in by_thread.values():
        end = -math.inf
        for s in sorted(group, key=lambda s: (s.ts, -s.dur)):
            if s.ts >= end:
                out.append(s)
            end = max(end, s.end)
    return out


# ----------------------------------------------------------------- the summary


@dataclass
class ProfileSummary:
    """Where the profiled steps' time went; every `_ms` is per step (the mean of the
    active steps)."""

    device: str
    """"cuda" (kernels on the GPU) or "cpu" (operators on the CPU)."""
    steps: int
    """Active steps in the trace (``ProfilerStep#N`` ranges)."""
    step_ms: float
    """Time of a profiled step (profiling slows a step a little): on a GPU the device's
    window (`window_ms`), since the host runs ahead of the kernels it queues and its
    step can end long before theirs; on a CPU the host's step."""
    window_ms: float
    """The device's window per step: from the first step's start to the last kernel's
    end (CPU: the steps themselves), divided by `steps`."""
    busy_ms: float
    """The union of the device's work (GPU kernels, copies; CPU top-level operators)."""
    idle_ms: float
    """`window_ms − busy_ms`: the GPU idle, or the CPU outside any operator."""
    classes: dict = field(default_factory=dict)
    """Class → ms per step, summed over kernels (streams that run at once add up)."""
    top: list = field(default_factory=list)
    """The kernels with the most time: name, class, ms per step, calls per step."""
    data_ms: float = 0.0
    """Host time inside ``record_function("data")``."""
    data_stall_ms: float = 0.0
    """Device idle time while the host was inside ``data``: what the loader costs."""
    comm_ms: float = 0.0
    """Union of the communication kernels."""
    comm_exposed_ms: float | None = None
    """Communication no compute kernel overlaps (GPU traces only)."""
    comm_overlapped_ms: float | None = None
    kernels_per_step: float = 0.0
    host_step_ms: float = 0.0
    """The host's ``ProfilerStep#`` range per step: shorter than `step_ms` on a GPU
    when nothing makes the host wait for the kernels it queued."""
    hta: dict | None = None
    """HolisticTraceAnalysis's numbers for a GPU trace (`hta_analysis`), or why not."""

    @property
    def idle_share(self) -> float:
        return self.idle_ms / self.window_ms if self.window_ms else 0.0

    def class_rows(self) -> list[dict]:
        """One row per class, largest first: ms per step and share of the kernel time."""
        total = sum(self.classes.values()) or 1.0
        return [{"kernel_class": c, "ms": ms, "share": ms / total}
                for c, ms in sorted(self.classes.items(), key=lambda kv: -kv[1]) if ms > 0]

    def to_dict(self) -> dict:
        return asdict(self)


def _steps(all_spans: list[Span]) -> list[Span]:
    return sorted((s for s in all_spans if s.name.startswith("ProfilerStep#")
                   and s.cat in ("user_annotation", "cpu_op")), key=lambda s: s.ts)


def summarize(trace_or_path, *, top: int = 10, use_hta: bool = True) -> ProfileSummary:
    """Read a `torch.profiler` trace (a path or a loaded dict) and summarize its active
    steps: the `ProfileSummary` fields. GPU traces are also handed to
    HolisticTraceAnalysis (`use_hta`; its result or its failure lands in `.hta`)."""
    path = None if isinstance(trace_or_path, dict) else Path(trace_or_path)
    trace = trace_or_path if path is None else load_trace(path)
    every = spans(trace)
    steps = _steps(every)
    if not steps:
        raise ValueError("no ProfilerStep# ranges in the trace: profile with a schedule "
                         "and call prof.step() after every step (profile_steps does)")
    n = len(steps)
    t0, t1 = steps[0].ts, max(s.end for s in steps)
    step_ms = sum(s.dur for s in steps) / n / 1e3
    data = [(s.ts, s.end) for s in every if s.name == "data" and s.cat == "user_annotation"
            and t0 <= s.ts < t1]
    device_work = [s for s in every if s.cat in DEVICE_CATS and s.end > t0]
    if device_work:
        kind = "cuda"
        items = [(s.name, s.dur, s.args.get("correlation")) for s in device_work]
        busy_iv = [(s.ts, s.end) for s in device_work]
        w0, w1 = t0, max(t1, max(s.end for s in device_work))
        comm = [(s.ts, s.end) for s in device_work if classify(s.name) == "communication"]
        compute = [(s.ts, s.end) for s in device_work
                   if classify(s.name) != "communication"]
        comm_ms = length(comm) / n / 1e3
        exposed = (length(comm + compute) - length(compute)) / n / 1e3
        overlapped = comm_ms - exposed
    else:
        kind = "cpu"
        ops = [s for s in every if s.cat == "cpu_op" and s.ts >= t0 and s.end <= t1]
        selfs = self_times(ops)
        items = [(ops[i].name, t, None) for i, t in selfs.items()]
        busy_iv = [(s.ts, s.end) for s in top_level(ops)]
        w0, w1 = t0, t1
        comm_ms = sum(t for name, t, _ in items if classify(name) == "communication") / n / 1e3
        exposed = overlapped = None
    window = (w1 - w0) / n / 1e3
    busy_len = length(busy_iv)
    busy = busy_len / n / 1e3
    classes = dict.fromkeys(CLASSES, 0.0)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, dur, _ in items:
        classes[classify(name)] += dur / n / 1e3
        per_name[name][0] += dur
        per_name[name][1] += 1
    total = sum(classes.values()) or 1.0
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    top_rows = [{"name": short_name(k), "kernel_class": classify(k), "ms": v[0] / n / 1e3,
                 "calls": v[1] / n, "share": v[0] / n / 1e3 / total} for k, v in ranked]
    data_ms = length(data) / n / 1e3
    stall = (length(data) - overlap(data, busy_iv)) / n / 1e3
    summary = ProfileSummary(
        device=kind, steps=n, step_ms=window if kind == "cuda" else step_ms,
        host_step_ms=step_ms, window_ms=window, busy_ms=busy,
        idle_ms=max(0.0, window - busy), classes=classes, top=top_rows, data_ms=data_ms,
        data_stall_ms=stall, comm_ms=comm_ms, comm_exposed_ms=exposed,
        comm_overlapped_ms=overlapped, kernels_per_step=len(items) / n)
    if kind == "cuda" and use_hta:
        summary.hta = hta_analysis(trace if path is None else path)
    return summary


# ----------------------------------------------------------------- HolisticTraceAnalysis


def hta_analysis(trace_or_path) -> dict:
    """HolisticTraceAnalysis (Meta's `hta`) on one GPU trace: its temporal breakdown
    (idle / compute / non-compute share of the GPU time), its idle-time breakdown (host
    wait, kernel wait, other; ms per step of the steps HTA keeps: it drops the last)
    and its computation/communication overlap (% of communication time).
    ``{"error": why}`` when `hta` is missing or cannot read the trace."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return {"error": "HolisticTraceAnalysis is not installed (pip install "
                         "HolisticTraceAnalysis)"}
    import logging

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "rank0.json"
        if isinstance(trace_or_path, dict):
            trace = dict(trace_or_path)
        else:
            trace = load_trace(trace_or_path)
        trace.setdefault("distributedInfo", {"rank": 0})
        target.write_text(json.dumps(trace))
        quiet = io.StringIO()
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)  # HTA logs every parse step
        try:
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pandas' NaN divisions without comm
                ta = TraceAnalysis(trace_dir=tmp)
                temporal = ta.get_temporal_breakdown(visualize=False).to_dict("records")[0]
                idle = ta.get_idle_time_breakdown(visualize=False)[0]
                overlap_df = ta.get_comm_comp_overlap(visualize=False)
                its = ta.t.get_trace(next(iter(ta.t.traces)))["iteration"]
                n = max(1, its[its >= 0].nunique())  # HTA drops the last, partial step
        except Exception as e:  # noqa: BLE001  (HTA's failures are many and untyped)
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        finally:
            logging.disable(level)
    by_cat = idle.groupby("idle_category")["idle_time"].sum().to_dict()
    pct = overlap_df["comp_comm_overlap_pctg"].iloc[0]
    return {
        "idle_pctg": float(temporal["idle_time_pctg"]),
        "compute_pctg": float(temporal["compute_time_pctg"]),
        "non_compute_pctg": float(temporal["non_compute_time_pctg"]),
        "host_wait_ms": float(by_cat.get("host_wait", 0.0)) / n / 1e3,
        "kernel_wait_ms": float(by_cat.get("kernel_wait", 0.0)) / n / 1e3,
        "other_idle_ms": float(by_cat.get("other", 0.0)) / n / 1e3,
        "comm_comp_overlap_pctg": None if pct != pct else float(pct),  # NaN: no comm
    }


# ----------------------------------------------------------------- results rows


def step_ms_of(row: dict) -> float:
    """A ``kind="step"`` row's step time: the device window on a GPU, the host's step on
    a CPU (`ProfileSummary.step_ms`). Rows recorded before `host_step_ms` existed held
    the host's time in ``profiled_step_ms`` on GPUs too: their window is taken."""
    return row["window_ms"] if row.get("device") == "cuda" else row["profiled_step_ms"]


def breakdown_rows(summary: ProfileSummary, **fields) -> list[dict]:
    """Flat results rows of a summary: one ``kind="step"`` row, one ``kind="class"``
    row per kernel class, one ``kind="kernel"`` row per top kernel; every row carries
    `fields` (setup, label, preset, ...)."""
    s = summary
    hta = s.hta or {}
    step = {**fields, "kind": "step", "device": s.device, "steps_profiled": s.steps,
            "profiled_step_ms": s.step_ms, "host_step_ms": s.host_step_ms,
            "window_ms": s.window_ms, "busy_ms": s.busy_ms,
            "idle_ms": s.idle_ms, "idle_share": s.idle_share, "data_ms": s.data_ms,
            "data_stall_ms": s.data_stall_ms, "comm_ms": s.comm_ms,
            "comm_exposed_ms": s.comm_exposed_ms, "kernels_per_step": s.kernels_per_step,
            **{f"hta_{k}": v for k, v in hta.items()}}
    rows = [step]
    rows += [{**fields, "kind": "class", **r} for r in s.class_rows()]
    rows += [{**fields, "kind": "kernel", **r} for r in s.top]
    return rows


# ----------------------------------------------------------------- roofline

DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2,
               "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
"""Bytes per element of the dtypes the profiler names in ``Input type``."""

_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$")
_SDPA = re.compile(r"^aten::_scaled_dot_product_(flash|efficient|cudnn)_attention"
                   r"(_for_cpu)?(_backward)?$")


def _numel(dims) -> int:
    return math.prod(dims) if dims else 1


def _tensors(args: dict) -> list[tuple[list[int], int]]:
    """(dims, bytes per element) of the tensor inputs an operator event records."""
    out = []
    for dims, typ in zip(args.get("Input Dims") or [], args.get("Input type") or []):
        if typ == "TensorList":
            out += [(d, 4) for d in dims if isinstance(d, list)]
        elif isinstance(dims, list) and dims and all(isinstance(x, int) for x in dims):
            out.append((dims, DTYPE_BYTES.get(typ, 4)))
    return out


def op_cost(name: str, args: dict) -> tuple[float, float] | None:
    """(FLOPs, bytes moved) of one operator call from the shapes the profiler recorded,
    or None when it recorded none.

    * GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``): 2·M·N·K FLOPs;
      bytes read A and B and write C (plus a bias when given).
    * Attention (SDPA's flash / efficient / cuDNN / CPU kernels): causal assumed (our
      models are), 4·B·H·S²·D·½ forward, 2.5 times that backward (FlashAttention-2's
      count); bytes: Q, K, V, O (and their gradients backward).
    * Anything else: memory-bound by assumption: one FLOP per element of its largest
      tensor, bytes = every input once plus an output as large as its largest input."""
    tensors = _tensors(args)
    if not tensors:
        return None
    if _GEMM.match(name):
        mats = [(d, b) for d, b in tensors if len(d) >= 2]
        if len(mats) < 2:
            return None
        # the operands come first: (A, B[, out]); addmm and baddbmm: (C, A, B[, out])
        with_c = name.endswith("addmm") and len(mats) >= 3
        (a, ba), (w, bw) = (mats[1], mats[2]) if with_c else (mats[0], mats[1])
        batch = _numel(a[:-2])
        m, k, n = a[-2], a[-1], w[-1]
        out_b = 2 if name.endswith("_scaled_mm") else ba
        flops = 2.0 * batch * m * n * k
        nbytes = batch * (m * k * ba + k * n * bw + m * n * out_b)
        if with_c:
            nbytes += _numel(mats[0][0]) * mats[0][1]
        return flops, float(nbytes)
    if _SDPA.match(name):
        four = [(d, b) for d, b in tensors if len(d) == 4]
        backward = name.endswith("_backward")
        if len(four) < (4 if backward else 3):
            return None
        q, k, v = four[1:4] if backward else four[:3]
        (bq, hq, sq, dq), esz = q
        sk, dv = k[0][2], v[0][3]
        fwd = 2.0 * bq * hq * sq * sk * (dq + dv) * 0.5
        qkv = (_numel(q[0]) + _numel(k[0]) + _numel(v[0])) * esz
        out = bq * hq * sq * dv * esz
        return (2.5 * fwd, 2.0 * qkv + 2.0 * out) if backward else (fwd, qkv + out)
    largest = max(tensors, key=lambda t: _numel(t[0]))
    return (float(_numel(largest[0])),
            float(sum(_numel(d) * b for d, b in tensors) + _numel(largest[0]) * largest[1]))


@dataclass(frozen=True)
class RooflinePoint:
    """One operator (all its calls with one shape) against the ceilings."""

    name: str
    kernel_class: str
    calls: float
    """Calls per step."""
    ms: float
    """Time per step: its kernels' (GPU) or its own (CPU)."""
    flops: float
    """FLOPs per step."""
    bytes: float
    """Bytes moved per step (an estimate: see `op_cost`)."""

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s."""
        return self.flops / (self.ms * 1e-3) / 1e12 if self.ms else 0.0


def roofline_points(trace_or_path, *, min_share: float = 0.001) -> list[RooflinePoint]:
    """Operators of the active steps with their FLOPs, bytes and time, grouped by name
    and shape; points below `min_share` of the total time are dropped.

    GPU traces: an operator's time is that of the kernels it launched (a kernel's
    ``External id`` names its operator); kernels launched outside any recorded operator
    (Triton kernels called from Python, whose shapes the trace does not record) are
    not placed. CPU traces: the self time of every operator with recorded shapes."""
    trace = trace_or_path if isinstance(trace_or_path, dict) else load_trace(trace_or_path)
    every = spans(trace)
    steps = _steps(every)
    if not steps:
        raise ValueError("no ProfilerStep# ranges in the trace")
    n = len(steps)
    t0, t1 = steps[0].ts, max(s.end for s in steps)
    ops = [s for s in every if s.cat == "cpu_op" and s.ts >= t0 and s.end <= t1]
    kernels = [s for s in every if s.cat in DEVICE_CATS]
    time_of: dict[int, float] = defaultdict(float)
    if kernels:
        launch_ext = {s.args.get("correlation"): s.args.get("External id") for s in every
                      if s.cat in ("cuda_runtime", "cuda_driver")}
        by_ext: dict[object, float] = defaultdict(float)
        for k in kernels:  # a kernel names its operator, or its launch does
            ext = k.args.get("External id", launch_ext.get(k.args.get("correlation")))
            by_ext[ext] += k.dur
        for i, op in enumerate(ops):
            time_of[i] = by_ext.get(op.args.get("External id"), 0.0)
    else:
        time_of.update(self_times(ops))
    groups: dict[tuple, list] = {}
    for i, op in enumerate(ops):
        t = time_of.get(i, 0.0)
        if t <= 0:
            continue
        cost = op_cost(op.name, op.args)
        if cost is None:
            continue
        key = (op.name, json.dumps(op.args.get("Input Dims")))
        g = groups.setdefault(key, [0.0, 0, 0.0, 0.0])
        g[0] += t
        g[1] += 1
        g[2] += cost[0]
        g[3] += cost[1]
    total = sum(g[0] for g in groups.values()) or 1.0
    pts = [RooflinePoint(name, classify(name), g[1] / n, g[0] / n / 1e3, g[2] / n, g[3] / n)
           for (name, _), g in groups.items() if g[0] / total >= min_share]
    return sorted(pts, key=lambda p: -p.ms)


def plot_roofline(points: list[RooflinePoint], ceilings: dict[str, tuple[float, float]],
                  *, title: str | None = None, ax=None):
    """The roofline: attainable TFLOP/s = min(peak, bandwidth × intensity) for each of
    `ceilings` (label → (TFLOP/s, GB/s); the first solid, the others dashed), and one
    marker per point, its area proportional to its time, its colour its class. 9 inches
    wide at most."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8.5, 5.0))
    shown = [p for p in points if p.intensity > 0 and p.tflops > 0]
    ridge = max(t * 1e12 / (g * 1e9) for t, g in ceilings.values())
    lo = min([p.intensity for p in shown] + [ridge / 100]) / 3
    hi = max([p.intensity for p in shown] + [ridge * 10]) * 3
    grid = np.logspace(math.log10(lo), math.log10(hi), 200)
    for i, (label, (tflops, gbps)) in enumerate(ceilings.items()):
        ax.plot(grid, np.minimum(tflops, gbps * 1e9 * grid / 1e12), color="#333333",
                lw=1.5 if i == 0 else 1.2, ls="-" if i == 0 else "--",
                label=f"{label}: {tflops:,.4g} TFLOP/s, {gbps:,.0f} GB/s")
    colors = COLORS
    total = sum(p.ms for p in shown) or 1.0
    seen = set()
    for p in shown:
        label = p.kernel_class if p.kernel_class not in seen else None
        seen.add(p.kernel_class)
        ax.scatter(p.intensity, p.tflops, s=20 + 600 * p.ms / total, alpha=0.7,
                   color=colors.get(p.kernel_class, "grey"), edgecolor="black", lw=0.4,
                   label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax


def plot_breakdown(rows: list[dict], *, title: str | None = None, ax=None):
    """One stacked bar per setup: its kernel time per step by class (`breakdown_rows`'
    ``kind="class"`` rows), then its idle time (``kind="step"``), in ms; the total at
    the end. Kernel time on concurrent streams adds up, so a bar can be longer than the
    step. 9 inches wide."""
    import matplotlib.pyplot as plt

    steps = [r for r in rows if r["kind"] == "step" and "error" not in r]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(steps) + 1.8))
    colors = COLORS
    names = [r.get("label") or r["setup"] for r in steps]
    used = []
    for y, st in enumerate(steps[::-1]):
        left = 0.0
        mine = {r["kernel_class"]: r["ms"] for r in rows
                if r["kind"] == "class" and r["setup"] == st["setup"]}
        for cls in CLASSES:
            ms = mine.get(cls, 0.0)
            if ms <= 0:
                continue
            ax.barh(y, ms, left=left, color=colors[cls], edgecolor="white", lw=0.5,
                    label=cls if cls not in used else None)
            used.append(cls)
            left += ms
        ax.barh(y, st["idle_ms"], left=left, color="white", edgecolor="#555555", hatch="//",
                lw=0.5, label="idle" if "idle" not in used else None)
        used.append("idle")
        ax.text(left + st["idle_ms"], y, f"  {left + st['idle_ms']:,.0f} ms", va="center",
                fontsize=9)
    ax.set_yticks(range(len(steps)))
    ax.set_yticklabels(names[::-1], fontsize=9)
    ax.set_xlabel("ms per step (kernel time by class, then idle)")
    ax.set_xlim(0, max((sum(r["ms"] for r in rows if r["kind"] == "class"
                            and r["setup"] == st["setup"]) + st["idle_ms"])
                       for st in steps) * 1.18)
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.25),
              frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax
