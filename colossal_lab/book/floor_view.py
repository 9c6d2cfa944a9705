"""Chapter 10's floor of a training step (section 7): what the step could not go below.

`benchmarks.step_floor` measures, on one card, the step's GEMMs replayed back to back at
the rate the tensor cores sustain at the power limit, its attention, and AdamW's bytes
at the copy ceiling; their sum is the floor. Beside it, in the same run, the measured
steps of ours and of the peer of the same precision (HF + Liger for bf16, HF + torchao
for fp8). The figure stacks the floor's parts and sets each step under them, so what is
left over the floor (casts, norms, element-wise kernels, launch gaps) is the gap a
reader sees; the table gives each row's SM clock and power, since the GEMMs run at the
card's power limit and a step's clock says how hard it pushed against it.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from colossal_lab.benchmarks import step_floor
from colossal_lab.book import plot
from colossal_lab.book.composed_view import NAMES, find_on_record, has_kind
from colossal_lab.book.notebook import MARKS, failure_note, table
from colossal_lab.measure import compare, results
from colossal_lab.precision import policy


def floor_on_record() -> results.Results | None:
    """The step floor on record (`find_on_record`): the first step_floor file that holds
    floor rows."""
    return find_on_record(step_floor.NAME, has_kind("floor"))



PART_NAMES = {"gemm": "GEMMs", "attention": "attention", "optimizer": "optimizer"}
"""The floor's parts, in the order they stack."""
PART_COLOURS = {"gemm": "#8172b3", "attention": "#dd8452", "optimizer": "#55a868"}
"""The parts' colours: apart from the blue of our measured steps."""


def step_precision(row: dict) -> str:
    """The floor a step row is measured against ("bf16" or "fp8"): fp8 when its linears
    ran fp8 (its `fp8_backend` or precision says so); a failed row by its setup's
    definition in `step_floor.STEP_SETUPS`."""
    if row.get("fp8_backend") or str(row.get("precision", "")).startswith("fp8"):
        return "fp8"
    if "error" in row:
        s = next((s for s in step_floor.STEP_SETUPS if s.name == row.get("setup")), None)
        if s is not None and (s.torchao_fp8 or policy(s.switches.precision).fp8):
            return "fp8"
    return "bf16"


def _is_ours(row: dict) -> bool:
    s = next((s for s in step_floor.STEP_SETUPS if s.name == row.get("setup")), None)
    return s.impl == "ours" if s is not None else str(row.get("setup")).startswith("ours")


def floor_parts(rows: list[dict], precision: str) -> list[dict]:
    """The floor rows of `precision`, in `PART_NAMES` order."""
    parts = {r["part"]: r for r in rows if r.get("kind") == "floor"
             and r.get("precision") == precision}
    return [parts[p] for p in PART_NAMES if p in parts]


def floor_steps(rows: list[dict], precision: str) -> list[dict]:
    """The step rows measured against the floor of `precision` (`step_precision`), ours
    first, then the peer; failed ones included."""
    steps = [r for r in rows if r.get("kind") == "step" and step_precision(r) == precision]
    return sorted(steps, key=lambda r: not _is_ours(r))


def floor_precisions(rows: list[dict]) -> list[str]:
    """The precisions with a floor on record, in `step_floor.PRECISIONS` order."""
    return [p for p in step_floor.PRECISIONS if floor_parts(rows, p)]


def step_name(row: dict) -> str:
    """A step row's name for readers."""
    return {"ours-bf16": NAMES["exact"], "ours-fp8": NAMES["ours-fp8"]}.get(
        row.get("setup"), NAMES.get(row.get("setup"), str(row.get("setup"))))


