"""Chapter 10's helpers: which composed row is which, read from what each row ran.

A composed results file names its rows by setup, and what a setup name ran is recorded
in the row, not fixed by the name: a file may hold "ours-bf16" with AdamW's moments in
bf16 and "ours-bf16-m32" with them in fp32, another "ours-bf16" with fp32 moments and
"best-bf16-moments" with bf16 ones. So the chapter never looks a row up by its name
alone: `pick_bf16` finds the exact-optimizer row (AdamW's moments in fp32, the update
`torch.optim.AdamW` computes) and the bf16-moments row by what they recorded (precision,
AdamW's moments, the optimizer deferred or not, the step compiled or not). The figures
and tables the chapter draws itself live here too, so a visible cell stays one line of
intent.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker

from colossal_lab.benchmarks import composed
from colossal_lab.book import plot
from colossal_lab.book.notebook import table
from colossal_lab.measure import compare

EXACT = "fp32"
"""AdamW's moments in the exact optimizer (what `torch.optim.AdamW` keeps)."""
ROUNDED = "bf16"
"""AdamW's moments in the named variant (`best-bf16-moments`): stochastically rounded."""

NAMES = {"exact": "ours, every switch", "bf16_moments": "ours, bf16 moments",
         "hf-liger": "HF + Liger", "ours-bf16-s123": "ours, switches 1–3",
         "ours-bf16-autocast": "ours, every kernel, autocast",
         "hf-torchao-fp8": "HF + torchao fp8", "ours-fp8": "ours, fp8 linears",
         "ours-7b-bf16": "ours, full LLaMA-7B"}
"""What the chapter calls each row (keys: `pick_bf16`'s roles, or setup names)."""


def _setup_switches(name: str):
    """The library's `Switches` for a composed setup name, or None (an old row name)."""

    return next((s.switches for s in composed.SETUPS if s.name == name), None)


def is_plain_bf16(row: dict, preset: str | None = None) -> bool:
    """A composed row that ran every switch with bf16 parameters and fp32 masters, in
    eager mode: not compiled, not replayed as a graph, its optimizer not deferred, on
    `preset` when given. (Whether a row was compiled is not in the row: the setup's
    switches in `benchmarks.composed` say so; an unknown name counts as eager.)"""
    if "error" in row or row.get("precision") != "bf16-pure":
        return False
    if preset is not None and row.get("preset") != preset:
        return False
    if row.get("optimizer_deferred"):
        return False
    sw = _setup_switches(str(row.get("setup")))
    return sw is None or (not sw.enable_compile and not sw.extra.get("adamw_defer"))


def pick_bf16(rows: list[dict], preset: str | None = None) -> dict[str, dict | None]:
    """{"exact": the row with AdamW's moments in fp32, "bf16_moments": the row with them
    in bf16}: the plain bf16 rows (`is_plain_bf16`) of `preset`, told apart by the
    `optimizer_moments` each recorded. Either is None when the file has no such row.
    Works for a file whose "ours-bf16" ran bf16 moments (and "ours-bf16-m32" fp32) and for
    one whose "ours-bf16" runs fp32 moments (and "best-bf16-moments" bf16)."""
    plain = [r for r in rows if is_plain_bf16(r, preset)]
    out: dict[str, dict | None] = {}
    for role, moments in (("exact", EXACT), ("bf16_moments", ROUNDED)):
        hits = [r for r in plain if r.get("optimizer_moments") == moments]
        # two candidates: prefer the one whose name `benchmarks.composed` defines
        hits.sort(key=lambda r: _setup_switches(str(r["setup"])) is None)
        out[role] = hits[0] if hits else None
    return out


def same_moments_peer(row: dict, rows: list[dict]) -> dict | None:
    """The plain bf16 row (`is_plain_bf16`) whose AdamW moments match `row`'s: what a
    compiled, graph-replayed or deferred variant is fairly compared with."""
    return next((r for r in rows if is_plain_bf16(r, row.get("preset"))
                 and r.get("optimizer_moments") == row.get("optimizer_moments")
                 and r is not row), None)


