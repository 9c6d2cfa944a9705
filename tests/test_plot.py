import matplotlib
import pytest

matplotlib.use("Agg")

from colossal_lab.book import plot


@pytest.fixture(autouse=True)
def _close_figures():
    """Each test's figures closed after it: pyplot keeps every open figure."""
    yield
    matplotlib.pyplot.close("all")


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


def _waterfall_rows():
    """Synthetic waterfall rows: three bars of ours (one failed), two peers."""
    def row(setup, tps, peak=None, act=None):
        ms = 4 * 4096 / tps * 1e3
        return {"setup": setup, "label": setup, "tokens_per_s": tps, "mfu": tps / 1e5,
                "mfu_attn": tps / 9e4, "step_ms": ms, "step_ms_p10": ms * 0.98,
                "step_ms_p90": ms * 1.02, "batch": 4, "seq_len": 4096, "steps_timed": 20,
                "peak_mem_gib": peak, "activation_mem_gib": act}

    return [row("naive-fp32", 10_000, 100.0, 60.0), row("+bf16", 20_000, 80.0, 50.0),
            row("+attention", 20_100, 79.0, 49.0),
            {"setup": "+norm", "error": "out of memory", "batch": 4, "seq_len": 4096},
            row("+rope", 25_000, 78.0, 48.0), row("hf-sdpa", 15_000, 70.0, 40.0),
            row("hf-liger", 30_000, 50.0, 20.0)]


def test_waterfall_bars_peers_and_memory():
    ax, mx = plot.waterfall(_waterfall_rows(), title="t", capacity_gib=140)
    assert ax.figure.get_size_inches()[0] <= 9
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["naive-fp32", "+bf16", "+attention", "+norm", "+rope", "hf-sdpa",
                      "hf-liger"]
    ticks = list(ax.get_yticks())
    assert ticks == sorted(ticks, reverse=True)  # top to bottom in the rows' order
    assert ticks[4] - ticks[5] > 1  # the peers are set apart
    texts = [t.get_text() for t in ax.texts]
    assert any("out of memory" in t for t in texts)
    assert "10.0% MFU" in texts  # the first bar: nothing above it to compare with
    assert "20.0% MFU  ×2.00" in texts  # +bf16 over naive-fp32
    assert any("(level)" in t for t in texts)  # +attention against +bf16: in the spread
    assert "25.0% MFU" in texts  # below a failed bar: two switches apart, no ratio
    assert "30.0% MFU" in texts  # peers: MFU only
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert len(bars) == 6
    hatched = [p for p in bars if p.get_hatch()]
    assert sorted(p.get_width() for p in hatched) == [15_000, 30_000]
    assert ax.get_legend() is not None
    widths = sorted(p.get_width() for p in mx.patches)  # peak and activations per bar
    assert widths == sorted([100, 60, 80, 50, 79, 49, 78, 48, 70, 40, 50, 20])
    assert [t.get_text() for t in mx.texts] == ["100", "80", "79", "78", "70", "50"]


def test_a_bar_outside_the_chain_is_compared_with_its_base():
    """A bar named in `outside` is compared with its base, not the bar above, and the
    next bar of the chain is still compared with the last chain bar."""
    rows = _waterfall_rows()
    extra = dict(rows[1], setup="bf16+compile", label="bf16+compile", tokens_per_s=40_000,
                 mfu=0.4, step_ms=rows[1]["step_ms"] / 2, step_ms_p10=rows[1]["step_ms"] / 2.05,
                 step_ms_p90=rows[1]["step_ms"] / 1.95)
    rows = rows[:2] + [extra] + rows[2:]
    bases = plot.chain_bases(rows, outside={"bf16+compile": "+bf16"})
    names = [b and b["setup"] for b in bases]
    assert names == [None, "naive-fp32", "+bf16", "+bf16", None, None, None, None]
    ax, _ = plot.waterfall(rows, outside={"bf16+compile": "+bf16"})
    texts = [t.get_text() for t in ax.texts]
    assert "40.0% MFU  ×2.00 vs +bf16" in texts
    assert any(t.startswith("20.1% MFU") and "(level)" in t for t in texts)


