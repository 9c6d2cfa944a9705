"""The book at a glance: one entry per switch chapter, built from the recorded results.

Each chapter times a whole LLaMA training step with its switch off and with our
implementation on, side by side in one run (`benchmarks.steps`). An `Entry` holds one
such pair as recorded: MFU and tokens/s before and after, the ratio of median step
times and whether it is *level* (`compare.versus`: the medians lie inside each other's
p10-p90 range), the results file and the commit that made it. `plot_mfu_per_switch`
draws every entry in one figure, `table` lists them through `notebook.table`; the
landing page (`book/intro.ipynb`) shows both, so a reader sees what each switch buys
before opening its chapter. Nothing here measures: it only reads results files.

A results file that is missing, or a setup absent or failed in it, leaves its entry
with a note in `Entry.missing` instead of numbers: the chapter still shows, and says
why it has no bar.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import matplotlib.ticker
from matplotlib.patches import Patch

from colossal_lab.book import notebook, plot
from colossal_lab.book.paired_rows import one_per_setup
from colossal_lab.measure import compare, results

# ---------------------------------------------------------------- what each chapter compares


@dataclass(frozen=True)
class Chapter:
    """One chapter's headline comparison: two setups of its step benchmark."""

    number: str
    """As in the table of contents: "00", "01", ..."""
    title: str
    page: str
    """The chapter's notebook, relative to `book/` (Jupyter Book links it to its page)."""
    results: str
    """The results file (`results/<gpu>/<results>.json`) holding the step rows."""
    off: str
    """The setup with the switch off: the naive reference."""
    on: str
    """The setup with the switch on: our implementation."""
    measured: str
    """What the chapter measured, in a line for the landing page's table."""
    also: tuple[str, ...] = ()
    """Further setups of the same file worth a bar (e.g. fp32 next to bf16 and fp8)."""
    trades_memory: bool = False
    """The switch buys memory with throughput: its entry shows the peak memory too."""


CHAPTERS = (
    Chapter("00", "What MFU is", "00_mfu.ipynb", "baseline", "ours-fp32-naive",
            "ours-bf16-sdpa",
            "the FLOP count, the right peak, timing and its noise; every switch off "
            "against Hugging Face"),
    Chapter("01", "Flash attention", "01_flash_attention.ipynb", "flash_attention_step",
            "attn-naive", "attn-triton",
            "our Triton FlashAttention-2 against naive attention, SDPA and cuDNN"),
    Chapter("02", "Fused normalization", "02_fused_norm.ipynb", "fused_norm_step",
            "norm-eager", "norm-triton",
            "our Triton RMSNorm (+ residual add) against eager, F.rms_norm and Liger"),
    Chapter("03", "Fused projections", "03_fused_projections.ipynb", "fused_qkv_step",
            "proj-separate", "proj-fused-triton",
            "one QKV and one gate/up GEMM with grouped-query heads; a Triton SwiGLU"),
    Chapter("04", "Gradient checkpointing", "04_gradient_checkpointing.ipynb",
            "checkpointing", "ckpt-none", "ckpt-selective",
            "full, partial and selective recomputation: speed against memory; "
            "LLaMA-7B on one GPU",
            trades_memory=True),
    Chapter("06", "Precision", "06_precision.ipynb", "precision_step", "bf16",
            "fp8-delayed",
            "fp32, tf32, bf16, fp16 and fp8 linears: GEMMs, the step, loss curves",
            also=("fp32",)),
    Chapter("10", "Every switch", "10_composed.ipynb", "composed", "hf-liger",
            "ours-bf16",
            "every single-GPU switch composed, with our RoPE and fused head + loss, "
            "against HF + Liger; resumable training from one command",
            also=("ours-fp8",)),
)
"""The written chapters, in book order."""


# ---------------------------------------------------------------- one measured setup


@dataclass(frozen=True)
class Point:
    """One step row, reduced to what the overview shows."""

    setup: str
    label: str
    mfu: float
    mfu_low: float
    """MFU at the p90 step time: MFU scales as 1 / step time, so the slow end is low."""
    mfu_high: float
    """MFU at the p10 step time."""
    tokens_per_s: float
    peak_mem_gib: float | None
    row: dict
    """The row itself, for `compare.versus`."""


def point(row: dict) -> Point:
    """The `Point` of a step row; its MFU range is the row's p10-p90 step times turned
    into MFU (`plot.mfu_spread`: the spread `compare.versus` judges "level" by)."""
    mfu = row["mfu"]
    (below,), (above,) = plot.mfu_spread(row) or ([0.0], [0.0])
    return Point(row["setup"], row.get("label") or row["setup"], mfu, mfu - below,
                 mfu + above, row["tokens_per_s"], row.get("peak_mem_gib"), row)


def _find(res: results.Results, setup: str) -> tuple[Point | None, str | None]:
    """The setup's `Point` in `res`, or why there is none (absent, or it failed). A
    setup timed several times in turns gives the row its chapter shows
    (`paired_rows.one_per_setup`)."""
    rows = [r for r in one_per_setup(res.rows) if r.get("setup") == setup]
    if not rows:
        return None, f"no row {setup!r} in {res.name}"
    if "error" in rows[0]:
        return None, f"{setup} failed: {str(rows[0]['error'])[:60]}"
    return point(rows[0]), None


# ---------------------------------------------------------------- one chapter's entry


@dataclass(frozen=True)
class Entry:
    """A chapter's switch off against on, as recorded (or why it is not)."""

    chapter: Chapter
    results: results.Results | None
    off: Point | None = None
    on: Point | None = None
    also: tuple[Point, ...] = ()
    comparison: compare.Comparison | None = None
    """`on` against `off`: `speedup` > 1 means the switch made the step faster."""
    missing: str | None = None
    """Why the entry has no comparison (file absent, setup absent or failed)."""
    notes: tuple[str, ...] = ()
    """What was skipped without losing the comparison (an `also` setup that failed)."""

    @property
    def ok(self) -> bool:
        return self.comparison is not None

    @property
    def link(self) -> str:
        """A Markdown link to the chapter, relative to `book/`."""
        return f"[{self.chapter.number} · {self.chapter.title}]({self.chapter.page})"

    @property
    def file(self) -> str | None:
        """The results file, relative to the repository (as the banner names it)."""
        return self.results._file_label() if self.results else None

    @property
    def commit(self) -> str | None:
        """The commit the results file records, shortened as the banner shortens it."""
        return str(self.results.provenance.get("git_sha") or "?")[:10] \
            if self.results else None

    @property
    def verdict(self) -> str:
        """"×2.14 faster", "×1.00 level" or "×0.92 slower" (+ a warning on few steps)."""
        c = self.comparison
        if c is None:
            return "–"
        few = f", under {compare.MIN_STEPS} steps timed" if c.few_steps else ""
        return f"×{c.speedup:.2f} {c.verdict}{few}"

    @property
    def memory(self) -> str:
        """Peak memory off → on, e.g. "54.4 → 41.0 GiB" ("–" when not recorded)."""
        if not self.ok or self.off.peak_mem_gib is None or self.on.peak_mem_gib is None:
            return "–"
        return f"{self.off.peak_mem_gib:.1f} → {self.on.peak_mem_gib:.1f} GiB"


def entry(chapter: Chapter, res: results.Results | None, missing: str | None = None) -> Entry:
    """`chapter`'s entry from its loaded results (None, with `missing` saying why, when
    the file could not be loaded)."""
    if res is None:
        return Entry(chapter, None, missing=missing or f"no {chapter.results} results")
    off, why_off = _find(res, chapter.off)
    on, why_on = _find(res, chapter.on)
    if off is None or on is None:
        return Entry(chapter, res, off, on, missing="; ".join(filter(None, [why_off,
                                                                           why_on])))
    found = [_find(res, s) for s in chapter.also]
    also = tuple(p for p, _ in found if p is not None)
    notes = tuple(why for p, why in found if p is None)
    try:
        comparison = compare.versus(on.row, off.row)
    except ValueError as e:  # different batches: no step-time ratio to give
        return Entry(chapter, res, off, on, also, missing=str(e), notes=notes)
    return Entry(chapter, res, off, on, also, comparison, notes=notes)


def gather(gpu: str | None = None, chapters=CHAPTERS) -> list[Entry]:
    """Every chapter's entry from `results/<gpu>/` (`gpu=None`: this machine's GPU, then
    the reference GPU, as `results.load_results` chooses)."""
    out = []
    for ch in chapters:
        try:
            res = results.load_results(ch.results, gpu=gpu)
        except FileNotFoundError:
            out.append(entry(ch, None, f"no recorded {ch.results}.json for "
                                       f"{gpu or 'this GPU'}"))
            continue
        out.append(entry(ch, res))
    return out


