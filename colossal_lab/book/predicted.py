"""What the multi-GPU switches (05, 07, 08) would buy, predicted from one GPU's costs.

One H200 cannot run tensor parallelism, a pipeline or a data-parallel all-reduce, but it
measures what each is built from: the GEMMs of a tensor-parallel layer
(`sequence_parallel_gemm`), the F, B and W of a pipeline stage (`pipeline_sim`), when
each gradient of the backward becomes final (`grad_overlap_model`). Each `Prediction`
below turns those recorded costs, and a link, into the MFU of the step with the switch
off and on. The link is the one unknown the chapters cannot measure on one GPU, so each
prediction is made twice, at the two ends of a `Band`:

* the **datasheet** NVLink 4 of an H100 / H200 SXM, per direction (half the per-GPU
  figure, which counts both directions; `overlap_model.LINKS`), an upper bound;
* what **NCCL measures** on such a link: nccl-tests' bus bandwidth of an all-reduce and
  of point-to-point exchanges on two H200 (NVLink, NV18), recorded with the H200's
  ceilings; the values, with their message sizes and sources, are the `Band`s below.

`mfu_delta_band` draws one figure per switch: a band from the measured-NCCL MFU to the
datasheet MFU for every setup, or, where a multi-GPU run is on record
(`results/<gpu>x<n>/`), the measured MFU with its p10-p90 spread in its place.
`exact_optimizer` picks chapter 10's headline rows by what they ran.

MFU throughout is 6N FLOPs per token against the dense bf16 peak, per GPU, as in every
chapter; nothing here measures: it only reads results files.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import matplotlib.pyplot as plt
import matplotlib.ticker
from matplotlib.patches import Patch

from colossal_lab.benchmarks import grad_overlap as go
from colossal_lab.benchmarks import pipeline_sim
from colossal_lab.benchmarks import sequence_parallel_gemm as spg
from colossal_lab.book import plot
from colossal_lab.book.paired_rows import one_per_setup
from colossal_lab.config import preset
from colossal_lab.measure import mfu as mfu_lib
from colossal_lab.measure import results
from colossal_lab.parallel import overlap_model as om
from colossal_lab.parallel.pipeline.sim_rows import parts, simulate_rows

# ---------------------------------------------------------------- the link band


@dataclass(frozen=True)
class Band:
    """The two ends of a link's bandwidth: `high` (the datasheet) and, per kind of
    transfer ("all_reduce", "p2p"), `low` (what NCCL measures on such a link)."""

    high: om.Link
    low: dict[str, om.Link]

    def link(self, end: str, kind: str = "all_reduce") -> om.Link:
        """The link at `end` ("high" or "low") for transfers of `kind`."""
        return self.high if end == "high" else self.low[kind]


NVLINK = Band(
    high=om.link("NVLink 4"),
    low={"all_reduce": om.Link(
        "NCCL all-reduce on NVLink", 217.0, 10.0,
        "measured: NCCL all-reduce bus bandwidth on two H200 (NVLink, NV18), 217 GB/s "
        "at 16 MiB, 300 GB/s at 256 MiB, 328 GB/s at 1 GiB (nccl-tests' busbw)"),
         "p2p": om.Link(
        "NCCL send/recv on NVLink", 300.0, 10.0,
        "measured: NCCL point-to-point exchange on two H200 (NVLink, NV18), about "
        "300-358 GB/s at large sizes")})
"""NVLink 4 between two H100 / H200 SXM: datasheet against NCCL's measured bandwidth."""

ENDS = ("low", "high")


# ---------------------------------------------------------------- one prediction


@dataclass(frozen=True)
class Bar:
    """One setup of a switch's figure: its predicted MFU at each end of the band, or
    the MFU a multi-GPU run measured (with its p10-p90 spread) in its place."""

    key: tuple
    """What a measured row must match to replace the prediction (e.g. ("1f1b", 4, 8))."""
    label: str
    low: float
    """MFU with the measured NCCL bandwidth (the band's low end)."""
    high: float
    """MFU with the datasheet bandwidth."""
    measured: dict | None = None
    """{"mfu", "mfu_p10", "mfu_p90", "file"} of a measured row, when one exists."""


