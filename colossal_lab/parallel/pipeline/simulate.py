"""Time a pipeline schedule: per-rank timeline, bubble, makespan, peak memory; plots.

**Model.** Each rank runs its compute actions in its program's order, each as early as
its inputs allow: an action starts at ``max(rank free, inputs ready)``, where an input
made on another rank is ready `comm` after its producer ends. Transfers run beside the
compute (asynchronous p2p, what ``overlap_p2p`` buys) and cost only their latency; the
blocking behaviour is `validate`'s business, not the clock's.

**Costs.** ``f``, ``b``, ``w``: times of the forward, the input-gradient backward and the
weight-gradient backward of **one micro-batch through one rank's share of the model**
(the layers a rank holds in 1F1B). A chunk of a v-chunk schedule (interleaved, ZB-V)
holds 1/v of those layers and takes 1/v of the time. Where B is the full backward
(GPipe, 1F1B, interleaved), it takes ``b + w``. So F = B = W = 1 means a full backward
of 2F, the usual "backward costs twice the forward" (two GEMMs per forward GEMM). Give a
sequence instead of a number for per-stage times: one value per virtual stage, the time
of that stage's action (no 1/v applied).

**Bubble.** `Timeline.bubble` is idle time over total time, summed over ranks:
``1 − Σ busy / (p · makespan)``. For 1F1B with uniform costs and no latency every rank
idles (p − 1)(F + B) in a makespan of (m + p − 1)(F + B), so the bubble is
(p − 1)/(m + p − 1). The other common figure, (p − 1)/m (Narayanan et al. 2021's
"bubble time fraction", and the tutorial's), divides the same idle time by the *useful*
time m(F + B) instead: how much longer than ideal the step takes. `bubble_arithmetic`
computes both, and the simulator's measurement of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from colossal_lab.palette import GREY
from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.schedules import B, F, Schedule, ScheduleError, W
from colossal_lab.parallel.pipeline.validate import check_dependencies, peak_activations

KIND_COLOURS = {F: "#3b6ea8", B: "#e08a2c", W: "#4c9a5b"}
"""F blue, B orange, W green (the blue and orange of `colossal_lab.book.plot`)."""


@dataclass(frozen=True)
class Span:
    """One action on the clock."""

    rank: int
    action: sch.Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What `simulate` returns."""

    schedule: Schedule
    spans: tuple[tuple[Span, ...], ...]
    """Per rank, its compute actions with start and end times, in program order."""
    costs: dict = field(compare=False)
    """The f, b, w, comm the timeline was computed with."""
    peak_activations: tuple[float, ...]
    """Per rank, in micro-batches of one rank's share of the model (`validate`'s
    `activation_profile`, with the `w_stash` given to `simulate`)."""

    @property
    def makespan(self) -> float:
        return max((sp.end for row in self.spans for sp in row), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(sp.end - sp.start for sp in row) for row in self.spans)

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank, the time within [0, makespan] it computes nothing."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> float:
        """Idle over total time: 1 − Σ busy / (p · makespan)."""
        t = self.makespan
        return 1.0 - sum(self.busy) / (len(self.spans) * t) if t else 0.0

    @property
    def bubble_over_useful(self) -> float:
        """Idle over useful time, Σ idle / Σ busy: the (p − 1)/m kind of figure."""
        return sum(self.idle) / sum(self.busy)

    def summary(self) -> str:
        s = self.schedule
        return (f"{s.name}: p={s.num_ranks}, m={s.num_microbatches}, makespan "
                f"{self.makespan:g}, bubble {self.bubble:.1%} of the step "
                f"({self.bubble_over_useful:.1%} of the useful time), peak activations "
                f"{max(self.peak_activations):g} micro-batches (rank "
                f"{self.peak_activations.index(max(self.peak_activations))})")