def floor_figure(rows: list[dict], title: str):
    """Per precision, the floor as a stacked bar of its parts (GEMMs at the rate the card
    sustains at its power limit, attention, the optimizer's bytes at the copy rate),
    and under it each measured step of that precision (ours, then the peer) with what
    it spends over the floor, in ms and as a multiple. A step that failed is drawn as
    "—" with a footnote under the figure; without step rows the floor stands alone."""
    precs = floor_precisions(rows)
    layout = [(p, floor_parts(rows, p), floor_steps(rows, p)) for p in precs]
    n = sum(1 + len(st) for _, _, st in layout) + len(layout) - 1
    fig, ax = plt.subplots(figsize=(9, 0.5 * n + 1.6), layout="constrained")
    y, ticks, labels, notes = n - 1, [], [], {}
    xmax = max([sum(r["ms"] for r in parts) for _, parts, _ in layout] +
               [r["step_ms"] for _, _, st in layout for r in st if "error" not in r])
    for prec, parts, steps in layout:
        floor = sum(r["ms"] for r in parts)
        left, top = 0.0, y
        for r in parts:
            ax.barh(y, r["ms"], 0.6, left=left, color=PART_COLOURS[r["part"]])
            if r["ms"] > xmax * 0.06:
                ax.text(left + r["ms"] / 2, y, f"{r['ms']:.0f}", ha="center",
                        va="center", fontsize=8, color="white")
            left += r["ms"]
        ax.text(floor + xmax * 0.01, y, f"{floor:.0f} ms", va="center", fontsize=8)
        ticks.append(y)
        labels.append(f"{prec} floor")
        for r in steps:
            y -= 1
            ticks.append(y)
            if "error" in r:
                note = failure_note(r)
                mark = notes.setdefault(note, MARKS[min(len(notes), len(MARKS) - 1)])
                labels.append(step_name(r))
                ax.text(xmax * 0.01, y, f"—{mark}", va="center", fontsize=9)
                continue
            ours = _is_ours(r)
            ax.barh(y, r["step_ms"], 0.6, color=plot.BLUE if ours else plot.GREY,
                    hatch=None if ours else "//", edgecolor="white" if not ours else None,
                    xerr=[[r["step_ms"] - r["step_ms_p10"]], [r["step_ms_p90"] -
                                                              r["step_ms"]]]
                    if r.get("step_ms_p10") else None, error_kw=plot._ERR)
            over = r["step_ms"] - floor
            ax.text(max(r["step_ms"], r.get("step_ms_p90") or 0) + xmax * 0.01, y,
                    f"{r['step_ms']:.0f} ms: {over:+.0f} ms, ×{r['step_ms'] / floor:.2f} "
                    f"the floor", va="center", fontsize=8)
            labels.append(step_name(r))
        ax.vlines(floor, y - 0.4, top + 0.4, colors="#333333", linestyles="--", lw=0.8)
        y -= 2
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlim(0, xmax * 1.45)
    ax.set_xlabel("ms per step (the floor: its parts, each at its own ceiling)"
                  + "".join(f"\n{m} {t}." for t, m in notes.items()), fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(axis="x", labelsize=8)
    handles = [Patch(color=PART_COLOURS[p], label=name) for p, name in PART_NAMES.items()]
    if any(st for _, _, st in layout):
        handles += [Patch(color=plot.BLUE, label="ours, measured step"),
                    Patch(facecolor=plot.GREY, hatch="//", edgecolor="white",
                          label="peer, measured step")]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles),
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def floor_table(rows: list[dict]):
    """Every floor part and step on record, with its time, p10–p90, the SM clock and the
    board power measured while it ran (telemetry; "—" where a part has none: the
    optimizer's floor is a copy rate times bytes) and, for a step, its time over the
    floor. A failed step shows "—" with the table's footnote."""
    out = []
    for prec in floor_precisions(rows):
        floor = step_floor.floor_ms(rows, prec)
        for r in floor_parts(rows, prec):
            out.append({**r, "what": f"{prec} floor: {PART_NAMES[r['part']]}",
                        "spread": f"{r['ms_p10']:.0f}–{r['ms_p90']:.0f}"
                        if r.get("ms_p10") is not None else None})
        for r in floor_steps(rows, prec):
            row = {**r, "what": f"{prec} step: {step_name(r)}"}
            if "error" not in r:
                row.update(ms=r["step_ms"], spread=compare.spread(r),
                           over=f"{r['step_ms'] - floor:+.0f} ms, "
                                f"×{r['step_ms'] / floor:.2f}")
            out.append(row)
    return table(out, {"what": None, "ms": ".1f", "spread": None, "tflops": ",.0f",
                       "sm_clock_mhz": ",.0f", "power_w": ".0f", "over": None},
                 headers={"ms": "ms", "spread": "p10–p90 ms", "tflops": "TFLOP/s",
                          "sm_clock_mhz": "SM clock (MHz)", "power_w": "power (W)",
                          "over": "over the floor"})


