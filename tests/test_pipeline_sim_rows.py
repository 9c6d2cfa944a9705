"""`pipeline.sim_rows`: the simulated rows from recorded per-layer costs, on the CPU."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from colossal_lab.parallel.pipeline import sim_rows as sr

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "results" / "h200" / "pipeline_sim.json"
NV = "NVLink 4"


def recorded() -> list[dict]:
    if not RECORDED.exists():
        pytest.skip(f"{RECORDED} not present")
    return json.loads(RECORDED.read_text())["rows"]


def synthetic(f=1.0, b=1.0, w=1.0, head=0.0, layers=32) -> list[dict]:
    """Measured rows as a pipeline_sim measurement writes them, with chosen costs."""
    def part(name, scale):
        row = {"kind": "measure", "part": name, "micro_batch": 1, "seq_len": 4096,
               "layers": layers, "act_mib": 10.0}
        for k, v in (("f", f), ("b", b), ("w", w), ("full_bwd", b + w)):
            row[f"{k}_ms"] = v * scale
        return row

    return [part("layer", 1.0), part("head", head),
            {"kind": "p2p", **{f"comm_ms[{n}]": 0.0 for n in sr.LINKS}}]


def by_key(rows):
    return {(r["schedule"], r["p"], r["m"], r["link"]): r for r in rows
            if r.get("kind") == "sim"}


def test_no_torch_in_the_module():
    tree = ast.parse(Path(sr.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "collections.abc", "colossal_lab.parallel.pipeline",
                     "colossal_lab.parallel.pipeline.simulate"}, names


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32)])
def test_closed_forms_with_uniform_costs(p, m):
    """F = B = W per layer, no head, no latency: 1F1B (p−1)/(m+p−1), ZB-H1
    (p−1)/(3m+p−1), ZB-V (p−1)/(6m+p−1) of the step."""
    rows = sr.simulate_rows(synthetic(), ps=[p], ms=[m], links=[NV])
    got = {r["schedule"]: r for r in rows}
    assert got["1f1b"]["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert got["zb-h1"]["bubble"] == pytest.approx((p - 1) / (3 * m + p - 1))
    assert got["zbv"]["bubble"] == pytest.approx((p - 1) / (6 * m + p - 1))
    one = got["1f1b"]
    assert one["speedup_vs_1f1b"] == 1.0
    assert one["tokens_per_s"] == pytest.approx(m * 4096 / (one["step_ms"] / 1e3))
    assert one["idle_ms"] == pytest.approx([one["step_ms"] - m * (32 // p) * 3.0] * p)


def test_recorded_rows_reproduced_where_the_order_is_fixed():
    """GPipe, 1F1B and interleaved do not depend on the costs: the rows come out as the
    measurement's own simulation wrote them."""
    rows = recorded()
    old = by_key(rows)
    new = by_key(sr.simulate_rows(rows, ps=[2, 4], ms=[8], links=[NV]))
    for key, r in new.items():
        if key[0] in ("gpipe", "1f1b", "interleaved"):
            assert r["step_ms"] == pytest.approx(old[key]["step_ms"], rel=1e-9), key
            assert r["peak_activations"] == old[key]["peak_activations"]


def test_split_schedules_no_slower_than_recorded():
    """ZB-H1 and ZB-V, their orders built for the per-stage costs they are timed with:
    never slower than the recorded rows, and ZB-H1 ahead of 1F1B at p = 2, m = 8."""
    rows = recorded()
    old = by_key(rows)
    new = by_key(sr.simulate_rows(rows, ps=[2, 4], ms=[8], links=[NV]))
    for key, r in new.items():
        assert r["step_ms"] <= old[key]["step_ms"] * (1 + 1e-9), key
    assert new[("zb-h1", 2, 8, NV)]["step_ms"] < new[("1f1b", 2, 8, NV)]["step_ms"]
    assert new[("zb-h1", 2, 8, NV)]["speedup_vs_1f1b"] > 1.0


def test_refresh_replaces_only_the_sim_rows():
    rows = recorded()
    kept = [r for r in rows if r.get("kind") != "sim"]
    got = sr.refresh(rows, ps=[2], ms=[4, 8])
    assert got[:len(kept)] == kept
    assert set(by_key(got)) == {k for k in by_key(rows) if k[1] == 2 and k[2] in (4, 8)}


def test_clear_errors():
    with pytest.raises(ValueError, match="no 'measure' head row"):
        sr.simulate_rows(synthetic()[::2])
    with pytest.raises(ValueError, match="no transfer time for link 'carrier pigeon'"):
        sr.simulate_rows(synthetic(), links=["carrier pigeon"])
    with pytest.raises(ValueError, match="unknown schedules"):
        sr.simulate_rows(synthetic(), schedules=["dualpipe"])
    with pytest.raises(ValueError, match="do not divide"):
        sr.simulate_rows(synthetic(layers=6), ps=[4], ms=[4])


def test_zbv_memory_on_its_rows():
    rows = sr.simulate_rows(synthetic(3.56, 3.44, 2.47), ps=[4], ms=[16], links=[NV],
                            memory=1.5)
    got = {r["schedule"]: r for r in rows}
    assert got["zbv"]["memory"] == 1.5 and "memory" not in got["1f1b"]
    assert 4 < got["zbv"]["peak_activations"] <= 6
    one = {r["schedule"]: r for r in sr.simulate_rows(
        synthetic(3.56, 3.44, 2.47), ps=[4], ms=[16], links=[NV])}
    assert got["zbv"]["step_ms"] < one["zbv"]["step_ms"]
    assert got["1f1b"]["step_ms"] == one["1f1b"]["step_ms"]
