import matplotlib

matplotlib.use("Agg")

from colossal_lab import plot  # noqa: E402


def test_mfu_delta_draws_every_row():
    rows = [{"setup": "a", "label": "naive", "mfu": 0.1, "mfu_attn": 0.11, "tokens_per_s": 10},
            {"setup": "b", "label": "fast", "mfu": 0.4, "mfu_attn": 0.44, "tokens_per_s": 40},
            {"setup": "c", "label": "broken", "error": "out of memory"}]
    ax = plot.mfu_delta(rows, baseline="a", title="t")
    texts = [t.get_text() for t in ax.texts]
    assert any("×4.00" in t for t in texts)
    assert any("out of memory" in t for t in texts)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["naive", "fast", "broken"]


def test_grouped_bars():
    ax = plot.grouped_bars(["1k", "2k"], {"x": [1, 2], "y": [2, 3]}, ylabel="TFLOP/s",
                           ceiling=4)
    assert len(ax.patches) == 4


def test_series_one_line_per_provider():
    rows = [{"provider": p, "seq_len": s, "tflops": s * k}
            for p, k in (("a", 1), ("b", 2)) for s in (512, 1024, 4096)]
    rows.append({"provider": "c", "seq_len": 512, "skipped": "memory"})
    ax = plot.series(rows, x="seq_len", y="tflops", ylabel="TFLOP/s", ceiling=9000,
                     highlight="b")
    assert [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")] \
        == ["a", "b"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1k", "4k"]


def test_mfu_delta_spread_bars():
    """p10-p90 of the step time becomes an MFU interval (MFU ∝ 1 / step time), drawn
    as error bars and named in the legend; rows without a spread get none."""
    row = {"setup": "a", "mfu": 0.5, "mfu_attn": 0.55, "tokens_per_s": 10, "batch": 4,
           "step_ms": 100.0, "step_ms_p10": 80.0, "step_ms_p90": 125.0}
    lo, hi = plot.mfu_spread(row)
    assert lo[0] == 0.5 - 0.4 and abs(hi[0] - (0.625 - 0.5)) < 1e-12
    assert plot.mfu_spread({"mfu": 0.5}) is None
    ax = plot.mfu_delta([row])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "p10–p90 of the step time" in labels
    ax = plot.mfu_delta([{k: v for k, v in row.items() if "p10" not in k and "p90" not in k}])
    assert "p10–p90 of the step time" not in [t.get_text() for t in
                                             ax.get_legend().get_texts()]
    assert ax.figure.get_size_inches()[0] <= 9
