"""The book's explorers: widgets where moving a slider beats reading a table.

Each explorer comes in two forms: an ipywidgets control that recomputes as you drag,
when the notebook runs in Jupyter, and a static figure of the same calculation, which
is what the rendered book shows (a widget needs a live kernel).

`mfu_calculator` (chapter 00): MFU from the model's parameter count, the tokens of one
step, the step time and the GPU's dense datasheet peak, the tutorial's formula
MFU = 6 · N · tokens / (step time · peak).
"""

from __future__ import annotations

from colossal_lab.measure import hardware
from colossal_lab.palette import GREY

SEED_GOOD, SEED_EXCELLENT = 0.50, 0.55
"""The tutorial's verdicts for LLaMA-7B: above 50% MFU is good, above 55% excellent."""


def mfu_6n(n_params: float, tokens: int, step_ms: float, peak_tflops: float) -> float:
    """The tutorial's MFU: 6 · N · tokens of model FLOPs per step over what the peak
    could do in the step time."""
    if step_ms <= 0 or peak_tflops <= 0:
        raise ValueError(f"step_ms={step_ms} and peak_tflops={peak_tflops} must be > 0")
    return 6.0 * n_params * tokens / (step_ms / 1e3) / (peak_tflops * 1e12)


def gpu_peaks(dtype: str = "bf16") -> dict[str, float]:
    """GPU name -> dense datasheet peak (TFLOP/s) for `dtype`, from `hardware.GPUS`."""
    return {g.name: getattr(g, dtype) for g in hardware.GPUS if getattr(g, dtype)}


def verdict(mfu: float) -> str:
    """What the tutorial would call it."""
    if mfu > 1:
        return "impossible: above the datasheet peak (count or time is wrong)"
    if mfu > SEED_EXCELLENT:
        return "excellent by the tutorial's bar (> 55%)"
    if mfu > SEED_GOOD:
        return "good by the tutorial's bar (> 50%)"
    return "below the tutorial's 50% bar"


def mfu_calculator(n_params_b: float = 1.88, tokens: int = 16384, step_ms: float = 380.0,
                   gpu: str = "NVIDIA H200"):
    """An ipywidgets MFU calculator (parameters in billions, tokens per step, step time
    in ms, GPU); returns the widget box. Needs ipywidgets and a live kernel."""
    import ipywidgets as w

    peaks = gpu_peaks()
    n = w.FloatSlider(value=n_params_b, min=0.1, max=100.0, step=0.01,
                      description="N (billions)", readout_format=".2f")
    t = w.IntSlider(value=tokens, min=512, max=1 << 20, step=512,
                    description="tokens/step")
    ms = w.FloatLogSlider(value=step_ms, base=10, min=0, max=5, step=0.01,
                          description="step (ms)")
    g = w.Dropdown(options=list(peaks), value=gpu if gpu in peaks else next(iter(peaks)),
                   description="GPU")
    out = w.HTML()

    def update(*_):
        m = mfu_6n(n.value * 1e9, t.value, ms.value, peaks[g.value])
        out.value = (f"<b>MFU {m:.1%}</b> = 6 × {n.value:.2f}e9 × {t.value:,} / "
                     f"({ms.value:,.1f} ms × {peaks[g.value]:g} TFLOP/s) — {verdict(m)}")

    for control in (n, t, ms, g):
        control.observe(update, names="value")
    update()
    return w.VBox([n, t, ms, g, out])


def plot_mfu_vs_step_time(n_params: float, tokens: int, *, gpus: list[str] | None = None,
                          measured: list[tuple[str, float, float]] = (), title: str = "",
                          ax=None):
    """The calculator as a figure: MFU (6N) against step time for each GPU's bf16 peak,
    with the tutorial's 50% and 55% bars and `measured` points (label, step ms, MFU)."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    peaks = gpu_peaks()
    gpus = gpus or [name for name in ("NVIDIA A100", "NVIDIA H100", "NVIDIA H200",
                                      "NVIDIA B200") if name in peaks]
    by_peak: dict[float, list[str]] = {}  # GPUs with one datasheet peak share a line
    for gp in gpus:
        by_peak.setdefault(peaks[gp], []).append(gp.removeprefix("NVIDIA "))
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.2))
    at_peak = [6.0 * n_params * tokens / (p * 1e12) * 1e3 for p in by_peak]  # ms at 100%
    ms = np.geomspace(min(at_peak) * 0.9, max(at_peak) * 12, 200)
    for peak, names in sorted(by_peak.items()):
        ax.plot(ms, [mfu_6n(n_params, tokens, x, peak) for x in ms], lw=1.6,
                label=f"{' / '.join(names)} ({peak:g} TFLOP/s bf16)")
    for level, what in ((SEED_GOOD, "seed: good"), (SEED_EXCELLENT, "seed: excellent")):
        ax.axhline(level, color=GREY, ls="--", lw=0.8)
        ax.text(ms[-1], level, what, ha="right", va="bottom", fontsize=9, color=GREY)
    for label, step, m in measured:
        ax.plot(step, m, "o", color="black", ms=5, zorder=3)
        ax.annotate(label, (step, m), textcoords="offset points", xytext=(6, 5), fontsize=9)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("MFU (6N)")
    ax.set_title(title or f"N = {n_params / 1e9:.2f}B, {tokens:,} tokens per step",
                 fontsize=11)
    ax.legend(fontsize=9, frameon=False, loc="upper right")
    ax.spines[["top", "right"]].set_visible(False)
    plt.tight_layout()
    return ax
