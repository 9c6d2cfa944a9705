"""Profile a training step with `torch.profiler` and summarize where its time went.

`profile_steps` runs the tutorial's recipe (``schedule(wait=1, warmup=2, active=3)``) around
any `step(ids, labels)` and writes one Chrome trace that Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open; each step's data fetch runs
inside ``record_function("data")``, so a slow loader shows as a named range.

`summarize` reads the trace back and answers the tutorial's checklist:

* **GPU time by kernel class** (`kernel_classes.KERNEL_CLASSES`) and the top kernels;
* **idle gaps**: the device window minus the union of its kernels; on a GPU,
  HolisticTraceAnalysis splits them into *host wait* (a host-bound step), *kernel wait*
  and *other*;
* **data-loader stalls**: device idle time while the host was inside ``data``;
* **communication**: the part no compute kernel overlaps (*exposed*) and the rest.

On a CPU trace the "device" is the CPU: its kernels are the operators (self time), busy
time is the union of the top-level operators. Reading spans is `measure.trace`, the
roofline `measure.roofline`; their names are importable from here too.
"""


from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.profiler

from colossal_lab.measure.kernel_classes import (  # noqa: F401  (re-exported)
    CLASSES,
    COLORS,
    KERNEL_CLASSES,
    classify,
    short_name,
)
from colossal_lab.measure.roofline import (  # noqa: F401  (re-exported)
    DTYPE_BYTES,
    RooflinePoint,
    op_cost,
    plot_roofline,
    roofline_points,
)
from colossal_lab.measure.trace import (  # noqa: F401  (re-exported)
    DEVICE_CATS,
    Span,
    length,
    load_trace,
    overlap,
    self_times,
    spans,
    step_spans,
    top_level,
    union,
)

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
    tp = torch.profiler
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])

    def on_ready(prof):
        prof.export_chrome_trace(str(trace_path))

    with quiet_native_stderr(), tp.profile(
            activities=activities, record_shapes=record_shapes,
            schedule=tp.schedule(wait=schedule.wait, warmup=schedule.warmup,
                                 active=schedule.active, repeat=1),
            # one cycle (repeat=1): keeping its events changes nothing in the trace and
            # spares the warning that a later cycle would clear them
            acc_events=True, on_trace_ready=on_ready) as prof:
        for i in range(schedule.steps):
            with tp.record_function("data"):
                ids, labels = next(batches)
            step(ids, labels)
            if cuda and i == schedule.wait + schedule.warmup - 1:
                torch.cuda.synchronize()  # the GPU starts the recorded steps drained
            prof.step()
    if cuda:
        torch.cuda.synchronize()
    return trace_path


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


def summarize(trace_or_path, *, top: int = 10, use_hta: bool = True) -> ProfileSummary:
    """Read a `torch.profiler` trace (a path or a loaded dict) and summarize its active
    steps: the `ProfileSummary` fields. GPU traces are also handed to
    HolisticTraceAnalysis (`use_hta`; its result or its failure lands in `.hta`)."""
    path = None if isinstance(trace_or_path, dict) else Path(trace_or_path)
    trace = trace_or_path if path is None else load_trace(path)
    every = spans(trace)
    steps = step_spans(every)
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
    a CPU (`ProfileSummary.step_ms`). On a GPU it reads ``window_ms``, which every
    row has, not ``profiled_step_ms``, which some rows hold as the host's time."""
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