def _cost(value, name: str, s: Schedule) -> list[float]:
    """stage -> time, from a number per rank-share (divided by the chunks per rank) or
    a sequence with one time per virtual stage."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != s.num_stages:
            raise ValueError(f"{name} has {len(value)} entries; give one number, or one "
                             f"per virtual stage ({s.num_stages})")
        vals = [float(x) for x in value]
    else:
        vals = [float(value) / s.chunks] * s.num_stages
    if any(x < 0 for x in vals):
        raise ValueError(f"{name}={value} must be >= 0")
    return vals


def simulate(schedule: Schedule, f=1.0, b=1.0, w=1.0, comm: float = 0.0,
             w_stash: float = 1.0) -> Timeline:
    """The timeline of `schedule` under costs `f`, `b`, `w` (numbers per rank-share of
    the model, or one per virtual stage) and p2p latency `comm` (see the module
    docstring). Raises `ScheduleError` when the order contradicts the dependencies."""
    s = schedule.compute_only()
    if comm < 0:
        raise ValueError(f"comm={comm} must be >= 0")
    fs, bs, ws = _cost(f, "f", s), _cost(b, "b", s), _cost(w, "w", s)
    if s.split_backward:
        dur = {F: fs, B: bs, W: ws}
    else:  # B is the full backward
        dur = {F: fs, B: [x + y for x, y in zip(bs, ws)]}
    check_dependencies(s)
    played = sch.play(s, lambda a: dur[a.kind][a.stage], comm)
    rows = [[Span(r, a, start, end) for a, start, end in row]
            for r, row in enumerate(played.spans)]
    return Timeline(schedule, tuple(tuple(r) for r in rows),
                    {"f": f, "b": b, "w": w, "comm": comm, "w_stash": w_stash},
                    peak_activations(s, w_stash))


# ------------------------------------------------------------------ the tutorial's arithmetic


def bubble_arithmetic(p: int = 4, m: int = 8) -> dict:
    """The tutorial says 1F1B wastes "(p − 1)/m, ~37.5% at pp=4, m=8"; the usual bubble
    fraction is (p − 1)/(m + p − 1). Both, and the simulator's measurement of each for
    1F1B with F = B = W = 1 (a full backward of 2F), no latency.

    The two formulas share a numerator, the idle time per rank (p − 1)(F + B); they
    differ in the denominator: (p − 1)/(m + p − 1) divides by the step time (the share
    of the step the GPUs idle), (p − 1)/m by the ideal, bubble-free time m(F + B) (how
    much longer the step takes than it would without a bubble)."""
    tl = simulate(sch.one_f_one_b(p, m), f=1.0, b=1.0, w=1.0)
    return {
        "p": p, "m": m,
        "seed_formula": (p - 1) / m,
        "idle_over_total": (p - 1) / (m + p - 1),
        "simulated_idle_over_total": tl.bubble,
        "simulated_idle_over_useful": tl.bubble_over_useful,
        "makespan": tl.makespan,
        "ideal": m * 3.0,
        "meaning": (f"1F1B at p={p}, m={m}: the GPUs idle {(p - 1) / (m + p - 1):.1%} of "
                    f"the step ((p−1)/(m+p−1)); the step takes {(p - 1) / m:.1%} longer "
                    f"than bubble-free ((p−1)/m, the tutorial's figure: idle over useful "
                    f"time, not the share of time wasted)"),
    }


# ---------------------------------------------------------------------------- plots


def _shade(colour: str, chunk: int) -> str:
    """Later chunks lighter: mix with white."""
    if chunk == 0:
        return colour
    r, g, b_ = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    k = 0.45
    return "#" + "".join(f"{int(c + (255 - c) * k):02x}" for c in (r, g, b_))


def plot_gantt(timeline: Timeline, ax=None, *, title: str | None = None, legend: bool = True,
               xmax: float | None = None):
    """One row per rank (rank 0 on top), F blue, B orange, W green, later chunks lighter
    (and hatched), micro-batch numbers written where they fit."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = timeline.schedule
    p = s.num_ranks
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.42 * p + 1.5))
    total = xmax or timeline.makespan or 1.0
    width_px = ax.get_window_extent().width  # to decide where a number fits
    for row in timeline.spans:
        for sp in row:
            a = sp.action
            chunk = s.chunk_of(a.stage)
            ax.barh(p - 1 - sp.rank, sp.end - sp.start, left=sp.start, height=0.8,
                    color=_shade(KIND_COLOURS[a.kind], chunk), edgecolor="white", lw=0.5,
                    hatch="///" if chunk else None)
            if (sp.end - sp.start) / total * width_px >= 4 + 5 * len(str(a.mb)):
                ax.text((sp.start + sp.end) / 2, p - 1 - sp.rank, str(a.mb), ha="center",
                        va="center", fontsize=7, color="white" if chunk == 0 else "black")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)][::-1], fontsize=9)
    ax.set_xlim(0, total)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlabel("time (units of the costs)")
    ax.set_title(title or f"{s.name}, p={p}, m={s.num_microbatches}: bubble "
                 f"{timeline.bubble:.1%}, makespan {timeline.makespan:g}, peak "
                 f"{max(timeline.peak_activations):g} micro-batches", fontsize=10)
    if legend:
        names = {F: "F", B: "B (input grad)" if s.split_backward else "B (full backward)",
                 W: "W (weight grad)"}
        kinds = (F, B, W) if s.split_backward else (F, B)
        handles = [Patch(color=KIND_COLOURS[k], label=names[k]) for k in kinds]
        if s.chunks > 1:
            handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///",
                                 label="chunk ≥ 1 (lighter)"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28),
                  ncol=len(handles), fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def _all(p: int, m: int, chunks: int = 2) -> dict[str, Schedule]:
    """Every schedule that exists for (p, m): interleaved only when m % p == 0."""
    out = {}
    for name in sch.SCHEDULES:
        try:
            out[name] = sch.make(name, p, m, chunks)
        except ValueError:
            continue
    return out


