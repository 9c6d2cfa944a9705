"""The roofline of a profiled step: each operator's FLOPs, bytes and time against the ceilings.

FLOPs and bytes are counted from the shapes the profiler records (``record_shapes=True``)
for matmuls and attention, with a memory-bound estimate for the rest; time comes from
the kernels each operator launched (GPU) or the operator itself (CPU).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass

from colossal_lab.measure.kernel_classes import COLORS, classify
from colossal_lab.measure.trace import DEVICE_CATS, load_trace, self_times, spans, step_spans

DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2,
               "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
"""Bytes per element of the dtypes the profiler names in ``Input type``."""

_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$")
_SDPA = re.compile(r"^aten::(_scaled_dot_product_(flash|efficient|cudnn)_attention"
                   r"(_for_cpu)?(_backward)?|_cudnn_attention_(forward|backward))$")
"""SDPA's operators, and cuDNN's attention called directly (as our cuDNN backend does):
each takes (B, H, S, D) query, key and value, the backward after the output's gradient."""


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
    steps = step_spans(every)
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
