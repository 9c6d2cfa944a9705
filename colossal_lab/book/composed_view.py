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

A setup may have several rows: `bench composed --pairs N` times hf-liger and ours-bf16 N
times in turns (rows tagged `pair`). Tables and every lookup by setup see one row a setup
(`paired_rows.one_per_setup`, the rule the landing page follows too); the headline's
ratio (`headline`) is the median of the pairs' ratios (`composed.pair_ratios`), the
smallest stated beside it.

A section whose file may sit on another card's folder (the floor of `floor_view`, the
loss check of `loss_check_view`) finds it by content (`find_on_record`): the first file
on record, this machine's GPU first, then the reference GPU, then the others, that holds
what the section shows.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import matplotlib.pyplot as plt
import matplotlib.ticker

from colossal_lab.benchmarks import composed
from colossal_lab.book import plot
from colossal_lab.book.notebook import table
from colossal_lab.book.paired_rows import by_setup, one_per_setup, pairs
from colossal_lab.measure import compare, hardware, results

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
    one whose "ours-bf16" runs fp32 moments (and "best-bf16-moments" bf16). One row a
    setup (`one_per_setup`): with `--pairs`, the median pair's."""
    plain = [r for r in one_per_setup(rows) if is_plain_bf16(r, preset)]
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
    return next((r for r in one_per_setup(rows) if is_plain_bf16(r, row.get("preset"))
                 and r.get("optimizer_moments") == row.get("optimizer_moments")
                 and r is not row), None)


@dataclass(frozen=True)
class Headline:
    """The chapter's headline: ours with AdamW exact against HF + Liger."""

    ours: dict
    """The exact-optimizer row (`pick_bf16`; with pairs, the median pair's)."""
    peer: dict
    """HF + Liger's row, from the same turn as `ours` when there are pairs."""
    ratio: float
    """How many times faster ours ran: hf-liger's step time over ours' (the median of
    `pair_ratios` when there are pairs)."""
    pair_ratios: tuple[float, ...] = ()
    """Each pair's ratio, in pair order; () for a run that timed each setup once."""

    @property
    def smallest(self) -> float:
        """The smallest pair's ratio (the ratio itself without pairs)."""
        return min(self.pair_ratios) if self.pair_ratios else self.ratio


def headline(rows: list[dict]) -> Headline:
    """The headline of a composed run (the intro's and this chapter's): the median of
    the pairs' ratios when `--pairs` timed hf-liger against ours-bf16 in turns and every
    ours-bf16 turn ran the exact optimizer; otherwise hf-liger's step time over the
    exact row's, one row each (`one_per_setup`)."""
    peer = by_setup(rows)["hf-liger"]
    ours = pick_bf16(rows, peer.get("preset"))["exact"]
    if ours is None:
        raise ValueError("no row ran every switch with AdamW exact (fp32 moments)")
    done = pairs(rows)
    if done and all(is_plain_bf16(p[composed.PAIRED[1]], peer.get("preset"))
                    and p[composed.PAIRED[1]].get("optimizer_moments") == EXACT
                    for _, p, _ in done):
        ratios = tuple(q for _, _, q in done)
        return Headline(ours, peer, statistics.median(ratios), ratios)
    return Headline(ours, peer, peer["step_ms"] / ours["step_ms"])


def headline_words(h: Headline) -> str:
    """How the headline's ratio was measured, for a sentence: "" for one run of each,
    else " (the median of 3 pairs timed in turns; the smallest ×1.10)"."""
    if not h.pair_ratios:
        return ""
    return (f" (the median of {len(h.pair_ratios)} pairs timed in turns; the smallest "
            f"×{h.smallest:.2f})")