def captions(entries: list[Entry]):
    """One caption line naming every results file the entries read, each linked to the
    Measurements appendix (`notebook.Captions`)."""
    return notebook.Captions([e.results for e in entries if e.results is not None])


def banners(entries: list[Entry]) -> str:
    """The provenance banner of every results file the entries read, once each: what
    `integrity.check_notebook` checks against the files."""
    seen = {}
    for e in entries:
        if e.results is not None:
            seen.setdefault(e.file, e.results.banner())
    return "\n".join(seen.values())


# ---------------------------------------------------------------- the table


TABLE_COLUMNS = {"chapter": None, "measured": None, "result": None, "source": None}
TABLE_HEADERS = {"measured": "what it measured",
                 "result": "its step: MFU off → on; step time",
                 "source": "results file"}


def _folder(entries: list[Entry]) -> str | None:
    """The one folder every entry's results file sits in (None: several, or none)."""
    folders = {e.file.rpartition("/")[0] for e in entries if e.results is not None}
    return folders.pop() if len(folders) == 1 else None


def table_row(e: Entry, folder: str | None = None) -> dict:
    """One line of the landing page's table, every cell already text; the results file
    is named relative to `folder` when given (the table's header names the folder)."""
    row = {"chapter": e.link, "measured": e.chapter.measured, "source": "–"}
    if e.results is not None:
        name = e.file[len(folder) + 1:] if folder else e.file
        row["source"] = name
    if not e.ok:
        return {**row, "result": f"not measured: {e.missing}"}
    memory = f"; peak memory {e.memory}" if e.chapter.trades_memory else ""
    return {**row, "result": f"{e.off.mfu:.1%} → {e.on.mfu:.1%}; {e.verdict}{memory}"}


def table(entries: list[Entry]):
    """The landing page's table (`notebook.table`'s Markdown): per chapter a link, what
    it measured, its step's MFU off → on and step-time verdict, and its results file
    (the file's commit is on the Measurements page, not here)."""
    folder = _folder(entries)
    headers = dict(TABLE_HEADERS)
    if folder:
        headers["source"] = f"results file in {folder}/"
    return notebook.table([table_row(e, folder) for e in entries], TABLE_COLUMNS,
                          headers=headers)


# ---------------------------------------------------------------- the figure

FONT = 11
"""Smallest font of the figure (points). The page's text column is about 680 px wide,
so an 8-inch figure (800 px) shows at 85 %: 11 pt reads as about 9."""
WIDTH = 8.0
"""Figure width in inches: the book allows 9; 8 shrinks less in the text column."""
BAR = 0.26
"""Bar height; groups sit `GAP` apart."""
GAP = 0.4


def title_of(entries: list[Entry]) -> str:
    """"MFU per switch on <GPU>: <preset>, seq <S>, batch <B>", from the rows and the
    files' provenance (several shapes or GPUs are all named)."""
    ok = [e for e in entries if e.ok]
    gpus = dict.fromkeys(e.results.provenance.get("gpu", "?") for e in ok)
    shapes = dict.fromkeys(f"{p.row.get('preset', '?')}, seq {p.row.get('seq_len', '?')}, "
                           f"batch {p.row.get('batch', '?')}"
                           for e in ok for p in (e.off, e.on))
    return f"MFU per switch on {' / '.join(gpus) or '?'}: {'; '.join(shapes) or '?'}"


def xlabel_of(entries: list[Entry]) -> str:
    """The MFU axis label: the peak(s) the rows divided by, and which peak that is as
    the rows (or their files' config) record it ("dense bf16 ...": for every
    precision, fp8 included, so the bars compare)."""
    shown = [(e, p) for e in entries if e.ok for p in (e.off, e.on, *e.also)]
    peaks = sorted({p.row["peak_tflops"] for _, p in shown if p.row.get("peak_tflops")})
    if not peaks:
        return "MFU (6N)"
    kinds = {str(p.row.get("mfu_peak") or e.results.config.get("mfu_peak") or "")
             for e, p in shown}
    bf16 = all(k.startswith("dense bf16") for k in kinds)
    of = " / ".join(f"{x:g}" for x in peaks)
    return f"MFU (6N) of {of} TFLOP/s" + (", the dense bf16 peak, for every precision"
                                           if bf16 else " peak")


