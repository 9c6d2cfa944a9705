"""Chapter 04: what gradient checkpointing costs in speed and buys in memory."""

from __future__ import annotations

import os

from colossal_lab.benchmarks.harness import Benchmark, flag, opt
from colossal_lab.benchmarks.steps import Setup, format_row, run_chapter, step_config
from colossal_lab.config import Switches, preset
from colossal_lab.measure.results import load_results
from colossal_lab.palette import BLUE, GREY, ORANGE
from colossal_lab.switches.checkpointing import GradientCheckpointConfig as Ckpt
from colossal_lab.training.memory import MemoryModel

NAME = "checkpointing"
RATIOS = (0.25, 0.5, 0.75)
FAST = Switches(enable_flash_attention=True, enable_fused_normalization="triton")
"""Switches 1-2, as chapter 02 left the step."""
FAST_7B = FAST.replace(enable_fused_projections=True, precision="bf16-pure")
"""Switches 1-3, bf16 parameters (fp32 masters in the optimizer) for the full 7B."""


def _sweep(name: str, label: str, config) -> Setup:
    return Setup(name, label, switches=FAST.replace(gradient_checkpoint_config=config),
                 find_largest_batch=True, warmup=2)


def _full_7b(name: str, label: str, config, batch: int, **kw) -> Setup:
    return Setup(name, label, preset="llama-7b", batch=batch,
                 switches=FAST_7B.replace(gradient_checkpoint_config=config),
                 warmup=2, **kw)


SWEEP = (
    _sweep("ckpt-none", "no checkpointing", None),
    *(_sweep(f"ckpt-{r}", f"ratio {r}: {r:.0%} of the layers recomputed",
             Ckpt(gradient_checkpointing_ratio=r)) for r in RATIOS),
    _sweep("ckpt-full", "ratio 1: every layer recomputed", Ckpt(gradient_checkpointing_ratio=1.0)),
    _sweep("ckpt-selective", "selective: keep GEMM outputs, recompute attention + element-wise",
           Ckpt(mode="selective")),
    _sweep("ckpt-elementwise", "selective: keep GEMM + attention outputs, recompute element-wise",
           Ckpt(mode="elementwise")),
)
FULL_7B = (
    _full_7b("7b-none-b1", "LLaMA-7B, no checkpointing, batch 1", None, 1),
    _full_7b("7b-none-b2", "LLaMA-7B, no checkpointing, batch 2", None, 2),
    _full_7b("7b-selective", "LLaMA-7B, selective recomputation, batch 2",
             Ckpt(mode="selective"), 2),
    _full_7b("7b-full", "LLaMA-7B, full recomputation, batch 2", Ckpt(), 2),
    _full_7b("7b-ratio-b3", "LLaMA-7B, fewest checkpointed layers that fit batch 3",
             Ckpt(gradient_checkpointing_ratio=1.0), 3, auto_ratio=True),
)
"""Each at a fixed batch, timed like the sweep: like-for-like pairs at batch 2 (none,
selective, full), batch 1 for reference, and batch 3, which does not fit without
checkpointing, with the fewest checkpointed layers the memory probes say fit."""
SETUPS = SWEEP + FULL_7B
SETUP_NAMES = tuple(s.name for s in SETUPS)
QUICK = ("ckpt-none", "ckpt-0.5", "ckpt-selective", "7b-ratio-b3")
"""The CPU smoke test: one of each kind (the Triton norm runs interpreted there)."""


def config_of(preset_name: str = "llama-7b-8l", seq_len: int = 4096, batch: int = 4) -> dict:
    return {**step_config(preset_name, seq_len, batch),
            "full_7b": {"preset": "llama-7b", "precision": "bf16-pure",
                        "switches": "flash attention, Triton RMSNorm, fused projections"},
            "allocator": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "largest_batch": "predicted from probes at two batches (peak = fixed + "
                             "batch x per-sample), verified by running it",
            "mfu": "6N per token; mfu_attn adds causal attention; hfu adds the "
                   "recomputed matmul FLOPs; mfu_colossalai counts 8N with checkpointing"}