@dataclass(frozen=True)
class Prediction:
    """One switch's bars, off first, and what the figure says about them."""

    chapter: str
    title: str
    off: tuple
    on: tuple
    """The keys of the switch-off and switch-on bars (the delta is on − off)."""
    bars: list[Bar] = field(default_factory=list)
    note: str = ""
    """Where the prediction comes from, for the caption."""

    def bar(self, key: tuple) -> Bar:
        return next(b for b in self.bars if b.key == key)

    def delta(self) -> tuple[float, float]:
        """MFU on − off, in fractions (low end, high end); a measured pair gives the
        same number twice."""
        a, b = self.bar(self.off), self.bar(self.on)
        if a.measured and b.measured:
            d = b.measured["mfu"] - a.measured["mfu"]
            return d, d
        return b.low - a.low, b.high - a.high

    @property
    def measured(self) -> bool:
        """Both bars of the delta come from a multi-GPU run."""
        return bool(self.bar(self.off).measured and self.bar(self.on).measured)


def _mfu(cfg, tokens_per_s_per_gpu: float, peak_tflops: float) -> float:
    """6N · tokens/s per GPU over the peak."""
    return mfu_lib.seed_flops(cfg, 1) * tokens_per_s_per_gpu / (peak_tflops * 1e12)


def _measured(row: dict, cfg, peak_tflops: float, per_gpu_tokens_per_s, file: str
              ) -> dict:
    """{"mfu", "mfu_p10", "mfu_p90", "file"} of a measured row: its own MFU when it
    records one, else 6N from its tokens/s per GPU; the spread from its p10-p90 step
    times (`plot.mfu_spread`)."""
    value = row.get("mfu")
    if value is None:
        cfg = preset(row["preset"]) if row.get("preset") else cfg
        value = _mfu(cfg, per_gpu_tokens_per_s(row), peak_tflops)
    spread = plot.mfu_spread({**row, "mfu": value})
    lo, hi = (value - spread[0][0], value + spread[1][0]) if spread else (value, value)
    return {"mfu": value, "mfu_p10": lo, "mfu_p90": hi, "file": file}


def _attach(bars: list[Bar], runs: list[results.Results], key_of, cfg, peak, per_gpu
            ) -> list[Bar]:
    """Each bar with the first measured row of `runs` whose `key_of(row)` is its key."""
    out = []
    for b in bars:
        found = None
        for res in runs:
            for r in res.rows:
                if "error" in r or "skipped" in r or "step_ms" not in r:
                    continue
                try:
                    k = key_of(r)
                except KeyError:
                    continue
                if k == b.key:
                    found = _measured(r, cfg, peak, per_gpu, res._file_label())
                    break
            if found:
                break
        out.append(replace(b, measured=found) if found else b)
    return out


def reference_peak(gpu: str | None = None) -> float:
    """The dense bf16 peak (TFLOP/s) the one-GPU step rows divide by."""
    row = next(r for r in results.load_results("composed", gpu=gpu).rows
               if r.get("peak_tflops"))
    return float(row["peak_tflops"])


# ---------------------------------------------------------------- 05: sequence parallelism


SP_TP = 2
"""Tensor-parallel ranks of 05's prediction: what a two-GPU node runs."""
SP_SCHEMES = (("tp-all_reduce", "all_reduce", "plain TP (all-reduce)"),
              ("sp-split_gather", "split_gather", "sequence parallel (split_gather)"),
              ("sp-ring", "ring", "sequence parallel, ring"))


def sequence_parallel(gpu: str | None = None, *, tp: int = SP_TP, band: Band = NVLINK,
                      measured: list[results.Results] | None = None) -> Prediction:
    """05: MFU of a tensor-parallel LLaMA-7B step at `tp` ranks per scheme. A rank's
    layer takes its measured GEMM time (`sequence_parallel_gemm`) plus the communication
    the scheme leaves exposed and, for the ring, its chunked GEMMs' extra time
    (`sequence_parallel_gemm.comm_rows` on each end of the band); the step's MFU is the
    one-GPU step's (`exact_optimizer`, the best bf16 step measured) scaled by GEMM time
    over layer time: the work outside the GEMMs is assumed to split over the ranks as
    the GEMMs do."""

    res = results.load_results(spg.NAME, gpu=gpu)
    gemm = [r for r in res.rows if r["kind"] == "gemm"]
    cfg, tokens = preset(res.config["preset"]), res.config["seq_len"] * \
        res.config["batch"]
    ours, _ = exact_optimizer(results.load_results("composed", gpu=gpu).rows)
    base, peak = ours["mfu"], ours["peak_tflops"]
    comm = {end: {r["scheme"]: r for r in spg.comm_rows(gemm, cfg, tokens, [tp],
                                                        band.link(end))}
            for end in ENDS}

    def mfu_at(end, scheme):
        r = comm[end][scheme]
        return base * r["gemm_ms"] / r["layer_ms"]

    bars = [Bar((mode, tp), f"{label}, t={tp}", mfu_at("low", s), mfu_at("high", s))
            for s, mode, label in SP_SCHEMES]
    if measured is None:
        measured = results.load_multi_gpu("sequence_parallel_step")
    bars = _attach(bars, measured, lambda r: (r["mode"], r["tp"]),
                   preset("llama-7b"), peak, lambda r: r["tokens_per_s_per_gpu"])
    return Prediction("05", f"Sequence parallelism, t={tp}", ("all_reduce", tp),
                      ("split_gather", tp), bars,
                      "each rank's measured GEMMs plus the communication left exposed")


