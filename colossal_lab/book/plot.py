"""The book's shared charts. Every chapter ends on `mfu_delta`: what a switch buys."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
from matplotlib.colors import CenteredNorm
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from colossal_lab.benchmarks.checkpointing import versus_none
from colossal_lab.book.notebook import failure_note
from colossal_lab.measure import compare
from colossal_lab.palette import BLUE, GREY, ORANGE  # noqa: F401  (the book's colours)

_ERR = {"ecolor": "#333333", "elinewidth": 1.0, "capsize": 2.5}


def _spread_handle():
    return Line2D([], [], color=_ERR["ecolor"], lw=1, marker="|", ms=6,
                  label="p10–p90 of the step time")


def mfu_spread(row: dict, key: str = "mfu"):
    """[[below], [above]] error bar of `row[key]` from the p10-p90 step time (MFU is
    inversely proportional to the step time), or None when the row has no spread."""
    ms, p10, p90 = (row.get(k) for k in ("step_ms", "step_ms_p10", "step_ms_p90"))
    if not (ms and p10 and p90):
        return None
    v = row[key]
    return [[v - v * ms / p90], [v * ms / p10 - v]]


def mfu_delta(rows: list[dict], *, baseline: str | None = None, key: str = "setup",
              label: str = "label", title: str | None = None, peak_note: str | None = None,
              ax=None):
    """Horizontal bars of MFU per setup — the tutorial's 6N formula and the attention-aware
    one side by side — with tokens/s and the speed-up over `baseline` written on each,
    and the p10-p90 spread of the step time as error bars (`mfu_spread`).

    `rows`: result rows with `tokens_per_s`, `mfu`, `mfu_attn` (rows with an `error`
    are drawn as a grey "failed" line so the reader sees what did not run)."""
    rows = list(rows)
    base = next((r for r in rows if r.get(key) == baseline and "error" not in r), None)
    names = [r.get(label) or r.get(key) for r in rows]
    n = len(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * n + 1.4))
    y = range(n)[::-1]
    h = 0.38
    xmax = max([r.get("mfu_attn", 0) for r in rows if "error" not in r] + [0.05])
    for yi, r in zip(y, rows):
        if "error" in r:
            ax.text(0.002, yi, f"— {failure_note(r)}"[:70], va="center", color=GREY,
                    fontsize=9)
            continue
        first = yi == n - 1
        ax.barh(yi + h / 2, r["mfu"], h, color=BLUE, label="MFU (6N)" if first else None,
                xerr=mfu_spread(r, "mfu"), error_kw=_ERR)
        ax.barh(yi - h / 2, r["mfu_attn"], h, color=ORANGE, xerr=mfu_spread(r, "mfu_attn"),
                error_kw=_ERR, label="MFU (6N + attention)" if first else None)
        note = f"{r['mfu_attn']:.1%}  {r['tokens_per_s']:,.0f} tok/s"
        if base is not None and r is not base:  # "(level)": inside the p10-p90 spread
            note += "  " + (compare.verdict(r, base).replace("x", "×", 1)
                            if "step_ms_p10" in r and r["batch"] == base["batch"]
                            else f"×{r['tokens_per_s'] / base['tokens_per_s']:.2f}")
        spread = mfu_spread(r, "mfu_attn")  # the label starts past the whisker
        end = r["mfu_attn"] + (spread[1][0] if spread else 0.0)
        ax.text(end + xmax * 0.02, yi - h / 2, note, va="center", fontsize=9)
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=10)
    ax.set_xlim(0, xmax * 1.45)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("MFU" + (f" ({peak_note})" if peak_note else ""))
    handles = ax.get_legend_handles_labels()[0]
    if any(mfu_spread(r) for r in rows if "error" not in r):
        handles.append(_spread_handle())
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18),
              ncol=len(handles), fontsize=9, frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax


def grouped_bars(categories: list[str], series: dict[str, list[float]], *, ylabel: str,
                 title: str | None = None, ceiling: float | None = None,
                 ceiling_label: str = "measured ceiling", ax=None):
    """Bars per category for several providers (e.g. TFLOP/s per sequence length)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(categories))
    w = 0.8 / max(len(series), 1)
    for i, (name, vals) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * w, vals, w, label=name)
    if ceiling:
        ax.axhline(ceiling, color=GREY, ls="--", lw=1)
        ax.text(len(categories) - 0.5, ceiling, ceiling_label, ha="right", va="bottom",
                fontsize=9, color=GREY)
    ax.set_xticks(x)
    ax.set_xticklabels(categories)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=11)
    ax.legend(fontsize=9, frameon=False, ncol=min(len(series), 4))
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def series_style(i: int) -> dict:
    """The i-th series' colour, line style and marker: no two of the first 28 series
    share all three, and the first ten differ in colour *and* line style."""
    return {"color": COLOURS[i % len(COLOURS)], "ls": LINESTYLES[i % len(LINESTYLES)],
            "marker": MARKERS[i % len(MARKERS)]}


