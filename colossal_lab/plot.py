"""The book's shared charts. Every chapter ends on `mfu_delta`: what a switch buys."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker

from colossal_lab import compare

BLUE, ORANGE, GREY = "#3b6ea8", "#e08a2c", "#9a9a9a"
_ERR = {"ecolor": "#333333", "elinewidth": 1.0, "capsize": 2.5}


def _spread_handle():
    from matplotlib.lines import Line2D

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
    """Horizontal bars of MFU per setup — the seed's 6N formula and the attention-aware
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
            ax.text(0.002, yi, f"failed: {r['error'][:60]}", va="center", color=GREY,
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
        ax.text(r["mfu_attn"] + xmax * 0.02, yi - h / 2, note, va="center", fontsize=9)
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
    import numpy as np

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


def series(rows: list[dict], *, x: str, y: str, by: str = "provider", ylabel: str,
           xlabel: str | None = None, title: str | None = None, logx: bool = True,
           ceiling: float | None = None, ceiling_label: str = "measured ceiling",
           highlight: str | None = None, ax=None):
    """One line per `by` value of `y` against `x` (rows without `y` are skipped), e.g.
    TFLOP/s over sequence length per attention backend."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4))
    names = list(dict.fromkeys(r[by] for r in rows))  # colour by name: stable across axes
    colours = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    groups: dict = {}
    for r in rows:
        if r.get(y) is not None:
            groups.setdefault(r[by], []).append((r[x], r[y]))
    for name, pts in groups.items():
        pts.sort()
        lw, z = (2.6, 3) if name == highlight else (1.4, 2)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5, lw=lw,
                zorder=z, label=name, color=colours[name])
    if ceiling:
        ax.axhline(ceiling, color=GREY, ls="--", lw=1)
        ax.text(0.99, ceiling, ceiling_label, transform=ax.get_yaxis_transform(),
                ha="right", va="bottom", fontsize=9, color=GREY)
    if logx:
        ax.set_xscale("log", base=2)
        xs = sorted({r[x] for r in rows if r.get(y) is not None})
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{v // 1024}k" if v >= 1024 else str(v) for v in xs])
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=11)
    ax.legend(fontsize=9, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax
