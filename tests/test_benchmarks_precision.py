"""The precision benchmark runs end to end on a CPU (tiny shapes, fp8 emulation) and
its rows carry every field the book reads. No speed is asserted here."""

import json

import pytest

from colossal_lab.benchmarks import precision


@pytest.fixture(scope="module")
def rows(tmp_path_factory, few_cpu_reps):
    import os

    # a cache of this module's own, set for this run only: a bare os.environ.setdefault
    # left it set for every later test of the same process (which differ under xdist)
    with pytest.MonkeyPatch.context() as mp:
        if "COLOSSAL_LAB_CACHE" not in os.environ:
            mp.setenv("COLOSSAL_LAB_CACHE", str(tmp_path_factory.mktemp("cache")))
        return precision.run(quick=True)


def test_gemm_rows(rows):
    gemm = [r for r in rows if r["kind"] == "gemm"]
    assert {r["provider"] for r in gemm} == set(precision.GEMM_PROVIDERS)
    for r in gemm:
        assert "error" not in r, r
        assert r["tflops"] > 0 and r["ms"] > 0
        if r["provider"] in ("fp8_scaled_mm", "fp8_linear", "fp8_linear_delayed"):
            assert r["speedup_vs_bf16"] > 0


def test_step_rows(rows):
    steps = [r for r in rows if r["kind"] == "step"]
    assert {r["setup"] for r in steps} >= {"fp32", "bf16", "bf16-pure", "fp16", "fp8"}
    for r in steps:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["mfu_peak"]
    assert all(r["mfu_note"] == "vs bf16 peak" for r in steps if r["setup"] == "fp8")


def test_curve_rows(rows):
    curves = {r["setup"]: r for r in rows if r["kind"] == "loss_curve"}
    assert set(curves) == {"fp32", "bf16", "fp8", "fp8-delayed"}
    for r in curves.values():
        assert len(r["losses"]) == r["steps"] and r["final_loss"] > 0
    assert curves["bf16"]["rel_diff_vs_bf16"] == 0.0
    assert abs(curves["fp8"]["rel_diff_vs_bf16"]) < 0.05
    assert "precision summary" in precision.summary(rows)
    json.dumps(rows)


def test_setups_cover_every_precision():
    from colossal_lab.precision import PRECISIONS

    # fp8-pure (fp8 linears over bf16-pure storage) is a composition: the finale's
    # `composed` times it beside ours-fp8
    assert {s.switches.precision for s in precision.SETUPS} == set(PRECISIONS) - {
        "fp8-pure"}
