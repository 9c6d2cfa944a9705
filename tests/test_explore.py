"""The MFU calculator: its formula, verdicts, widget and static figure."""

import matplotlib
import pytest

matplotlib.use("Agg")

from colossal_lab.book import explore
from colossal_lab.config import preset  # noqa: E402
from colossal_lab.measure import mfu


def test_mfu_6n_matches_the_meter():
    """The calculator's formula is `mfu.step_stats`'s 6N MFU."""
    cfg = preset("llama-7b-8l")
    stats = mfu.step_stats(cfg, batch=4, seq_len=4096, step_time_s=0.38, peak_tflops=989.4)
    got = explore.mfu_6n(mfu.count_params(cfg), 4 * 4096, 380.0, 989.4)
    assert got == pytest.approx(stats.mfu, rel=1e-12)
    with pytest.raises(ValueError):
        explore.mfu_6n(1e9, 1, 0.0, 1.0)


def test_verdicts():
    assert explore.verdict(0.56).startswith("excellent")
    assert explore.verdict(0.52).startswith("good")
    assert explore.verdict(0.3).startswith("below")
    assert explore.verdict(1.2).startswith("impossible")


def test_widget_recomputes():
    pytest.importorskip("ipywidgets")
    box = explore.mfu_calculator(n_params_b=1.0, tokens=1000, step_ms=6.0,
                                 gpu="NVIDIA A100")
    out = box.children[-1]
    first = out.value
    assert "MFU" in first and "312" in first
    box.children[2].value = 12.0  # twice the step time: half the MFU
    m1 = explore.mfu_6n(1e9, 1000, 6.0, 312.0)
    assert f"{m1 / 2:.1%}" in out.value and out.value != first


def test_static_figure_one_line_per_peak():
    ax = explore.plot_mfu_vs_step_time(1.88e9, 16384, measured=[("ours", 380.0, 0.47)])
    labels = [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert len(labels) == 3  # A100, H100 / H200 (one peak), B200
    assert any("H100 / H200" in s for s in labels)
    assert ax.figure.get_size_inches()[0] <= 9
    assert any(t.get_text() == "ours" for t in ax.texts)