def energy_words(rows: list[dict]) -> str | None:
    """One sentence on energy per token, ours (AdamW exact) against HF + Liger, from
    their mean board power in the timed steps; None when a row has no power."""
    h = headline(rows)
    if not all(r.get("power_w") and r.get("tokens_per_s") for r in (h.ours, h.peer)):
        return None
    mj = {k: r["power_w"] / r["tokens_per_s"] * 1e3 for k, r in
          (("ours", h.ours), ("peer", h.peer))}
    limit = h.ours.get("power_limit_w")
    share = min(r["power_w"] for r in (h.ours, h.peer)) / limit if limit else None
    at = (f"Both steps draw {share:.0%} or more of the card's {limit:.0f} W power limit "
          f"(ours {h.ours['power_w']:.0f} W, HF + Liger {h.peer['power_w']:.0f} W, on "
          f"average over the timed steps): a faster step does not draw more, so"
          ) if share else "At a fixed power draw"
    return (f"{at} the energy a token "
            f"costs is what a user pays: {mj['ours']:.1f} mJ a token for ours against "
            f"{mj['peer']:.1f} for HF + Liger, which spends ×{mj['peer'] / mj['ours']:.2f} "
            f"the energy for the same tokens.")


def level_words(a: dict, b: dict) -> str:
    """`a` against `b` in words, by the p10-p90 rule (`compare.versus`): "level with"
    when each median lies inside the other's range, else "×1.04 faster than" /
    "×0.96 the speed of"."""
    c = compare.versus(a, b)
    if c.level:
        return "level with"
    return f"×{c.speedup:.2f} faster than" if c.speedup > 1 else \
        f"×{c.speedup:.2f} the speed of"


STEP_VARIANTS = (
    ("ours-bf16-compile", "compile", "each layer torch.compiled"),
    ("ours-bf16-graph", "graph", "the whole step replayed as one CUDA graph"),
    ("ours-bf16-defer", "defer", "AdamW's update run on a side stream during the next "
                                 "step's forward"),
    ("ours-fp8", "graph", "the fp8 step replayed as one CUDA graph"),
)
"""The variants of the full step that section 6 judges: (setup, kind, what it does)."""

READINGS = {
    ("compile", "faster"): "the compiler still finds element-wise glue to fuse between "
                           "our kernels",
    ("compile", "level"): "the compiler finds little left to fuse between our kernels",
    ("compile", "slower"): "the compiler finds nothing left to fuse, and the kernels it "
                           "generates run slower than ours",
    ("graph", "faster"): "replaying the step closes gaps between kernel launches that the "
                         "host left open",
    ("graph", "level"): "the GPU already runs ahead of the host for nearly the whole step, "
                        "so a graph has few launch gaps to close",
    ("graph", "slower"): "the replay costs more than the launch gaps it closes",
    ("defer", "faster"): "part of the optimizer's memory traffic hides under the next "
                         "forward",
    ("defer", "level"): "the optimizer's memory traffic does not hide under the forward "
                        "measurably",
    ("defer", "slower"): "the optimizer beside the forward slows the forward more than it "
                         "hides",
}
"""What a variant's verdict means, by kind and verdict (`compare.Comparison.verdict`)."""


def variant_peer(row: dict, rows: list[dict]) -> dict | None:
    """The step a variant is judged against: the same step without it. For the fp8
    headline (replayed as a graph), the fp8 step launched eagerly ("ours-fp8-eager"); for a
    bf16 variant, the plain bf16 row with the same AdamW moments (`same_moments_peer`)."""
    if str(row.get("setup")).startswith("ours-fp8"):
        return by_setup(rows).get("ours-fp8-eager")
    return same_moments_peer(row, rows)


def variant_sentences(rows: list[dict]) -> list[str]:
    """One sentence per variant of `STEP_VARIANTS` on record: what it does, its verdict
    against the same step without it by the p10-p90 rule, and what that verdict means
    (`READINGS`). A variant without a peer, or that failed, is left out."""
    by = by_setup(rows)
    out = []
    for name, kind, what in STEP_VARIANTS:
        r = by.get(name)
        peer = variant_peer(r, rows) if r is not None else None
        if r is None or peer is None:
            continue
        verdict = compare.versus(r, peer).verdict
        moments = (f", AdamW moments in {r['optimizer_moments']}"
                   if r.get("optimizer_moments") else "")
        out.append(f"{what[0].upper()}{what[1:]} ({name}{moments}): "
                   f"{level_words(r, peer)} {peer['setup']}, the same step without it: "
                   f"{READINGS[kind, verdict]}.")
    return out