def level_words(a: dict, b: dict) -> str:
    """`a` against `b` in words, by the p10-p90 rule (`compare.versus`): "level with"
    when each median lies inside the other's range, else "×1.04 faster than" /
    "×0.96 the speed of"."""
    c = compare.versus(a, b)
    if c.level:
        return "level with"
    return f"×{c.speedup:.2f} faster than" if c.speedup > 1 else \
        f"×{c.speedup:.2f} the speed of"


def headline_rows(rows: list[dict]) -> list[dict]:
    """The bf16 rows of the headline figure, each with a `name` for the chart: the
    peer, ours before and after this chapter's kernels, and the two optimizers."""
    preset = next((r.get("preset") for r in rows if r.get("setup") == "hf-liger"), None)
    pick = pick_bf16(rows, preset)
    by = {r["setup"]: r for r in rows if "error" not in r}
    out = []
    for key in ("hf-liger", "ours-bf16-s123", "ours-bf16-autocast"):
        if key in by:
            out.append({**by[key], "name": NAMES[key]})
    for role in ("exact", "bf16_moments"):
        if pick[role] is not None:
            out.append({**pick[role], "name": NAMES[role]})
    return out


def headline_figure(rows: list[dict], title: str):
    """MFU of the bf16 rows (`headline_rows`) against HF + Liger, short names on the
    axis: `plot.mfu_delta`, whose axis then spans the bars' range."""
    shown = headline_rows(rows)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(shown) + 1.4))
    plot.mfu_delta(shown, baseline="hf-liger", label="name", ax=ax,
                   peak_note="vs the dense bf16 peak", title=title)
    return fig


def regime_figure(base: dict, autocast: dict, exact: dict, title: str):
    """Two steps side by side: HF + Liger → ours in the same regime (fp32 weights under
    bf16 autocast: kernels alone), then → bf16 parameters with fp32 masters (switch 6's
    regime). Left: tokens/s with the p10-p90 spread and the ratio to the bar before;
    right: peak memory."""
    steps = [(NAMES["hf-liger"] + "\n(fp32 weights, autocast)", base),
             ("ours, every kernel\n(fp32 weights, autocast)", autocast),
             ("ours, every switch\n(bf16 weights, fp32 masters)", exact)]
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(9, 2.9), sharey=True,
                                 gridspec_kw={"width_ratios": [2, 1]},
                                 layout="constrained")
    ys = list(range(len(steps)))[::-1]
    xmax = max(r["tokens_per_s"] for _, r in steps)
    prev = None
    for y, (_, r) in zip(ys, steps):
        colour = plot.GREY if r is base else plot.BLUE
        ax.barh(y, r["tokens_per_s"], 0.6, color=colour, hatch="//" if r is base else None,
                edgecolor="white" if r is base else None,
                xerr=plot.mfu_spread(r, "tokens_per_s"), error_kw=plot._ERR)
        note = f"{r['mfu']:.1%} MFU"
        if prev is not None:
            note += "  " + compare.verdict(r, prev).replace("x", "×", 1) + " the bar above"
        ax.text(r["tokens_per_s"] + xmax * 0.03, y, note, va="center", fontsize=8)
        mx.barh(y, r["peak_mem_gib"], 0.6, color="#dddddd" if r is base else "#c9d6e8")
        mx.text(r["peak_mem_gib"] * 1.03, y, f"{r['peak_mem_gib']:.1f}", va="center",
                fontsize=8)
        prev = r
    ax.set_yticks(ys)
    ax.set_yticklabels([n for n, _ in steps], fontsize=8)
    ax.set_xlim(0, xmax * 1.6)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v / 1e3:,.0f}k" if v else "0"))
    ax.set_xlabel("tokens/s (MFU, × the bar above)", fontsize=9)
    mx.set_xlim(0, max(r["peak_mem_gib"] for _, r in steps) * 1.3)
    mx.set_xlabel("peak memory (GiB)", fontsize=9)
    mx.tick_params(axis="y", left=False)
    for a in (ax, mx):
        a.spines[["top", "right"]].set_visible(False)
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def composed_table(rows: list[dict], exact: dict | None, m16: dict | None):
    """Every row of a composed run as a `notebook.table`: throughput, MFU, memory,
    spread and the verdict against HF + Liger (same model and batch), the AdamW moments
    each row ran; marks on the headline row, the named variant, and any other row of
    ours that ran AdamW's moments in bf16, explained under the table. A failed row shows
    "—" with the table's own footnote."""
    from IPython.display import Markdown


    base = next((r for r in rows if r.get("setup") == "hf-liger" and "error" not in r),
                None)
    notes = {"ᵃ": "the headline: every switch, AdamW exact (its moments in fp32)",
             "ᵇ": "the named variant `best-bf16-moments`: AdamW's moments in bf16",
             "ᶜ": "ran AdamW's moments in bf16, the named variant's optimizer: its time "
                  "and memory are not those of the exact optimizer"}
    used, out = [], []
    for r in rows:
        mark = ("ᵃ" if r is exact else "ᵇ" if r is m16 else
                "ᶜ" if (r.get("optimizer_moments") == ROUNDED and "error" not in r
                        and not str(r.get("setup", "")).startswith("hf")) else "")
        if mark and mark not in used:
            used.append(mark)
        vs = None
        if base is not None and r is not base and "error" not in r:
            vs = (compare.verdict(r, base).replace("x", "×", 1)
                  if (r["preset"], r["batch"]) == (base["preset"], base["batch"])
                  else "other model")
        out.append({**r, "setup": f"{r.get('setup')}{mark}", "vs": vs,
                    "spread": compare.spread(r) if "error" not in r else None})
    md = table(out, {"setup": None, "tokens_per_s": ",.0f", "mfu": ".1%",
                     "peak_mem_gib": ".1f", "spread": None, "vs": None,
                     "optimizer_moments": None},
               headers={"tokens_per_s": "tokens/s", "mfu": "MFU (6N)",
                        "peak_mem_gib": "memory (GiB)", "spread": "step p10–p90 ms (n)",
                        "vs": "vs hf-liger", "optimizer_moments": "AdamW moments"})
    extra = "".join(f"\n{m} {notes[m]}.  " for m in sorted(used))
    return Markdown(md.data + ("\n" + extra if extra else ""))