def tick_label(v: int) -> str:
    """A size as a tick: a multiple of 1024 as "4k" (1k, 5k, 16k), anything else as
    itself (512, 2560, 3000), so that no two ticks read alike."""
    return f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v)


def series(rows: list[dict], *, x: str, y: str, by: str = "provider", ylabel: str,
           xlabel: str | None = None, title: str | None = None, logx: bool = True,
           ceiling: float | None = None, ceiling_label: str = "measured ceiling",
           highlight: str | None = None, ax=None):
    """One line per `by` value of `y` against `x` (rows without `y` are skipped), e.g.
    TFLOP/s over sequence length per attention backend."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4))
    names = list(dict.fromkeys(r[by] for r in rows))  # style by name: stable across axes
    styles = {name: series_style(i) for i, name in enumerate(names)}
    groups: dict = {}
    for r in rows:
        if r.get(y) is not None:
            groups.setdefault(r[by], []).append((r[x], r[y]))
    for name, pts in groups.items():
        pts.sort()
        lw, z = (2.6, 3) if name == highlight else (1.4, 2)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=4, lw=lw, zorder=z,
                label=name, **styles[name])
    if ceiling:
        ax.axhline(ceiling, color=GREY, ls="--", lw=1)
        ax.text(0.99, ceiling, ceiling_label, transform=ax.get_yaxis_transform(),
                ha="right", va="bottom", fontsize=9, color=GREY)
    if logx:
        ax.set_xscale("log", base=2)
        xs = sorted({r[x] for r in rows if r.get(y) is not None})
        ax.set_xticks(xs)
        step = 1 if len(xs) <= 8 else 2  # never two labels run together
        ax.set_xticklabels([tick_label(v) if i % step == 0 else ""
                            for i, v in enumerate(xs)])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=11)
    # outside the data, right of the axes: a long legend never covers a line
    ax.legend(fontsize=8.5, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax


def chain_bases(rows: list[dict], *, key: str = "setup", peers=None,
                outside: dict[str, str] | None = None) -> list[dict | None]:
    """For each row of a waterfall, the row it is compared with, or None: ours (rows
    that are not peers: see `waterfall`) against the bar above, except a bar named in
    `outside` (bar → base bar), which is compared with its base and is not the bar
    above the next one; none for peers, below a failed bar, or for a failed row."""
    outside = outside or {}
    peer_names = None if peers is None else set(peers)
    by_name = {r.get(key): r for r in rows if "error" not in r}
    bases, prev = [], None
    for r in rows:
        name = str(r.get(key, ""))
        peer = name.startswith("hf") if peer_names is None else name in peer_names
        if peer:
            bases.append(None)
            continue
        if name in outside:
            bases.append(None if "error" in r else by_name.get(outside[name]))
            continue
        bases.append(None if "error" in r else prev)
        prev = None if "error" in r else r
    return bases


def waterfall(rows: list[dict], *, peers=None, key: str = "setup", label: str = "setup",
              title: str | None = None, capacity_gib: float | None = None,
              outside: dict[str, str] | None = None):
    """One bar of tokens/s per row, top to bottom, each row one switch more than the one
    before it (`benchmarks.waterfall`), then the peers (rows whose `key` is in `peers`;
    by default those starting with "hf"), hatched and set apart below.

    Each bar carries the p10-p90 spread of the step time as an error bar (tokens/s is
    inversely proportional to the step time, as MFU is: `mfu_spread`), its MFU (6N),
    and for ours its speed-up over the bar above (`compare.verdict`: "(level)" when the
    two lie inside each other's spread; none below a failed bar), or for a bar named in
    `outside` over its base bar (`chain_bases`). When the rows carry
    memory, a second panel draws each bar's peak (`peak_mem_gib`) and, inside it, the
    activations of one step (`activation_mem_gib`): what each switch costs or saves in
    memory; `capacity_gib` draws the device's memory as a line. Rows with an `error`
    are drawn as a grey "failed" line. Returns the axes: (tokens/s, memory) or
    (tokens/s,)."""
    rows = list(rows)
    peer_names = None if peers is None else set(peers)

    def is_peer(r: dict) -> bool:
        name = str(r.get(key, ""))
        return name.startswith("hf") if peer_names is None else name in peer_names

    ours = [r for r in rows if not is_peer(r)]
    theirs = [r for r in rows if is_peer(r)]
    gap = 0.6 if ours and theirs else 0.0
    n = len(ours) + len(theirs)
    ys = [n - 1 + gap - i for i in range(len(ours))] + \
        [len(theirs) - 1 - i for i in range(len(theirs))]
    placed = list(zip(ys, ours + theirs))
    has_mem = any(r.get("peak_mem_gib") for r in rows if "error" not in r)
    height = 0.36 * n + 1.7
    if has_mem:
        fig, axes = plt.subplots(1, 2, figsize=(9, height), sharey=True,
                                 gridspec_kw={"width_ratios": [2.3, 1]},
                                 layout="constrained")
    else:
        fig, ax0 = plt.subplots(figsize=(9, height), layout="constrained")
        axes = (ax0,)
    ax = axes[0]
    ok = [r for r in rows if "error" not in r]
    xmax = max([r["tokens_per_s"] for r in ok] + [1.0])
    base_of = {id(r): b for r, b in zip(ours + theirs, chain_bases(
        ours + theirs, key=key, peers=[str(r.get(key)) for r in theirs], outside=outside))}
    for y, r in placed:
        peer = is_peer(r)
        if "error" in r:
            ax.text(xmax * 0.01, y, f"— {failure_note(r)}"[:60], va="center",
                    color=GREY, fontsize=8)
            continue
        ax.barh(y, r["tokens_per_s"], 0.7, color=GREY if peer else BLUE,
                hatch="//" if peer else None, edgecolor="white" if peer else None,
                xerr=mfu_spread(r, "tokens_per_s"), error_kw=_ERR)
        note = f"{r['mfu']:.1%} MFU" if r.get("mfu") is not None else ""
        prev = base_of[id(r)]
        if prev is not None:
            same = (r.get("batch"), r.get("seq_len")) == (prev.get("batch"),
                                                          prev.get("seq_len"))
            if same and "step_ms_p10" in r and "step_ms_p10" in prev:
                note += "  " + compare.verdict(r, prev).replace("x", "×", 1)
            else:
                note += f"  ×{r['tokens_per_s'] / prev['tokens_per_s']:.2f}"
            if str(r.get(key)) in (outside or {}):
                note += f" vs {prev.get(key)}"
        ax.text(r["tokens_per_s"] + xmax * 0.03, y, note, va="center", fontsize=8)
    ax.set_yticks([y for y, _ in placed])
    ax.set_yticklabels([str(r.get(label) or r.get(key)) for _, r in placed], fontsize=9)
    ax.set_xlim(0, xmax * 1.5)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v / 1e3:,.0f}k" if v else "0"))
    ax.set_xlabel("tokens/s (MFU, and × the bar above)", fontsize=9)
    handles = [Patch(color=BLUE, label="ours, one switch more per bar")]
    if theirs:
        handles.append(Patch(facecolor=GREY, hatch="//", edgecolor="white",
                             label="peers"))
    if any(mfu_spread(r) for r in ok):
        handles.append(_spread_handle())
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12),
              ncol=len(handles), fontsize=8, frameon=False)
    if has_mem:
        mx = axes[1]
        mmax = max([r.get("peak_mem_gib") or 0 for r in ok] + [capacity_gib or 0, 1.0])
        named = set()  # one legend entry each
        for y, r in placed:
            if "error" in r or not r.get("peak_mem_gib"):
                continue
            mx.barh(y, r["peak_mem_gib"], 0.7,
                    color="#dddddd" if is_peer(r) else "#c9d6e8",
                    label=None if "peak" in named else "peak")
            named.add("peak")
            act = r.get("activation_mem_gib")
            if act:  # part of the peak: what one forward + backward allocates
                mx.barh(y, act, 0.34, color=ORANGE,
                        label=None if "act" in named else "activations of a step")
                named.add("act")
            mx.text(r["peak_mem_gib"] + mmax * 0.03, y, f"{r['peak_mem_gib']:.0f}",
                    va="center", fontsize=8)
        if capacity_gib:
            mx.axvline(capacity_gib, color=GREY, ls="--", lw=1, label="capacity")
        mx.set_xlim(0, mmax * 1.25)
        mx.set_xlabel("memory (GiB)", fontsize=9)
        mx.tick_params(axis="y", left=False)
        mx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, fontsize=8,
                  frameon=False)
    for a in axes:
        a.spines[["top", "right"]].set_visible(False)
        a.tick_params(axis="x", labelsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return tuple(axes)


def running_mean(values: list[float], window: int) -> list[float]:
    """The trailing mean of the last `window` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curves(rows: list[dict], *, window: int = 10, reference: str | None = None,
                key: str = "setup", title: str | None = None):
    """Training-loss curves (each row's `losses`, one per step) smoothed by a trailing
    `running_mean` of `window` steps; when `reference` names a row, a panel below draws
    each other curve's smoothed difference from it (the curves overlap: their
    differences do not). Returns the axes: (losses, differences) or (losses,)."""
    rows = [r for r in rows if r.get("losses")]
    ref = next((r for r in rows if r.get(key) == reference), None)
    if ref is not None:
        fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
    else:
        fig, ax0 = plt.subplots(figsize=(8, 4))
        axes = (ax0,)
    styles = ["-", "--", ":", "-."]  # overlapping curves stay apart
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ref_smooth = running_mean(ref["losses"], window) if ref is not None else None
    for k, r in enumerate(rows):
        smooth = running_mean(r["losses"], window)
        steps = range(1, len(smooth) + 1)
        style = dict(ls=styles[k % 4], color=colours[k % len(colours)], label=r[key])
        axes[0].plot(steps, smooth, lw=1.4, **style)
        if ref is not None and r is not ref:
            axes[1].plot(steps, [a - b for a, b in zip(smooth, ref_smooth)], lw=1.1,
                         **style)
    axes[0].set_yscale("log")
    for fmt in (axes[0].yaxis.set_major_formatter, axes[0].yaxis.set_minor_formatter):
        fmt(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[0].set_ylabel("training loss" + (f" (mean of {window} steps)" if window > 1
                                          else ""), fontsize=9)
    axes[0].legend(frameon=False, fontsize=9)
    if ref is not None:
        axes[1].axhline(0, color=GREY, lw=0.8)
        axes[1].set_ylabel(f"loss − {reference}'s", fontsize=9)
    axes[-1].set_xlabel("step")
    for a in axes:
        a.spines[["top", "right"]].set_visible(False)
    if title:
        axes[0].set_title(title, fontsize=11)
    plt.tight_layout()
    return tuple(axes)


# ---------------------------------------------------------------- attention sweep


def _layout(r: dict) -> str:
    """A speed row's head layout ("mha", "gqa4", ...), from its heads when the row
    predates the `layout` field."""
    if r.get("layout"):
        return r["layout"]
    h, kv = r["heads"], r.get("kv_heads", r["heads"])
    return "mha" if h == kv else f"gqa{h // kv}"


def _seq_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 else str(s)


_METRIC_NAMES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


def ratio_grid(panels: dict[str, list[list[tuple[float | None, str]]]],
               xlabels: list[str], ylabels: list[str], *, xlabel: str,
               colorbar_label: str, title: str | None = None, ncols: int = 2):
    """Heatmaps of ratios, one panel per entry of `panels` (panel title -> rows of
    cells, each cell `(ratio, why)`), `ncols` panels a row, sharing the axes' labels and
    one diverging colormap centred at 1.0 (blue above 1). Each cell is annotated with
    its ratio; a cell without one (ratio None) is grey and hatched and shows `why`
    ("err", "skip", "–"). Returns the axes, one per panel."""
    values = [v for g in panels.values() for line in g for v, _ in line if v is not None]
    half = max([0.25] + [abs(v - 1.0) * 1.05 for v in values])
    norm, cmap = CenteredNorm(vcenter=1.0, halfrange=half), plt.get_cmap("RdBu")
    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(9, nrows * (0.3 * len(ylabels) + 1.2)
                                                    + 0.7),
                             sharey=True, squeeze=False, layout="constrained")
    axes = tuple(ax for line in grid for ax in line)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    image = None
    for ax, (name, cells) in zip(axes, panels.items()):
        data = np.ma.masked_invalid(np.array(
            [[np.nan if v is None else v for v, _ in line] for line in cells], float)
            .reshape(len(ylabels), len(xlabels)))
        image = ax.imshow(data, cmap=cmap, norm=norm, aspect="auto")
        for i, line in enumerate(cells):
            for j, (v, why) in enumerate(line):
                if v is None:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#eeeeee",
                                           edgecolor=GREY, hatch="//", lw=0))
                    ax.text(j, i, why, ha="center", va="center", fontsize=7, color="#555555")
                else:
                    dark = abs(v - 1.0) > 0.6 * half
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")
        ax.set_xticks(range(len(xlabels)))
        ax.set_xticklabels(xlabels, fontsize=8)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_title(name, fontsize=10)
        ax.tick_params(length=0)
        ax.set_yticks(range(len(ylabels)))
        ax.set_yticklabels(ylabels, fontsize=8)
    fig.colorbar(image, ax=list(axes[:len(panels)]), shrink=0.8, pad=0.01).set_label(
        colorbar_label, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return axes[:len(panels)]


def _missing(found: list[dict], *error_fields: str) -> str:
    """What a ratio cell without a value shows: "err" when a row failed, "skip" when
    one was skipped, "–" when there is no row."""
    if any(any(f in r for f in ("error", *error_fields)) for r in found):
        return "err"
    return "skip" if any("skipped" in r for r in found) else "–"


def ratio_heatmap(rows: list[dict], numerator: str = "triton", denominator: str = "cudnn",
                  metric=("fwd", "fwd_bwd"), *, title: str | None = None):
    """`numerator` / `denominator` TFLOP/s at every point of an attention sweep
    (`benchmarks.flash_attention`): S across, (D, layout, causal) down, one panel per
    metric ("fwd", "fwd_bwd"), drawn by `ratio_grid`. A cell without both figures says
    "err" or "skip" when a provider's row says so, "–" when there is none. Returns the
    axes, one per metric."""
    metrics = (metric,) if isinstance(metric, str) else tuple(metric)
    speed = [r for r in rows if r.get("kind", "speed") == "speed" and "provider" in r]
    by = {(r["provider"], r["seq_len"], r["head_dim"], _layout(r), r["causal"]): r
          for r in speed}
    seqs = sorted({r["seq_len"] for r in speed})
    ys = sorted({(r["head_dim"], _layout(r), r["causal"]) for r in speed},
                key=lambda y: (y[0], 1 if y[1] == "mha" else int(y[1][3:]), not y[2]))

    def cell(m: str, s: int, y: tuple) -> tuple[float | None, str]:
        a, b = (by.get((p, s, *y)) for p in (numerator, denominator))
        if a and b and a.get(f"{m}_tflops") and b.get(f"{m}_tflops"):
            return a[f"{m}_tflops"] / b[f"{m}_tflops"], ""
        return None, _missing([r for r in (a, b) if r is not None], f"{m}_error")

    panels = {_METRIC_NAMES.get(m, m): [[cell(m, s, y) for s in seqs] for y in ys]
              for m in metrics}
    return ratio_grid(panels, [_seq_label(s) for s in seqs],
                      [f"D={d} {lay} {'causal' if c else 'full'}" for d, lay, c in ys],
                      xlabel="sequence length S", ncols=len(metrics),
                      colorbar_label=f"{numerator} / {denominator} TFLOP/s",
                      title=title or f"{numerator} / {denominator}: above 1 (blue) the "
                                     "first is faster")


def norm_ratio_heatmap(rows: list[dict], numerator: str = "triton",
                       denominator: str = "torch", op: str = "rms_norm", *,
                       timings=(("fwd_bwd_ms", "graph replay"),
                                ("eager_fwd_bwd_ms", "eager")),
                       title: str | None = None):
    """`denominator`'s time over `numerator`'s (above 1: the numerator faster) for
    every (tokens, hidden) of a fused-norm sweep (`benchmarks.fused_norm`): tokens
    across, hidden size down, one panel per dtype and timing in `timings` (row field,
    name) that any row has, drawn by `ratio_grid`. Returns the axes."""
    ops = [r for r in rows if r.get("kind") == "op" and r.get("op") == op]
    by = {(r["provider"], r["tokens"], r["hidden"], r.get("dtype", "bfloat16")): r
          for r in ops}
    tokens = sorted({r["tokens"] for r in ops})
    hidden = sorted({r["hidden"] for r in ops})
    dtypes = list(dict.fromkeys(r.get("dtype", "bfloat16") for r in ops))

    def cell(field: str, d: str, t: int, h: int) -> tuple[float | None, str]:
        a, b = (by.get((p, t, h, d)) for p in (numerator, denominator))
        if a and b and a.get(field) and b.get(field):
            return b[field] / a[field], ""
        return None, _missing([r for r in (a, b) if r is not None])

    panels = {f"{d}, {name}": [[cell(field, d, t, h) for t in tokens] for h in hidden]
              for d in dtypes for field, name in timings
              if any(r.get(field) for r in ops if r.get("dtype", "bfloat16") == d)}
    if not panels:
        raise ValueError(f"no {op} rows with {[f for f, _ in timings]} to compare")
    return ratio_grid(panels, [_seq_label(t) for t in tokens], [str(h) for h in hidden],
                      xlabel="tokens", colorbar_label=f"{denominator} time / "
                      f"{numerator} time", title=title or f"{op}: {denominator} time over "
                      f"{numerator}'s (above 1, blue: {numerator} faster)")


def tflops_lines(rows: list[dict], select=None, *, metric: str = "fwd_bwd",
                 providers=None, highlight: str | None = "triton", ncols: int = 3):
    """Absolute TFLOP/s (`metric`: "fwd" or "fwd_bwd") against S, one line per provider,
    for each selection in `select`: a dict of `head_dim`, `layout`, `causal` (one
    panel), or a list of them (a grid of `ncols` columns); default the canonical
    D=128 MHA causal. Colours follow the provider across panels; points without a
    figure (skipped, failed) leave a gap. Returns the axes, one per selection."""
    speed = [r for r in rows if r.get("kind", "speed") == "speed" and "provider" in r]
    sels = [select] if isinstance(select, dict) else list(select or [
        {"head_dim": 128, "layout": "mha", "causal": True}])
    names = [p for p in dict.fromkeys(r["provider"] for r in speed)
             if providers is None or p in providers]
    colours = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    ncols = min(ncols, len(sels))
    nrows = -(-len(sels) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(9, 3.0 * nrows + 1.0), squeeze=False,
                             sharey=True, layout="constrained")
    axes = [ax for line in grid for ax in line]
    for ax in axes[len(sels):]:
        ax.set_visible(False)
    key = f"{metric}_tflops"
    for ax, sel in zip(axes, sels):
        here = [r for r in speed if all((_layout(r) if k == "layout" else r.get(k)) == v
                                        for k, v in sel.items())]
        for name in names:
            pts = sorted((r["seq_len"], r[key]) for r in here
                         if r["provider"] == name and r.get(key))
            if not pts:
                continue
            lw, z = (2.6, 3) if name == highlight else (1.4, 2)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5, lw=lw,
                    zorder=z, label=name, color=colours[name])
        xs = sorted({r["seq_len"] for r in here})
        ax.set_xscale("log", base=2)
        if xs:
            ax.set_xticks(xs)
            ax.set_xticklabels([_seq_label(s) for s in xs], fontsize=8)
        ax.minorticks_off()
        ax.set_title(" ".join(f"D={v}" if k == "head_dim" else
                              (("causal" if v else "full") if k == "causal" else str(v))
                              for k, v in sel.items()), fontsize=10)
        ax.set_xlabel("sequence length S", fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
    for line in grid:
        line[0].set_ylabel(f"{_METRIC_NAMES.get(metric, metric)} TFLOP/s", fontsize=9)
    handles: dict = {}  # one legend for every panel
    for ax in axes[:len(sels)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", frameon=False,
               ncol=min(len(handles), 8), fontsize=8, bbox_to_anchor=(0.5, -0.01))
    fig.get_layout_engine().set(rect=(0, 0.07 / nrows, 1, 1 - 0.07 / nrows))
    return tuple(axes[:len(sels)])


def tradeoff(rows: list[dict], *, memory: str = "activation_mem_gib", ax=None):
    """Memory against tokens/s of a checkpointing sweep (`benchmarks.checkpointing`):
    the full-recomputation ratios joined by a line from none to full, the selective
    modes as separate squares. Every label sits beside its own marker and clear of the
    others: the ratios above and left of the rising line, the selective modes below
    and above their markers in turn, so no marker covers a label."""
    pts = [r for r in versus_none(rows) if r.get(memory) is not None]
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    line = sorted((r for r in pts if r.get("ckpt_mode") in (None, "full")),
                  key=lambda r: r["ckpt_ratio"])
    ax.plot([r["tokens_per_s"] for r in line], [r[memory] for r in line], "-o",
            color=BLUE, label="ratio 0 → 1 (full recomputation)")
    for r in line:  # the line rises to the right: above-left of a point is clear
        ax.annotate(f"ratio {r['ckpt_ratio']:g}", (r["tokens_per_s"], r[memory]),
                    textcoords="offset points", xytext=(-6, 5), ha="right",
                    fontsize=9, color=GREY)
    sel = sorted((r for r in pts if r.get("ckpt_mode") in ("selective", "elementwise")),
                 key=lambda r: r["tokens_per_s"])
    for k, r in enumerate(sel):
        ax.plot(r["tokens_per_s"], r[memory], "s", color=ORANGE, ms=8)
        below = k % 2 == 0  # neighbours alternate: below, above, below ...
        ax.annotate(r["ckpt_mode"], (r["tokens_per_s"], r[memory]),
                    textcoords="offset points", xytext=(0, -10 if below else 10),
                    ha="center", va="top" if below else "bottom", fontsize=9,
                    color=ORANGE)
    ax.plot([], [], "s", color=ORANGE, label="selective modes (every layer)")
    xs = [r["tokens_per_s"] for r in pts]
    if xs:  # room for the labels beyond the outermost points
        pad = (max(xs) - min(xs)) * 0.15 or 1.0
        ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.set_xlabel("tokens/s")
    ax.set_ylabel({"activation_mem_gib": "activation memory (GiB)",
                   "saved_mem_gib": "kept by the forward (GiB)"}.get(memory, memory))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=9, frameon=False, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    return ax
