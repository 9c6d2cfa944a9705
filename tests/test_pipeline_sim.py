"""`bench pipeline_sim`: the CPU smoke test of the F/B/W measurement, and the simulation
rows against the closed forms when the costs are the textbook ones."""

from __future__ import annotations

import pytest

from colossal_lab import benchmarks
from colossal_lab.benchmarks import pipeline_sim as ps


def synthetic(f=1.0, b=1.0, w=1.0, head=0.0, layers=32, act_mib=10.0) -> list[dict]:
    """Measured rows as the benchmark writes them, with chosen costs (ms)."""
    def part(name, scale):
        row = {"kind": "measure", "part": name, "micro_batch": 1, "seq_len": 4096,
               "layers": layers, "act_mib": act_mib}
        for k, v in (("f", f), ("b", b), ("w", w), ("full_bwd", b + w)):
            row[f"{k}_ms"] = v * scale
        return row

    p2p = {"kind": "p2p", **{f"comm_ms[{n}]": 0.0 for n in ps.SIM_LINKS}}
    return [part("layer", 1.0), part("head", head), p2p]


def test_quick_run_on_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    rows = ps.run(quick=True, reps=3, progress=False)
    measured = [r for r in rows if r["kind"] == "measure"]
    assert [r["part"] for r in measured] == ["layer", "head"]
    for r in measured:
        assert r["timing"] == "perf_counter" and r["reps"] == 3
        for k in ("f", "b", "w", "f_undivided", "full_bwd"):
            assert r[f"{k}_ms_p10"] <= r[f"{k}_ms"] <= r[f"{k}_ms_p90"]
            assert len(r[f"{k}_ms_all"]) == 3
    (p2p,) = [r for r in rows if r["kind"] == "p2p"]
    assert p2p["dtype"] == "bfloat16" and p2p["shape"] == [1, 64, 64]  # bf16-pure
    assert p2p["act_bytes"] == 1 * 64 * 64 * 2
    sim = [r for r in rows if r["kind"] == "sim"]
    q = ps.QUICK
    assert {(r["p"], r["m"]) for r in sim} == {(p, m) for p in q["ps"] for m in q["ms"]}
    assert {r["schedule"] for r in sim} == set(ps.SCHEDULES)
    assert all(0 <= r["bubble"] < 1 and r["step_ms"] > 0 for r in sim)
    assert not any(tmp_path.iterdir())  # --quick saves nothing
    summary = ps.summary(rows)
    assert summary.startswith("layer ") and "bubble" in summary


def test_bench_dispatch_quick(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    benchmarks.get("pipeline_sim").main(["--quick", "--reps", "2"])
    assert "bubble" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_gpu_run_refuses_few_reps():
    with pytest.raises(ValueError, match="at least 20"):
        ps.run(reps=5)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32)])
def test_simulated_bubbles_match_closed_forms(p, m):
    """F = B = W = 1 per layer, no head, no latency: 1F1B idles (p−1)/(m+p−1) of the
    step, ZB-V (p−1)/(6m+p−1) (`schedules`'s closed forms), and tokens/s follow."""
    rows = ps.simulate_rows(synthetic(), ps=[p], ms=[m], links=ps.SIM_LINKS[:1])
    by = {r["schedule"]: r for r in rows}
    assert by["1f1b"]["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert by["zbv"]["bubble"] == pytest.approx((p - 1) / (6 * m + p - 1))
    assert by["1f1b"]["speedup_vs_1f1b"] == 1.0 and by["zbv"]["speedup_vs_1f1b"] > 1.0
    one = by["1f1b"]
    assert one["tokens_per_s"] == pytest.approx(m * 4096 / (one["step_ms"] / 1e3))
    assert one["peak_act_gib"] == pytest.approx(p * (32 // p) * 10.0 / 1024)


def test_stage_costs_put_the_head_on_the_last_stage():
    layer, head, _ = synthetic(f=1.0, b=2.0, w=0.5, head=3.0)
    fs, bs, ws = ps.stage_costs(layer, head, 8, 4, split=True)
    assert fs == [2.0, 2.0, 2.0, 5.0] and bs == [4.0, 4.0, 4.0, 10.0]
    assert ws == [1.0, 1.0, 1.0, 2.5]
    fs, bs, ws = ps.stage_costs(layer, head, 8, 4, split=False)
    assert bs == [5.0, 5.0, 5.0, 12.5] and ws == [0.0] * 4  # the full backward
    with pytest.raises(ValueError, match="do not divide"):
        ps.stage_costs(layer, head, 6, 4, split=True)