def profile_table(rows: list[dict], ours: str = "best", theirs: str = "hf-liger"):
    """Milliseconds per step by kernel class, ours against theirs, from a
    `profile_breakdown` run's rows, then all kernels, idle time and the profiled step."""

    per_class: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("kind") == "class" and r["setup"] in (ours, theirs):
            per_class.setdefault(r["kernel_class"], {})[r["setup"]] = r["ms"]
    out = [{"kernel_class": c, "ours": v.get(ours, 0.0), "theirs": v.get(theirs, 0.0),
            "diff": v.get(ours, 0.0) - v.get(theirs, 0.0)}
           for c, v in sorted(per_class.items(), key=lambda kv: -max(kv[1].values()))]
    step = {r["setup"]: r for r in rows if r.get("kind") == "step"}
    for what, k in (("kernels, all", "busy_ms"), ("idle", "idle_ms"),
                    ("step, profiled", "profiled_step_ms")):
        a, b = step[ours][k], step[theirs][k]
        out.append({"kernel_class": f"*{what}*", "ours": a, "theirs": b, "diff": a - b})
    return table(out, {"kernel_class": None, "ours": ".1f", "theirs": ".1f",
                       "diff": "+.1f"},
                 headers={"kernel_class": "kernel class", "ours": f"{ours} (ms/step)",
                          "theirs": f"{theirs} (ms/step)", "diff": f"{ours} − {theirs}"})


GOALS = (("exact", "tokens/s ≥ 1.15 × hf-liger's", 1.15, "ratio"),
         ("exact", "MFU (6N) ≥ 60%", 0.60, "mfu"),
         ("ours-fp8", "tokens/s ≥ 1.5 × hf-liger's", 1.5, "ratio"),
         ("ours-7b-bf16", "MFU (6N) ≥ 50%", 0.50, "mfu"))
"""Our goals for the composed step (definitions, not measurements): (row, what, goal,
kind). "exact" is the headline row (`pick_bf16`); the tutorial's 50% is for LLaMA-7B."""