# ---------------------------------------------------------------- 07: pipeline


PP = (4, 8)
"""(p, m) of 07's prediction: the tutorial's setting."""


def pipeline(gpu: str | None = None, *, p: int = PP[0], m: int = PP[1],
             band: Band = NVLINK, measured: list[results.Results] | None = None
             ) -> Prediction:
    """07: MFU per GPU of 1F1B and ZB-V on `p` GPUs with `m` micro-batches, simulated
    (`pipeline.sim_rows.simulate_rows`) from the measured F, B, W of a LLaMA-7B layer and
    the head, with each stage-to-stage transfer costed at each end of the band. The
    simulated step leaves out the embedding and the optimizer: an upper bound."""

    res = results.load_results(pipeline_sim.NAME, gpu=gpu)
    layer, head, p2p = parts(res.rows)
    cfg = preset(layer["preset"])
    peak = reference_peak(gpu)
    names = {end: band.link(end, "p2p").name for end in ENDS}
    p2p = {**p2p, **{f"comm_ms[{names[end]}]": pipeline_sim.p2p_ms(
        p2p["act_bytes"], band.link(end, "p2p")) for end in ENDS}}
    sims = simulate_rows([layer, head, p2p], ps=[p], ms=[m], schedules=("1f1b", "zbv"),
                         links=list(names.values()))
    by = {(r["schedule"], r["link"]): r for r in sims}

    def mfu_at(end, name):
        return _mfu(cfg, by[name, names[end]]["tokens_per_s"] / p, peak)

    bars = [Bar((name, p, m), f"{label}, p={p}, m={m}", mfu_at("low", name),
                mfu_at("high", name))
            for name, label in (("1f1b", "1F1B"), ("zbv", "ZB-V (zero bubble)"))]
    if measured is None:
        measured = results.load_multi_gpu(pipeline_sim.MEASURED)
    bars = _attach(bars, measured, lambda r: (r["schedule"], r["p"], r["m"]), cfg, peak,
                   lambda r: r["tokens_per_s"] / r["p"])
    return Prediction("07", f"Pipeline, zero bubble, p={p}, m={m}", ("1f1b", p, m),
                      ("zbv", p, m), bars,
                      "the measured F, B, W of a layer, scheduled by the simulator")


# ---------------------------------------------------------------- 08: overlapped all-reduce


DP_WORLD = 2
"""Data-parallel ranks of 08's prediction: a two-GPU node."""


def overlap_allreduce(gpu: str | None = None, *, world: int = DP_WORLD,
                      band: Band = NVLINK, dtype: str = "bf16",
                      measured: list[results.Results] | None = None) -> Prediction:
    """08: MFU of a data-parallel step at `world` ranks, the gradients all-reduced after
    the backward (naive) or overlapped with it in DDP's 25 MB buckets, by the overlap
    model (`overlap_model`) over the measured time each gradient became final
    (`grad_overlap_model`): the one-GPU step plus what stays exposed."""

    res = results.load_results(go.NAME, gpu=gpu)
    grads, backward_ms, step_ms = go.grads_of(res.rows)
    bwd = next(r for r in res.rows if r.get("kind") == "backward")
    cfg = preset(bwd["preset"])
    peak = reference_peak(gpu)
    tokens = bwd["batch"] * bwd["seq_len"]
    ddp = next(b for b in go.BUCKETS if "DDP" in b.label)
    flat = next(b for b in go.BUCKETS if b.flat)

    def mfu_at(end, bucket):
        o = go.overlap_of(grads, backward_ms, bucket, band.link(end), world, dtype)
        return _mfu(cfg, tokens / ((step_ms + o.exposed_ms) / 1e3), peak)

    bars = [Bar((backend, world), f"{label}, {world} GPUs", mfu_at("low", b),
                mfu_at("high", b))
            for backend, label, b in (("naive", "all-reduce after the backward", flat),
                                      ("overlap", "overlapped, 25 MB buckets", ddp))]
    if measured is None:
        measured = results.load_multi_gpu(go.MEASURED)

    def key_of(r):
        if r.get("preset") != bwd["preset"] or r.get("link") not in (None, "nvlink"):
            raise KeyError("another preset or link")
        return (r["backend"], r["world"])

    bars = _attach(bars, measured, key_of, cfg, peak, lambda r: r["tokens_per_s"])
    return Prediction("08", f"Overlapped all-reduce, {world} GPUs",
                      ("naive", world), ("overlap", world), bars,
                      "the measured backward plus the all-reduce the overlap model "
                      "leaves exposed")