GROUPS = {"sweep": SWEEP, "7b": FULL_7B}
"""Each group is one run and one results file (`file_name`), with its own provenance."""


def file_name(group: str) -> str:
    return NAME if group == "sweep" else f"{NAME}_{group}"


def load(gpu: str | None = None) -> list[dict]:
    """The rows of both groups' recorded files."""

    return [r for g in GROUPS for r in load_results(file_name(g), gpu).rows]


def run(quick: bool = False, *, setups=None, seq_len: int = 4096, batch: int = 4
        ) -> list[dict]:
    """Every setup side by side (`quick`: the tiny model on the CPU, in this process).

    Two groups of training steps, each setup in its own process (`benchmarks.steps`):

    1. `llama-7b-8l`, seq 4096, batch 4, bf16 autocast, switches 1-2 on: no checkpointing,
       ratios 0.25 / 0.5 / 0.75 / 1 (full recomputation) and the two selective modes. Each
       row carries tokens/s, MFU (6N), MFU (+attention), HFU (+ the recomputed FLOPs), what
       ColossalAI's evaluator would report (8N per token with checkpointing on), peak and
       activation memory, what one layer keeps, and the largest batch: predicted from two
       memory probes and verified by running it.
    2. Full LLaMA-7B (32 layers, 6.74B) on one GPU, bf16 parameters with fp32 master weights
       and optimizer states in the optimizer ("bf16-pure": ~100 GiB before any activation),
       switches 1-3 on: no checkpointing at batch 1 and 2, selective and full
       recomputation at batch 2, and at batch 3 the fewest checkpointed layers that fit
       (chosen from memory probes).

        python -m colossal_lab bench checkpointing --group sweep   # ~5 min on one H200
        python -m colossal_lab bench checkpointing --group 7b      # ~4 min
        python -m colossal_lab bench checkpointing --quick         # tiny model, CPU, seconds
    """
    chosen = [s for s in SETUPS if s.name in (setups or (QUICK if quick else SETUP_NAMES))]
    if not quick:  # the largest batch should be bounded by memory, not by fragmentation
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return run_chapter(NAME, chosen, quick, seq_len=seq_len, batch=batch)


def summary(rows: list[dict]) -> str:
    return "\n".join(format_row(r) for r in rows)


# ------------------------------------------------------------- reading the results


def ok_rows(rows: list[dict], names=None) -> dict[str, dict]:
    """Rows that ran, by setup name (in `names` order when given)."""
    by = {r["setup"]: r for r in rows if "error" not in r}
    return {n: by[n] for n in (names or by) if n in by}


def versus_none(rows: list[dict], baseline: str = "ckpt-none") -> list[dict]:
    """Each sweep row with its activation memory and tokens/s relative to no
    checkpointing (`act_saving`: fraction of activation memory saved; `slowdown`:
    fraction of tokens/s lost)."""
    by = ok_rows(rows)
    base = by.get(baseline)
    out = []
    for name in (s.name for s in SWEEP):
        r = by.get(name)
        if r is None:
            continue
        r = dict(r)
        if base is not None:
            r["slowdown"] = 1 - r["tokens_per_s"] / base["tokens_per_s"]
            a, a0 = r.get("activation_mem_gib"), base.get("activation_mem_gib")
            r["act_saving"] = 1 - a / a0 if a is not None and a0 else None
            s, s0 = r.get("saved_mem_gib"), base.get("saved_mem_gib")
            r["saved_saving"] = 1 - s / s0 if s is not None and s0 else None
        out.append(r)
    return out


def memory_model(rows: list[dict], none: str = "ckpt-none", full: str = "ckpt-full"):
    """`memory.MemoryModel` from two measured rows (their fixed and per-sample
    memory); None when the rows lack the probes (a CPU run)."""

    by = ok_rows(rows)
    a, b = by.get(none), by.get(full)
    keys = ("mem_fixed_gib", "mem_per_sample_gib", "mem_capacity_gib")
    if a is None or b is None or any(a.get(k) is None or b.get(k) is None for k in keys):
        return None
    return MemoryModel(fixed_gib=max(a["mem_fixed_gib"], b["mem_fixed_gib"]),
                       per_sample_none_gib=a["mem_per_sample_gib"],
                       per_sample_full_gib=b["mem_per_sample_gib"],
                       num_layers=preset(a["preset"]).num_hidden_layers,
                       capacity_gib=min(a["mem_capacity_gib"], b["mem_capacity_gib"]))