def headline_rows(rows: list[dict]) -> list[dict]:
    """The bf16 rows of the headline figure, each with a `name` for the chart: the
    peer, ours before and after this chapter's kernels, and the two optimizers."""
    preset = next((r.get("preset") for r in rows if r.get("setup") == "hf-liger"), None)
    pick = pick_bf16(rows, preset)
    by = by_setup(rows)
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


def tokens_per_joule(row: dict) -> float | None:
    """Tokens per second per watt of mean board power in the timed steps (tokens per
    joule), or None for a row without both."""
    if "error" in row or not row.get("power_w") or not row.get("tokens_per_s"):
        return None
    return row["tokens_per_s"] / row["power_w"]


def composed_table(rows: list[dict], exact: dict | None, m16: dict | None):
    """Every row of a composed run as a `notebook.table`: throughput, MFU, memory,
    spread and the verdict against HF + Liger (same model and batch), tokens/s per watt
    (`tokens_per_joule`), the AdamW moments each row ran, one row a setup
    (`one_per_setup`); marks on the headline row, the named variant, and any other row of
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
    for r in one_per_setup(rows):
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
                    "spread": compare.spread(r) if "error" not in r else None,
                    "tokens_per_j": tokens_per_joule(r)})
    md = table(out, {"setup": None, "tokens_per_s": ",.0f", "mfu": ".1%",
                     "peak_mem_gib": ".1f", "spread": None, "vs": None,
                     "tokens_per_j": ".0f", "optimizer_moments": None},
               headers={"tokens_per_s": "tokens/s", "mfu": "MFU (6N)",
                        "peak_mem_gib": "memory (GiB)", "spread": "step p10–p90 ms (n)",
                        "vs": "vs hf-liger", "tokens_per_j": "tokens/s per W",
                        "optimizer_moments": "AdamW moments"})
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


def profile_classes(rows: list[dict], setup: str) -> dict[str, float]:
    """{kernel class: ms a step} of `setup` in a `profile_breakdown` run's rows."""
    return {r["kernel_class"]: r["ms"] for r in rows
            if r.get("kind") == "class" and r.get("setup") == setup}


def fp8_profile_words(rows: list[dict], fp8: str = "best-fp8", bf16: str = "best"
                      ) -> str | None:
    """What fp8 changes in our step, from the profiles of both (ms a step by class): the
    GEMMs, the copies and casts, and what is left outside the GEMMs, the attention and
    the optimizer (the step's floor's parts); None unless both were profiled."""
    a, b = profile_classes(rows, fp8), profile_classes(rows, bf16)
    step = {r["setup"]: r for r in rows if r.get("kind") == "step"}
    if not a or not b or fp8 not in step or bf16 not in step:
        return None
    floor_parts = ("GEMM", "attention", "optimizer")
    rest_a = sum(v for k, v in a.items() if k not in floor_parts)
    rest_b = sum(v for k, v in b.items() if k not in floor_parts)
    ga, gb = a.get("GEMM", 0.0), b.get("GEMM", 0.0)
    return (f"In fp8 our step's GEMMs take {ga:.0f} ms against {gb:.0f} in bf16 "
            f"(×{gb / ga:.2f} faster), and the copies and casts {a.get('copies/casts', 0):.0f} "
            f"ms against {b.get('copies/casts', 0):.0f}: each fp8 linear casts its input, "
            f"its weight and its output's gradient, with their scales. Outside the GEMMs, "
            f"the attention and the optimizer, the fp8 step spends {rest_a:.0f} ms and the "
            f"bf16 step {rest_b:.0f}; under the profiler the steps take "
            f"{step[fp8]['profiled_step_ms']:.0f} and {step[bf16]['profiled_step_ms']:.0f} ms.")


OPTIMIZER_PROVIDER = {EXACT: "ours-master", ROUNDED: "ours-master-m16"}
"""The `bench optimizer` row of our AdamW with fp32 masters, by the moments it keeps."""