PREDICTIONS = {"05": sequence_parallel, "07": pipeline, "08": overlap_allreduce}
"""Each multi-GPU chapter's prediction, by chapter number."""


# ---------------------------------------------------------------- the figure

LIGHT = "#a9c4e2"
"""The band's fill: lighter than a measured bar."""


def mfu_delta_band(pred: Prediction, *, band: Band = NVLINK, kind: str = "all_reduce",
                   ax=None):
    """One switch's MFU per setup, predicted or measured: for a setup without a
    multi-GPU run, a light bar up to the MFU with NCCL's measured bandwidth and a
    hatched band from there to the MFU with the datasheet's (the wider the band, the
    more the link decides); for a measured setup, a solid bar with its p10-p90 whiskers.
    The switch-on bar carries the MFU delta over the switch-off one. "predicted" is in
    the title unless every bar was measured. Returns the axes."""
    bars = pred.bars
    n = len(bars)
    if ax is None:
        _, ax = plt.subplots(figsize=(8.5, 0.62 * n + 1.7))
    ys = list(range(n))[::-1]
    xmax = max([max(b.high, (b.measured or {}).get("mfu_p90", 0)) for b in bars] + [0.1])
    for y, b in zip(ys, bars):
        if b.measured:
            m = b.measured
            ax.barh(y, m["mfu"], 0.6, color=plot.BLUE,
                    xerr=[[m["mfu"] - m["mfu_p10"]], [m["mfu_p90"] - m["mfu"]]],
                    error_kw=plot._ERR)
            text, end = f"{m['mfu']:.1%} measured", m["mfu_p90"]
        else:
            ax.barh(y, b.low, 0.6, color=LIGHT)
            ax.barh(y, b.high - b.low, 0.6, left=b.low, color="white",
                    edgecolor=plot.BLUE, hatch="////", lw=0.8)
            text, end = f"{b.low:.1%}–{b.high:.1%} predicted", b.high
        if b.key == pred.on:
            lo, hi = pred.delta()
            pts = (f"{lo * 100:+.1f}" if abs(hi - lo) < 5e-4 else
                   f"{lo * 100:+.1f} to {hi * 100:+.1f}").replace("-", "−")
            text += f"  ({pts} pts)"
        ax.text(end + xmax * 0.015, y, text, va="center", fontsize=9)
    ax.set_yticks(ys)
    ax.set_yticklabels([b.label for b in bars], fontsize=9)
    ax.set_xlim(0, xmax * 1.95)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("MFU (6N) per GPU, dense bf16 peak", fontsize=9)
    handles = []
    if any(not b.measured for b in bars):
        handles += [Patch(color=LIGHT, label=f"predicted, NCCL's measured "
                                             f"{band.low[kind].gbps:g} GB/s"),
                    Patch(facecolor="white", edgecolor=plot.BLUE, hatch="////",
                          label=f"up to the datasheet's {band.high.gbps:g} GB/s")]
    if any(b.measured for b in bars):
        handles += [Patch(color=plot.BLUE, label="measured"), plot._spread_handle()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.27),
              ncol=2, fontsize=8.5, frameon=False)
    word = "measured" if all(b.measured for b in bars) else "predicted"
    ax.set_title(f"{pred.chapter} · {pred.title}: MFU {word}", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    ax.figure.tight_layout()
    return ax


# ---------------------------------------------------------------- chapter 10's headline


def exact_optimizer(rows: list[dict]) -> tuple[dict, dict]:
    """(ours, peer) of a composed run, picked by what they ran, not by name: ours is a
    successful bf16 step with bf16 parameters and fp32 masters (precision "bf16-pure")
    whose AdamW keeps fp32 moments (the exact optimizer), on the peer's preset, sequence
    and batch, preferring the plain step (no CUDA graph, no deferred optimizer, not
    compiled); the peer is Hugging Face with Liger (norm backend "liger", bf16). One row
    a setup, by chapter 10's rule (`paired_rows.one_per_setup`): a run that timed the
    two in pairs gives the median pair's rows, whose ratio `composed_view.headline`
    takes for the headline."""
    ok = [r for r in one_per_setup(rows) if "error" not in r or r.get("error") is None]
    peer = next(r for r in ok if r.get("norm_backend") == "liger"
                and r.get("precision") == "bf16")
    shape = ("preset", "seq_len", "batch")
    ours = [r for r in ok if r.get("precision") == "bf16-pure"
            and r.get("optimizer_moments") == "fp32"
            and all(r.get(k) == peer.get(k) for k in shape)]
    if not ours:
        raise ValueError("no bf16-pure row with fp32 AdamW moments on the peer's shape")

    def extras(r):
        return (bool(r.get("graph_captures")), bool(r.get("optimizer_deferred")),
                "compile" in str(r.get("label", "")), len(str(r.get("setup", ""))))

    return min(ours, key=extras), peer


# ---------------------------------------------------------------- the intro's figure


def plot_switch_deltas(entries, predictions: list[Prediction], *, ax=None):
    """Every switch's MFU delta (on − off, points of MFU) in one figure, in chapter
    order: the measured ones (`overview.Entry`) as solid bars with the p10-p90 whiskers
    of both setups combined, the predicted ones (`Prediction`) as a hatched, lighter
    range from the measured-NCCL end to the datasheet end of the link band, labelled
    "predicted". Returns the axes."""
    items = []
    for e in entries:
        if e.ok:
            d = e.on.mfu - e.off.mfu
            lo = (e.on.mfu_low - e.off.mfu_high) - d
            hi = (e.on.mfu_high - e.off.mfu_low) - d
            items.append((e.chapter.number, e.chapter.title, "measured", d, d, (lo, hi)))
    for p in predictions:
        lo, hi = p.delta()
        items.append((p.chapter, p.title, "measured" if p.measured else "predicted",
                      min(lo, hi), max(lo, hi), None))
    items.sort(key=lambda t: t[0])
    n = len(items)
    if ax is None:
        _, ax = plt.subplots(figsize=(8.0, 0.5 * n + 1.8))
    ys = list(range(n))[::-1]
    span = max([abs(v) for it in items for v in it[3:5]] + [0.01])
    for y, (_, _, kind, lo, hi, err) in zip(ys, items):
        if kind == "measured":
            ax.barh(y, lo, 0.6, color=plot.BLUE if lo >= 0 else plot.ORANGE,
                    xerr=[[-err[0]], [err[1]]] if err else None, error_kw=plot._ERR)
            text = f"{lo * 100:+.1f} pts"
            edge = max(lo + (err[1] if err else 0), 0)
        else:
            near, far = (lo, hi) if abs(lo) <= abs(hi) else (hi, lo)
            ax.barh(y, near, 0.6, color=LIGHT)  # the whole band gains (or costs) this
            ax.barh(y, far - near, 0.6, left=near, color="white", edgecolor=plot.BLUE,
                    hatch="////", lw=0.8)  # what the link's bandwidth decides
            text = (f"{lo * 100:+.2f} to {hi * 100:+.2f} pts, predicted"
                    if hi - lo >= 5e-5 else f"{lo * 100:+.2f} pts, predicted")
            edge = max(hi, 0)
        ax.text(edge + span * 0.03, y, text.replace("-", "−"), va="center", fontsize=10)
    ax.axvline(0, color=plot.GREY, lw=0.8)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{num} · {title}" for num, title, *_ in items], fontsize=10)
    ax.tick_params(axis="y", length=0)
    lows = [min(it[3], it[3] + (it[5][0] if it[5] else 0)) for it in items]
    ax.set_xlim(min(lows + [0]) - span * 0.08, span * 1.75)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v * 100:+.0f}".replace("-", "−") if v else "0"))
    ax.set_xlabel("MFU (6N) with the switch on − off, points", fontsize=10)
    handles = [Patch(color=plot.BLUE, label="measured gain"),
               Patch(color=plot.ORANGE, label="measured cost"),
               Patch(color=LIGHT, label="predicted (several GPUs)"),
               Patch(facecolor="white", edgecolor=plot.BLUE, hatch="////",
                     label="range: NCCL-measured to datasheet NVLink"),
               plot._spread_handle()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2,
              fontsize=9, frameon=False)
    ax.set_title("What each switch buys: MFU on − off, measured on one H200 or "
                 "predicted for several", fontsize=10, loc="right")
    ax.spines[["top", "right"]].set_visible(False)
    ax.figure.tight_layout()
    return ax