def _judge(med: float, lo: float, hi: float, goal: float) -> str:
    if lo >= goal:
        return "yes"
    if hi < goal:
        return "no"
    return ("yes" if med >= goal else "no") + ": the goal lies inside the range"


def targets_table(rows: list[dict], exact: dict | None):
    """`GOALS`, each judged by its median and by the range the p10-p90 step times allow
    (a ratio's range: one setup's fastest steps against the other's slowest, and the
    reverse)."""

    by = {r["setup"]: r for r in rows if "error" not in r}
    base = by.get("hf-liger")
    out = []
    for who, what, goal, kind in GOALS:
        r = exact if who == "exact" else by.get(who)
        name = "ours, AdamW exact" if who == "exact" else who
        row = {"target": f"{name}: {what}"}
        if r is not None and r is not exact and r.get("optimizer_moments") == ROUNDED:
            row["target"] += " (ran bf16 moments)"
        if r is not None and (kind == "mfu" or base is not None):
            if kind == "ratio":
                med = base["step_ms"] / r["step_ms"]
                lo = base["step_ms_p10"] / r["step_ms_p90"]
                hi = base["step_ms_p90"] / r["step_ms_p10"]
                fmt = "×{:.2f}".format
            else:
                med = r["mfu"]
                lo = r["mfu"] * r["step_ms"] / r["step_ms_p90"]
                hi = r["mfu"] * r["step_ms"] / r["step_ms_p10"]
                fmt = "{:.1%}".format
            row.update(measured=fmt(med), range=f"{fmt(lo)} – {fmt(hi)}",
                       met=_judge(med, lo, hi, goal))
        out.append(row)
    return table(out, {"target": None, "measured": None, "range": None, "met": None},
                 headers={"measured": "measured (median)", "range": "p10–p90 range",
                          "met": "met?"})


def curve_name(row: dict) -> str:
    """A loss curve's name by what it ran: the naive and s123 runs keep theirs; the
    compositions say their precision and AdamW's moments."""
    setup = str(row.get("setup"))
    prec, moments = row.get("precision"), row.get("optimizer_moments")
    if prec == "bf16-pure":
        return "every switch, AdamW exact" if moments == EXACT else \
            f"every switch, {moments} moments"
    if prec in ("fp8", "fp8-pure"):
        return "every switch, fp8" + (f", {moments} moments" if moments != EXACT else "")
    return setup


def loss_verdicts(curves: list[dict], reference: str = "naive") -> list[str]:
    """Sentences: the noise (the largest distance of another seed's naive run to
    `reference`), then each composition's distance to it, within the noise or not. A
    curve with AdamW's moments in bf16 is listed, not judged: that change of numerics
    is checked on a larger model."""
    by = {r["setup"]: r for r in curves if "error" not in r}
    ref = by.get(reference)
    seeds = [r for name, r in by.items() if name.startswith(f"{reference}-seed")]
    if ref is None or not seeds:
        return [f"No {reference} run with other seeds: no noise to judge against."]
    what = {"final_loss": "final loss", "val_loss": "validation loss"}
    noise = {k: max(abs(s[k] - ref[k]) for s in seeds) for k in what
             if ref.get(k) is not None and all(s.get(k) is not None for s in seeds)}
    out = [f"The noise, the largest |{reference}-seedN − {reference}| over {len(seeds)} "
           f"other seeds: " + ", ".join(f"{what[k]} {v:.4f}" for k, v in noise.items())
           + "."]
    for name, r in by.items():
        if name == reference or name.startswith(f"{reference}-seed"):
            continue
        if r.get("optimizer_moments") == ROUNDED:
            out.append(f"{name}: AdamW's moments in bf16, a change of numerics whose loss "
                       f"check on a 325M-parameter model is being run; not judged here.")
            continue
        parts = [f"{what[k]} {abs(r[k] - ref[k]):.4f}, "
                 f"{'within' if abs(r[k] - ref[k]) <= band else 'outside'} the noise"
                 for k, band in noise.items()]
        out.append(f"|{name} − {reference}|: {'; '.join(parts)}.")
    return out