def optimizer_ms(row: dict, opt_rows: list[dict]) -> float | None:
    """AdamW's time in a step of `row`, estimated from `bench optimizer`: the bytes a
    parameter our AdamW moves with `row`'s moments, times `row`'s parameters, at the
    rate that benchmark measured for it (GB/s); None without that row."""
    provider = OPTIMIZER_PROVIDER.get(row.get("optimizer_moments"))
    o = next((r for r in opt_rows if r.get("provider") == provider and "gbps" in r), None)
    if o is None or not row.get("n_params"):
        return None
    return row["n_params"] * o["bytes_per_param"] / (o["gbps"] * 1e9) * 1e3


def optimizer_share_words(big: dict, small: dict, opt_rows: list[dict]) -> str | None:
    """Why the full model's MFU sits below the 8-layer model's, in part: AdamW's share of
    each step (`optimizer_ms`), which grows with parameters per token."""
    a, b = optimizer_ms(big, opt_rows), optimizer_ms(small, opt_rows)
    if a is None or b is None:
        return None
    tok_a, tok_b = big["batch"] * big["seq_len"], small["batch"] * small["seq_len"]
    return (f"AdamW's update alone, at the rate `bench optimizer` measured for it, takes "
            f"about {a:.0f} ms of the full model's {big['step_ms']:.0f} ms step "
            f"({a / big['step_ms']:.0%}), against {b:.0f} ms of the 8-layer model's "
            f"{small['step_ms']:.0f} ({b / small['step_ms']:.0%}): the full model updates "
            f"{big['n_params'] / small['n_params']:.1f}× the parameters after "
            f"{tok_a / tok_b:.2g}× the tokens. That share is time without model FLOPs, "
            f"and a part of the gap between the two MFUs "
            f"({big['mfu']:.1%} against {small['mfu']:.1%}).")


def full_model_memory_words(row: dict, n_layers: int) -> str:
    """What the memory probes of a full-model row (`Setup.auto_ratio`) said, what they
    chose and how the timed run's peak compares. A row with `mem_base_gib` was fitted
    with both of the step's peaks (`memory.MemoryModel`): what the step starts from plus
    its activations as the backward starts, and the gradients at its end."""
    k, pred, peak = row["auto_ratio_ckpt_layers"], row["predicted_peak_gib"], row["peak_mem_gib"]
    held = row.get("mem_grads_held_gib")
    if row.get("mem_base_gib") is not None and held is not None:
        micro = row.get("micro_batch") or row["batch"]
        probes = (f"The batch of {row['batch']} runs as micro-batches of {micro}, "
                  f"summing their gradients. From the second on, a micro-batch starts "
                  f"with the weights, fp32 masters and moments and with the "
                  f"{held:.1f} GiB of gradients: {row['mem_base_gib']:.1f} GiB in all, "
                  f"by the probes, and the activations add "
                  f"{row['mem_per_sample_none_gib']:.1f} GiB a sequence with no layer "
                  f"checkpointed, which peak as the backward starts; at its end the "
                  f"gradients make {row['mem_fixed_gib']:.1f} GiB, plus "
                  f"{row['mem_per_sample_full_gib']:.2f} GiB a sequence with every layer "
                  f"checkpointed.")
    elif row.get("mem_base_gib") is not None:
        probes = (f"The probes put what the step starts from (weights, fp32 masters, "
                  f"moments) at {row['mem_base_gib']:.1f} GiB and the activations at "
                  f"{row['mem_per_sample_none_gib']:.1f} GiB a sequence with no layer "
                  f"checkpointed, which peak as the backward starts; at its end the "
                  f"gradients make {row['mem_fixed_gib']:.1f} GiB, plus "
                  f"{row['mem_per_sample_full_gib']:.2f} GiB a sequence with every layer "
                  f"checkpointed.")
    else:
        probes = (f"The probes put the fixed memory (weights, gradients, fp32 masters, "
                  f"moments) at {row['mem_fixed_gib']:.1f} GiB and "
                  f"{row['mem_per_sample_full_gib']:.2f} GiB a sequence with every layer "
                  f"checkpointed.")
    fit = f"a micro-batch of {row['micro_batch']}" if held is not None else "the batch"
    return (f"{probes} The fewest checkpointed layers that fit {fit} in "
            f"{row['mem_capacity_gib']:.0f} GiB: {k} of {n_layers}, predicted peak "
            f"{pred:.1f} GiB. The timed run checkpointed {row['ckpt_layers']} and peaked "
            f"at {peak:.1f} GiB ({(peak - pred) / pred:+.1%} against the prediction).")


