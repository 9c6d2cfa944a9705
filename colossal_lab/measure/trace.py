"""Reading a `torch.profiler` Chrome trace: its spans, their unions, overlaps and self times."""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


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


def step_spans(all_spans: list[Span]) -> list[Span]:
    """The ``ProfilerStep#N`` ranges of a trace (one per active step), in order."""
    return sorted((s for s in all_spans if s.name.startswith("ProfilerStep#")
                   and s.cat in ("user_annotation", "cpu_op")), key=lambda s: s.ts)