def floor_sentences(rows: list[dict], command: str) -> list[str]:
    """What the floor says, computed: each precision's floor and the share of it its
    GEMMs take at the card's power limit; then each step over its floor, or, without
    step rows, that `command` measures them."""
    out = []
    for prec in floor_precisions(rows):
        parts = {r["part"]: r for r in floor_parts(rows, prec)}
        floor = step_floor.floor_ms(rows, prec)
        g = parts.get("gemm")
        text = f"The {prec} floor is {floor:.0f} ms"
        if g is not None:
            text += (f": its GEMMs take {g['ms']:.0f} ms of it ({g['ms'] / floor:.0%}) at "
                     f"{g['tflops']:,.0f} TFLOP/s")
            if g.get("power_w") and g.get("power_limit_w"):
                text += (f", the card drawing {g['power_w']:.0f} W of its "
                         f"{g['power_limit_w']:.0f} W limit at a median SM clock of "
                         f"{g['sm_clock_mhz']:,.0f} MHz (its top clock "
                         f"{g['sm_clock_max_mhz']:,.0f})")
        rest = [f"{PART_NAMES[p]} {parts[p]['ms']:.0f} ms" for p in ("attention",
                                                                      "optimizer")
                if p in parts]
        out.append(text + (("; " + " and ".join(rest)) if rest else "") + ".")
    steps = [r for r in rows if r.get("kind") == "step" and "error" not in r]
    if not steps:
        out.append(f"The steps beside the floor are measured in the same run, on the same "
                   f"card, by `{command}`; none is on record for this card yet.")
        return out
    for prec in floor_precisions(rows):
        floor = step_floor.floor_ms(rows, prec)
        for r in floor_steps(rows, prec):
            if "error" in r:
                continue
            over = r["step_ms"] - floor
            text = (f"{step_name(r)} runs {r['step_ms']:.0f} ms a step, {over:+.0f} ms "
                    f"(×{r['step_ms'] / floor:.2f}) against its floor")
            if _is_ours(r) and prec == "fp8":
                text += (f": {over / r['step_ms']:.0%} of the fp8 step is beyond its "
                         f"GEMMs, attention and optimizer, the casts to fp8 and their "
                         f"scales, the norms and the element-wise kernels")
            out.append(text + ".")
    return out


def full_model_floor(row: dict, rows: list[dict], embed_params: int) -> dict | None:
    """The floor of a full-model bf16 step `row` (no layer recomputed), scaled from the
    8-layer floor's rates on the same card: its GEMMs' FLOPs (6 per parameter and token,
    the embedding's lookup excepted: `embed_params`) at the floor's sustained GEMM rate,
    its attention's FLOPs (`mfu_attn` − `mfu` of the row) at the floor's attention rate,
    and AdamW's bytes a parameter at the floor's copy rate. Returns the parts (ms), their
    sum, the MFU (6N) a step at the floor would reach and the row's step over it; None
    without a bf16 floor of all three parts, or for a row that recomputes layers."""
    parts = {r["part"]: r for r in floor_parts(rows, "bf16")}
    if set(parts) != set(PART_NAMES) or row.get("recompute_tflop") or "error" in row:
        return None
    g, a, o = parts["gemm"], parts["attention"], parts["optimizer"]
    tokens = row["batch"] * row["seq_len"]
    gemm = 6 * (row["n_params"] - embed_params) * tokens / (g["tflops"] * 1e12) * 1e3
    attn_flops = (row["mfu_attn"] - row["mfu"]) * row["peak_tflops"] * 1e12 \
        * row["step_ms"] / 1e3
    attn = attn_flops / (a["flops"] / a["ms"] * 1e3) * 1e3
    opt = row["n_params"] * o["bytes_per_param"] / (o["copy_gbps"] * 1e9) * 1e3
    floor = gemm + attn + opt
    return {"gemm_ms": gemm, "attention_ms": attn, "optimizer_ms": opt, "floor_ms": floor,
            "mfu_at_floor": row["mfu"] * row["step_ms"] / floor,
            "over": row["step_ms"] / floor, "gemm_tflops": g["tflops"]}


def full_model_floor_words(row: dict, rows: list[dict], embed_params: int,
                           small: dict | None = None) -> str | None:
    """`full_model_floor` in a sentence, with the card's power and SM clock during the
    row's steps; `small`, the 8-layer step measured against the floor itself, for
    comparison."""
    f = full_model_floor(row, rows, embed_params)
    if f is None:
        return None
    text = (f"Scaled from the 8-layer floor's rates on this card, the full model's floor "
            f"at batch {row['batch']} is about {f['floor_ms']:.0f} ms: its GEMMs "
            f"{f['gemm_ms']:.0f} ms at {f['gemm_tflops']:,.0f} TFLOP/s, attention "
            f"{f['attention_ms']:.0f} and the optimizer {f['optimizer_ms']:.0f} at the "
            f"copy rate, an MFU of at most {f['mfu_at_floor']:.1%}. The step runs "
            f"×{f['over']:.2f} its floor")
    if small is not None:
        floor = step_floor.floor_ms(rows, "bf16")
        text += f", as the 8-layer step runs ×{small['step_ms'] / floor:.2f} its own"
    if row.get("power_w") and row.get("power_limit_w"):
        text += (f", the card drawing {row['power_w']:.0f} W of its "
                 f"{row['power_limit_w']:.0f} W limit at a median SM clock of "
                 f"{row['sm_clock_mhz']:,.0f} MHz")
    return text + "."
