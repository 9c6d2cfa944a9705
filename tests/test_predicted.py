"""The predicted MFU of the multi-GPU switches (`book.predicted`): on the recorded H200
costs, on the CPU."""

import matplotlib
import pytest

matplotlib.use("Agg")

from colossal_lab.book import predicted as pr  # noqa: E402
from colossal_lab.measure import results  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    matplotlib.pyplot.close("all")


def test_band_ends_are_ordered():
    for kind, low in pr.NVLINK.low.items():
        assert 0 < low.gbps < pr.NVLINK.high.gbps, kind


@pytest.mark.parametrize("chapter", sorted(pr.PREDICTIONS))
def test_slower_link_never_predicts_more(chapter):
    pred = pr.PREDICTIONS[chapter](gpu="h200", measured=[])
    assert len(pred.bars) >= 2
    for b in pred.bars:
        assert b.measured is None
        assert 0 < b.low <= b.high < 1, b
    lo, hi = pred.delta()
    assert lo == pred.bar(pred.on).low - pred.bar(pred.off).low
    ax = pr.mfu_delta_band(pred)
    assert "predicted" in ax.get_title()


def _fake(name, rows):
    return results.Results(name, {"gpu": "NVIDIA H200"}, rows, {}, None)


def test_measured_rows_replace_the_prediction():
    rows = [{"backend": b, "world": 2, "preset": "llama-7b-8l", "link": "nvlink",
             "step_ms": ms, "step_ms_p10": ms * 0.99, "step_ms_p90": ms * 1.02,
             "tokens_per_s": 16384 / (ms / 1e3), "mfu": mfu}
            for b, ms, mfu in (("naive", 340.0, 0.55), ("overlap", 330.0, 0.57))]
    pred = pr.overlap_allreduce(gpu="h200", measured=[_fake("grad_overlap_measured",
                                                            rows)])
    assert pred.measured
    assert pred.bar(pred.off).measured["mfu"] == 0.55
    assert pred.delta() == pytest.approx((0.02, 0.02))
    off = pred.bar(pred.off).measured
    assert off["mfu_p10"] < off["mfu"] < off["mfu_p90"]
    ax = pr.mfu_delta_band(pred)
    assert "measured" in ax.get_title() and "predicted" not in ax.get_title()


def test_a_measured_row_of_another_setting_leaves_the_prediction():
    rows = [{"schedule": "1f1b", "p": 2, "m": 8, "step_ms": 100.0, "tokens_per_s": 1e4,
             "preset": "llama-7b"}]
    pred = pr.pipeline(gpu="h200", measured=[_fake("pipeline_measured", rows)])
    assert not any(b.measured for b in pred.bars)


def test_exact_optimizer_picks_by_what_ran():
    peer = {"setup": "hf-liger", "precision": "bf16", "norm_backend": "liger",
            "preset": "p", "seq_len": 8, "batch": 2, "mfu": 0.5}
    old = [peer, {"setup": "ours-bf16", "precision": "bf16-pure",
                  "optimizer_moments": "bf16", "preset": "p", "seq_len": 8, "batch": 2},
           {"setup": "ours-bf16-m32", "precision": "bf16-pure",
            "optimizer_moments": "fp32", "preset": "p", "seq_len": 8, "batch": 2}]
    assert pr.exact_optimizer(old)[0]["setup"] == "ours-bf16-m32"
    new = [peer, {"setup": "ours-bf16", "precision": "bf16-pure",
                  "optimizer_moments": "fp32", "preset": "p", "seq_len": 8, "batch": 2},
           {"setup": "ours-bf16-graph", "precision": "bf16-pure", "graph_captures": 1,
            "optimizer_moments": "fp32", "preset": "p", "seq_len": 8, "batch": 2}]
    ours, got_peer = pr.exact_optimizer(new)
    assert ours["setup"] == "ours-bf16" and got_peer is peer