def plot_tradeoff(rows: list[dict], *, memory: str = "activation_mem_gib", ax=None):
    """Memory against tokens/s for each sweep setup: the ratios joined by a line from no
    checkpointing to full recomputation, the selective modes as separate points."""
    import matplotlib.pyplot as plt  # lazy: plotting only, optional for a run


    pts = [r for r in versus_none(rows) if r.get(memory) is not None]
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    line = [r for r in pts if r.get("ckpt_mode") in (None, "full")]
    line.sort(key=lambda r: r["ckpt_ratio"])
    ax.plot([r["tokens_per_s"] for r in line], [r[memory] for r in line], "-o", color=BLUE,
            label="ratio 0 → 1 (full recomputation)")
    for r in pts:
        sel = r.get("ckpt_mode") in ("selective", "elementwise")
        if sel:
            ax.plot(r["tokens_per_s"], r[memory], "s", color=ORANGE, ms=8)
        text = r["ckpt_mode"] if sel else (f"ratio {r['ckpt_ratio']:g}")
        ax.annotate(text, (r["tokens_per_s"], r[memory]), textcoords="offset points",
                    xytext=(6, 4), fontsize=9, color=ORANGE if sel else GREY)
    ax.plot([], [], "s", color=ORANGE, label="selective modes (every layer)")
    ax.set_xlabel("tokens/s")
    ax.set_ylabel({"activation_mem_gib": "activation memory (GiB)",
                   "saved_mem_gib": "kept by the forward (GiB)"}.get(memory, memory))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=9, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def plot_largest_batch(rows: list[dict], ax=None):
    """Largest batch per setup: predicted from the probes and verified by running it."""
    import matplotlib.pyplot as plt  # lazy: plotting only, optional for a run


    pts = [r for r in rows if "error" not in r and r.get("largest_batch_predicted")]
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 0.45 * len(pts) + 1.2))
    y = range(len(pts))[::-1]
    for yi, r in zip(y, pts):
        ax.barh(yi + 0.2, r["largest_batch_predicted"], 0.38, color=GREY,
                label="predicted" if yi == len(pts) - 1 else None)
        v = r.get("largest_batch")
        if v:
            ax.barh(yi - 0.2, v, 0.38, color=BLUE, label="verified" if yi == len(pts) - 1
                    else None)
            tps = r.get("largest_batch_tokens_per_s")
            note = f"{v}" + (f"  {tps:,.0f} tok/s" if tps else "")
            ax.text(v + 0.2, yi - 0.2, note, va="center", fontsize=9)
        else:
            ax.text(0.2, yi - 0.2, f"not verified: {r.get('largest_batch_note', '')}",
                    va="center", fontsize=9, color=ORANGE)
    ax.set_yticks(list(y))
    ax.set_yticklabels([f"{r['setup']} ({r['preset']})" for r in pts])
    ax.set_xlabel("sequences per step")
    if pts:
        ax.legend(fontsize=9, frameon=False, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def _run_group(a) -> list[dict]:
    names = [s.name for s in GROUPS[a.group]]
    if a.quick:
        return run(True, setups=[n for n in QUICK if n in names] or None)
    return run(setups=names, seq_len=a.seq_len, batch=a.batch)


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny model on the CPU, in this process, not saved",
    options=[flag("seq_len"), flag("batch", help="batch of the 8-layer sweep"),
             opt("--group", choices=list(GROUPS), default="sweep",
                 help="which group of setups (one results file each)")],
    run=_run_group, file_name=lambda a: file_name(a.group),
    config=lambda a: config_of(seq_len=a.seq_len, batch=a.batch))
main = BENCH.main


if __name__ == "__main__":
    main()