def test_waterfall_without_memory_has_one_panel():
    rows = [{k: v for k, v in r.items() if "mem" not in k} for r in _waterfall_rows()]
    axes = plot.waterfall(rows, peers=("hf-liger",))
    assert len(axes) == 1
    hatched = [p for p in axes[0].patches if p.get_hatch()]
    assert [p.get_width() for p in hatched] == [30_000]  # only the peer named


def test_running_mean_and_loss_curves():
    assert plot.running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert plot.running_mean([4.0, 2.0], 10) == [4.0, 3.0]
    rows = [{"setup": s, "losses": [10.0 / (i + 1) + k for i in range(30)]}
            for k, s in ((0.0, "naive"), (0.01, "best"), (0.02, "naive-seed1"))]
    ax, dax = plot.loss_curves(rows, window=5, reference="naive")
    assert [ln.get_label() for ln in ax.get_lines()] == ["naive", "best", "naive-seed1"]
    diffs = [ln for ln in dax.get_lines() if ln.get_label() in ("best", "naive-seed1")]
    assert [round(float(ln.get_ydata()[-1]), 6) for ln in diffs] == [0.01, 0.02]
    assert ax.figure.get_size_inches()[0] <= 9
    (only,) = plot.loss_curves(rows[:1])
    assert len(only.get_lines()) == 1


def _sweep_rows():
    """Synthetic attention-sweep rows: ours and cuDNN at two S, two (D, layout, causal)
    rows; cuDNN failed at one point, has no row at another."""
    def row(provider, s, d, kv, causal, fwd, all_):
        return {"kind": "speed", "provider": provider, "batch": 16384 // s, "heads": 32,
                "kv_heads": kv, "seq_len": s, "head_dim": d, "causal": causal,
                "fwd_tflops": fwd, "fwd_bwd_tflops": all_}

    return [row("triton", 1024, 128, 32, True, 400, 300),
            row("cudnn", 1024, 128, 32, True, 500, 300),
            row("triton", 4096, 128, 32, True, 450, 360),
            row("cudnn", 4096, 128, 32, True, 400, 400),
            row("flex", 4096, 128, 32, True, 380, 350),
            row("triton", 1024, 128, 8, False, 420, 330),
            {**row("cudnn", 1024, 128, 8, False, 0, 0), "fwd_tflops": None,
             "fwd_bwd_tflops": None, "error": "RuntimeError: No available kernel"},
            row("triton", 4096, 128, 8, False, 430, 340),
            {"kind": "memory", "provider": "triton", "seq_len": 4096, "peak_mem_gib": 1.0}]


def test_ratio_heatmap_annotates_ratios_and_hatches_missing_cells():
    fwd, both = plot.ratio_heatmap(_sweep_rows())
    assert fwd.figure.get_size_inches()[0] <= 9
    assert [t.get_text() for t in fwd.get_xticklabels()] == ["1k", "4k"]
    assert [t.get_text() for t in fwd.get_yticklabels()] == ["D=128 mha causal",
                                                             "D=128 gqa4 full"]
    texts = [t.get_text() for t in fwd.texts]  # row by row, S across
    assert texts == ["0.80", "1.12", "err", "–"]
    assert [t.get_text() for t in both.texts] == ["1.00", "0.90", "err", "–"]
    hatched = [p for p in fwd.patches if p.get_hatch()]
    assert sorted((p.get_x() + 0.5, p.get_y() + 0.5) for p in hatched) == [(0, 1), (1, 1)]
    # the colour scale is centred at 1.0
    norm = fwd.images[0].norm
    assert norm.vcenter == 1.0
    (only,) = plot.ratio_heatmap(_sweep_rows(), "flex", "cudnn", metric="fwd")
    assert [t.get_text() for t in only.texts] == ["–", "0.95", "err", "–"]


