"""The attention benchmark runs end to end on tiny shapes (CPU smoke test; no speed claims)."""

from __future__ import annotations

import pytest
import torch

from colossal_lab.benchmarks import flash_attention as bench_fa


def test_flops_convention():
    # 4·B·H·S²·D, halved when causal; fwd+bwd counts 3.5× that
    assert bench_fa.attention_flops(4, 32, 4096, 128, causal=False) == 4 * 4 * 32 * 4096**2 * 128
    assert bench_fa.attention_flops(4, 32, 4096, 128, causal=True) == pytest.approx(
        0.5 * bench_fa.attention_flops(4, 32, 4096, 128, causal=False))
    assert bench_fa.FWD_BWD_FACTOR == 3.5
    # the sweep keeps B·S and H·D fixed; naive is skipped where it would not fit
    assert bench_fa.naive_gib(4, 32, 4096) < bench_fa.NAIVE_LIMIT_GIB
    assert bench_fa.naive_gib(2, 32, 8192) > bench_fa.NAIVE_LIMIT_GIB


def test_quick_run_rows(capsys):
    rows = bench_fa.run(quick=True)
    speed = [r for r in rows if r["kind"] == "speed"]
    assert {r["provider"] for r in speed} == set(bench_fa.QUICK_PROVIDERS)
    assert {r["causal"] for r in speed} == {True, False}
    fields = ("provider", "batch", "heads", "kv_heads", "seq_len", "head_dim", "causal",
              "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops")
    for r in speed:
        assert "error" not in r, r
        for f in fields:
            assert f in r, (f, r)
        for f in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops"):
            assert r[f] > 0, (f, r)
        assert r["batch"] * r["seq_len"] == 64
        # every provider computes the same attention (fp32 on CPU)
        assert r["max_abs_err_vs_fp32"] < (1e-4 if not torch.cuda.is_available() else 1e-2)
    table = bench_fa.summary(rows)
    assert "triton" in table and "naive" in table
    capsys.readouterr()


def test_main_saves_with_provenance(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    bench_fa.main(["--quick", "--out-name", "fa_smoke", "--seq-lens", "32",
                   "--providers", "naive", "triton"])
    from colossal_lab.results import load_results, results_dir

    (path,) = list(results_dir().glob("*/fa_smoke.json"))
    res = load_results("fa_smoke", gpu=path.parent.name)
    assert "bench flash_attention" in res.provenance["command"]
    assert {r["provider"] for r in res.rows} == {"naive", "triton"}
    assert res.config["flops_fwd_bwd"] == "3.5 x fwd"