def _layout(entries: list[Entry]) -> list[tuple[float, list[tuple[str, Point | None]]]]:
    """Each entry's group centre and its bars top to bottom as (role, point), with y
    growing upwards so the first chapter sits on top."""
    groups, y = [], 0.0
    for e in reversed(entries):
        bars = [("off", e.off), ("on", e.on), *(("also", p) for p in e.also)] \
            if e.ok else [("missing", None)]
        ys = [y + BAR * i for i in range(len(bars))][::-1]
        groups.append((sum(ys) / len(ys), list(zip(ys, bars))))
        y = ys[0] + BAR + GAP
    return groups[::-1]


def _bars(ax, placed: list[tuple[float, Point]], role: str, style: dict):
    """One `barh` call per role (off, on, also), with p10-p90 whiskers in MFU."""
    if not placed:
        return None
    ys, pts = zip(*placed)
    err = [[p.mfu - p.mfu_low for p in pts], [p.mfu_high - p.mfu for p in pts]]
    return ax.barh(ys, [p.mfu for p in pts], BAR * 0.9, xerr=err, gid=role,
                   error_kw=plot._ERR, **style)


def _annotation(e: Entry, role: str, p: Point) -> str:
    """The text after a bar: its MFU, and on the switch-on bar the step-time ratio in
    words (with the memory it buys where that is the point of the switch)."""
    if role == "also":
        return f"{p.mfu:.1%}  {p.setup}"
    if role == "off":
        return f"{p.mfu:.1%}"
    c = e.comparison
    text = f"{p.mfu:.1%}  ×{c.speedup:.2f} {c.verdict}"
    if c.few_steps:
        text += " (few steps)"
    if e.chapter.trades_memory and e.off.peak_mem_gib and p.peak_mem_gib:
        saved = p.peak_mem_gib - e.off.peak_mem_gib
        text += f", {saved:+.0f} GiB peak".replace("-", "−")
    return text


def plot_mfu_per_switch(entries: list[Entry], ax=None):
    """Paired horizontal bars of MFU per chapter: switch off (grey) and on (blue), with
    whiskers over the p10-p90 step times, the on bar annotated with the step-time ratio
    ("level" when inside the noise). Entries without numbers show their reason."""
    groups = _layout(entries)
    if ax is None:
        height = sum(len(bars) for _, bars in groups) * BAR + len(groups) * GAP + 1.8
        _, ax = plt.subplots(figsize=(WIDTH, height))
    styles = {"off": {"facecolor": plot.GREY}, "on": {"facecolor": plot.BLUE},
              "also": {"facecolor": "white", "edgecolor": plot.GREY, "hatch": "///"}}
    placed = {role: [] for role in styles}
    hi = max([p.mfu_high for e in entries if e.ok for p in (e.off, e.on, *e.also)]
             + [0.5])
    xmax = max(1.0, hi * 1.4)
    for e, (_, bars) in zip(entries, groups):
        for y, (role, p) in bars:
            if p is None:
                ax.text(xmax * 0.01, y, f"not measured: {e.missing}"[:90], va="center",
                        color=plot.GREY, fontsize=FONT)
                continue
            placed[role].append((y, p))
            ax.text(p.mfu_high + xmax * 0.012, y, _annotation(e, role, p), va="center",
                    fontsize=FONT)
    for role, style in styles.items():
        _bars(ax, placed[role], role, style)
    ax.set_yticks([c for c, _ in groups])
    ax.set_yticklabels([f"{e.chapter.number} · {e.chapter.title}\n{e.chapter.off} → "
                        f"{e.chapter.on}" for e in entries], fontsize=FONT)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=FONT)
    ax.set_xlim(0, xmax)
    ax.set_xticks([i / 5 for i in range(6)])  # 0-100%: room past it is for the labels
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel(xlabel_of(entries), fontsize=FONT)
    ax.set_title(title_of(entries), fontsize=FONT + 1, loc="right")  # stays inside
    names = {"off": "switch off (naive)", "on": "switch on (ours)",
             "also": "another setting"}
    handles = [Patch(label=names[role], **style) for role, style in styles.items()
               if placed[role]]
    handles.append(plot._spread_handle())
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2,
              fontsize=FONT, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.figure.tight_layout()
    return ax