def plot_gallery(p: int = 4, m: int = 8, f: float = 1.0, b: float = 1.0, w: float = 1.0,
                 comm: float = 0.0):
    """The explorer's static figure: every schedule's Gantt for one (p, m) and costs, on
    one time axis."""
    import matplotlib.pyplot as plt

    tls = {n: simulate(s, f, b, w, comm) for n, s in _all(p, m).items()}
    xmax = max(t.makespan for t in tls.values())
    fig, axes = plt.subplots(len(tls), 1, figsize=(9, (0.3 * p + 0.75) * len(tls) + 0.6),
                             sharex=True)
    for i, (ax, (name, tl)) in enumerate(zip(axes, tls.items())):
        ax.set_xlim(0, xmax)
        plot_gantt(tl, ax, xmax=xmax, legend=False,
                   title=f"{name}: bubble {tl.bubble:.1%}, makespan {tl.makespan:g}, peak "
                         f"{max(tl.peak_activations):g}")
        if i < len(tls) - 1:
            ax.set_xlabel("")
    from matplotlib.patches import Patch

    handles = [Patch(color=KIND_COLOURS[F], label="F"),
               Patch(color=KIND_COLOURS[B], label="B (zb: input grad; else full backward)"),
               Patch(color=KIND_COLOURS[W], label="W"),
               Patch(facecolor="white", edgecolor="grey", hatch="///",
                     label="chunk 1 (lighter)")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"p={p}, m={m}, F:B:W = {f:g}:{b:g}:{w:g}, latency {comm:g}", fontsize=11)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def bubble_table(p: int = 4, ms: Sequence[int] = range(4, 33), f: float = 1.0,
                 b: float = 1.0, w: float = 1.0, comm: float = 0.0,
                 chunks: int = 2) -> list[dict]:
    """Rows (schedule, p, m, bubble, makespan, peak_activations) for every schedule that
    exists at each m."""
    rows = []
    for m in ms:
        for name, s in _all(p, m, chunks).items():
            tl = simulate(s, f, b, w, comm)
            rows.append({"schedule": name, "p": p, "m": m, "bubble": tl.bubble,
                         "makespan": tl.makespan,
                         "peak_activations": max(tl.peak_activations)})
    return rows


def plot_bubbles(p: int = 4, ms: Sequence[int] = range(4, 33), f: float = 1.0,
                 b: float = 1.0, w: float = 1.0, comm: float = 0.0, ax=None):
    """Simulated bubble (idle over total time) against m for every schedule at `p`,
    with 1F1B's closed form (p − 1)/(m + p − 1) and the tutorial's (p − 1)/m dashed."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = bubble_table(p, ms, f, b, w, comm)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.2))
    for name in sch.SCHEDULES:
        pts = [(r["m"], r["bubble"]) for r in rows if r["schedule"].startswith(name)]
        if pts:
            label = {"interleaved": "interleaved-2", "gpipe": "gpipe (= 1f1b)"}.get(name, name)
            ax.plot(*zip(*pts), marker="o", ms=3, lw=1.5, label=label)
    ms = sorted({r["m"] for r in rows})
    ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], ls="--", color="black", lw=0.9,
            label="(p−1)/(m+p−1)")
    ax.plot(ms, [(p - 1) / m for m in ms], ls=":", color=GREY, lw=1.2,
            label="seed's (p−1)/m (idle / useful)")
    ax.set_ylim(0, min(1.0, (p - 1) / min(ms) * 1.05))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle / total time)")
    ax.set_title(f"p = {p}, F:B:W = {f:g}:{b:g}:{w:g}, latency {comm:g}", fontsize=11)
    ax.legend(fontsize=9, frameon=False, ncol=2)
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax


def explorer(p: int = 4, m: int = 8, schedule: str = "zbv", ratio=(1.0, 1.0, 1.0)):
    """An ipywidgets explorer: pick the schedule, p, m, chunks (interleaved), the
    F:B:W ratio and the p2p latency; the Gantt chart and the numbers follow. Needs
    ipywidgets and a live kernel (the book shows `plot_gallery` and `plot_bubbles`)."""
    import ipywidgets as wd
    import matplotlib.pyplot as plt

    name = wd.Dropdown(options=list(sch.SCHEDULES), value=schedule, description="schedule")
    ps = wd.IntSlider(value=p, min=1, max=8, description="p (ranks)")
    mbs = wd.IntSlider(value=m, min=1, max=32, description="m (micro)")
    ch = wd.IntSlider(value=2, min=2, max=4, description="chunks")
    fs, bs, ws = (wd.FloatSlider(value=v, min=0.25, max=3.0, step=0.05, description=d)
                  for v, d in zip(ratio, ("F", "B", "W")))
    lat = wd.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.05, description="latency")
    text, out = wd.HTML(), wd.Output()

    def update(*_):
        out.clear_output(wait=True)
        try:
            s = sch.make(name.value, ps.value, mbs.value, ch.value)
            tl = simulate(s, fs.value, bs.value, ws.value, lat.value)
        except (ValueError, ScheduleError) as e:
            text.value = f"<b>{e}</b>"
            return
        text.value = tl.summary()
        with out:
            plot_gantt(tl)
            plt.show()

    for c in (name, ps, mbs, ch, fs, bs, ws, lat):
        c.observe(update, names="value")
    update()
    return wd.VBox([wd.HBox([name, ch]), wd.HBox([ps, mbs]), wd.HBox([fs, bs, ws]), lat,
                    text, out])