GOALS = (("exact", "tokens/s ≥ 1.13 × hf-liger's", 1.13, "ratio", "hf-liger"),
         ("ours-fp8", "tokens/s ≥ 1.70 × hf-liger's", 1.70, "ratio", "hf-liger"),
         ("ours-fp8", "tokens/s ≥ 1.45 × hf-torchao-fp8's", 1.45, "ratio",
          "hf-torchao-fp8"),
         ("ours-7b-bf16", "MFU (6N) ≥ 55%", 0.55, "mfu", None))
"""Our goals for the composed step (definitions, not measurements): (row, what, goal,
kind, the row a ratio is against). "exact" is the headline row (`pick_bf16`); the
tutorial asks 50% MFU of LLaMA-7B. When the run timed the headline in pairs,
`PAIR_GOALS` replace the first."""
PAIR_GOALS = (("tokens/s ≥ 1.13 × hf-liger's, the median of the pairs", 1.13, "median"),
              ("tokens/s ≥ 1.05 × hf-liger's in each pair", 1.05, "smallest"))
"""The headline's goals when `--pairs` timed it in turns (definitions): (what, goal,
which statistic of the pairs' ratios)."""


def _judge(med: float, lo: float, hi: float, goal: float) -> str:
    if lo >= goal:
        return "yes"
    if hi < goal:
        return "no"
    return ("yes" if med >= goal else "no") + ": the goal lies inside the range"


def targets_table(rows: list[dict], exact: dict | None):
    """`GOALS`, each judged by its median and by the range the p10-p90 step times allow
    (a ratio's range: one setup's fastest steps against the other's slowest, and the
    reverse). With pairs (`headline`), the headline's ratio is judged by `PAIR_GOALS`
    instead: the median of the pairs' ratios and the smallest, every pair's ratio
    listed."""

    by = by_setup(rows)
    head = headline(rows) if by.get("hf-liger") is not None and exact is not None \
        else None
    out = []
    for who, what, goal, kind, against in GOALS:
        base = by.get(against) if against else None
        r = exact if who == "exact" else by.get(who)
        name = "ours, AdamW exact" if who == "exact" else who
        if who == "exact" and kind == "ratio" and head is not None and head.pair_ratios:
            listed = ", ".join(f"×{q:.2f}" for q in head.pair_ratios)
            for pwhat, pgoal, stat in PAIR_GOALS:
                v = head.ratio if stat == "median" else head.smallest
                out.append({"target": f"{name}: {pwhat}", "measured": f"×{v:.2f}",
                            "range": f"pairs: {listed}",
                            "met": "yes" if v >= pgoal else "no"})
            continue
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


# ---------------------------------------------------------------- found by content


def find_on_record(name: str, accept) -> results.Results | None:
    """The first `results/<gpu>/<name>.json` for which `accept(results)` is true, looked
    for on this machine's GPU, then the reference GPU, then every other folder present
    (alphabetically); None when none is. A section whose numbers do not depend on the
    card (a loss check), or that only one card has measured, shows what is on record
    and says which card it ran on (its caption)."""
    root = results.results_dir()
    others = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    for slug in dict.fromkeys([hardware.detect().slug, results.REFERENCE_GPU, *others]):
        if (root / slug / f"{name}.json").exists():
            res = results.load_results(name, gpu=slug)
            if accept(res):
                return res
    return None



def has_kind(kind: str):
    """An `accept` for `find_on_record`: the file holds a row of `kind`."""
    return lambda res: any(r.get("kind") == kind for r in res.rows)