def test_tflops_lines_one_line_per_provider_per_panel():
    (ax,) = plot.tflops_lines(_sweep_rows())
    assert ax.figure.get_size_inches()[0] <= 9
    lines = {ln.get_label(): list(ln.get_xdata()) for ln in ax.get_lines()}
    assert lines == {"triton": [1024, 4096], "cudnn": [1024, 4096], "flex": [4096]}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "4k"]
    assert ax.get_title() == "D=128 mha causal"
    grid = plot.tflops_lines(_sweep_rows(), [
        {"head_dim": 128, "layout": "mha", "causal": True},
        {"head_dim": 128, "layout": "gqa4", "causal": False}], metric="fwd",
        providers=("triton", "cudnn"))
    assert len(grid) == 2
    gqa = {ln.get_label(): list(ln.get_ydata()) for ln in grid[1].get_lines()}
    assert gqa == {"triton": [420, 430]}  # cuDNN failed there: no line
    assert grid[0].figure.get_size_inches()[0] <= 9
    (legend,) = grid[0].figure.legends  # one for every panel
    assert [t.get_text() for t in legend.get_texts()] == ["triton", "cudnn"]


def test_norm_ratio_heatmap_panels_per_dtype_and_timing():
    """torch time / ours per (tokens, hidden): a panel per dtype and timing present,
    skipped and failed cells marked, the ratio annotated."""
    def row(p, t, h, d, ms, eager=None, **kw):
        r = {"kind": "op", "op": "rms_norm", "provider": p, "tokens": t, "hidden": h,
             "dtype": d, "fwd_bwd_ms": ms, **kw}
        if eager is not None:
            r["eager_fwd_bwd_ms"] = eager
        return r

    rows = [row("triton", 4096, 4096, "bfloat16", 1.0, 2.0),
            row("torch", 4096, 4096, "bfloat16", 1.5, 1.0),
            row("triton", 4096, 5120, "bfloat16", 2.0, 2.0),
            row("torch", 4096, 5120, "bfloat16", 1.6, 2.2),
            {"kind": "op", "op": "rms_norm", "provider": "triton", "tokens": 65536,
             "hidden": 4096, "dtype": "float32", "skipped": "memory"},
            row("triton", 4096, 4096, "float32", 2.0),
            row("torch", 4096, 4096, "float32", 3.0),
            {"kind": "ceiling", "copy_gbps": 4000.0}]
    axes = plot.norm_ratio_heatmap(rows)
    assert [ax.get_title() for ax in axes] == ["bfloat16, graph replay", "bfloat16, eager",
                                               "float32, graph replay"]
    texts = [[t.get_text() for t in ax.texts] for ax in axes]
    assert "1.50" in texts[0] and "0.80" in texts[0]  # 1.5 / 1.0 and 1.6 / 2.0
    assert "0.50" in texts[1] and "1.10" in texts[1]
    assert "skip" in texts[2] and "1.50" in texts[2]
    assert axes[0].figure.get_size_inches()[0] <= 9
    with pytest.raises(ValueError, match="no layer_norm rows"):
        plot.norm_ratio_heatmap(rows, op="layer_norm")


def test_tradeoff_labels_clear_of_each_other_and_the_markers():
    rows = [{"setup": "ckpt-none", "ckpt_mode": None, "ckpt_ratio": 0.0, "step_ms": 100.0,
             "tokens_per_s": 41800, "activation_mem_gib": 33.3, "batch": 4},
            {"setup": "ckpt-0.5", "ckpt_mode": "full", "ckpt_ratio": 0.5, "step_ms": 112.0,
             "tokens_per_s": 37300, "activation_mem_gib": 21.4, "batch": 4},
            {"setup": "ckpt-full", "ckpt_mode": "full", "ckpt_ratio": 1.0, "step_ms": 124.0,
             "tokens_per_s": 33600, "activation_mem_gib": 10.5, "batch": 4},
            {"setup": "ckpt-selective", "ckpt_mode": "selective", "ckpt_ratio": 1.0,
             "step_ms": 109.0, "tokens_per_s": 38400, "activation_mem_gib": 19.9,
             "batch": 4},
            {"setup": "ckpt-elementwise", "ckpt_mode": "elementwise", "ckpt_ratio": 1.0,
             "step_ms": 106.0, "tokens_per_s": 39200, "activation_mem_gib": 20.9,
             "batch": 4}]
    ax = plot.tradeoff(rows)
    fig = ax.figure
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(r) for t in ax.texts]
    assert len(boxes) == 5
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1:])
    marks = [ax.transData.transform((x, y)) for x, y in
             ((row["tokens_per_s"], row["activation_mem_gib"]) for row in rows)]
    for box in boxes:
        assert not any(box.contains(x, y) for x, y in marks)
