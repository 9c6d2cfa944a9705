"""The fused-norm benchmark runs end to end on a CPU (tiny shapes, Triton interpreter)
and its rows carry every field the book reads. No speed is asserted here."""

import json

import pytest
import torch

from colossal_lab.benchmarks import fused_norm

FIELDS = ("op", "provider", "tokens", "hidden", "dtype", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
          "fwd_gbps", "bwd_gbps", "fwd_bwd_gbps")


@pytest.fixture(scope="module")
def rows():
    return fused_norm.run(quick=True)


def test_rows_have_every_field(rows):
    ops = [r for r in rows if r["kind"] == "op"]
    assert {r["op"] for r in ops} == set(fused_norm.OPS)
    assert {"eager", "torch", "triton"} <= {r["provider"] for r in ops}
    assert {r["provider"] for r in ops if r["op"] == "add_rms_norm"} >= {"separate"}
    for r in ops:
        assert "error" not in r, r
        for f in FIELDS:
            assert f in r, (f, r)
        for f in FIELDS[5:]:
            assert r[f] > 0, (f, r)
    json.dumps(rows)  # storable as a results file


def test_ceiling_row(rows):
    ceiling = [r for r in rows if r["kind"] == "ceiling"]
    assert len(ceiling) == 1 and ceiling[0]["copy_gbps"] > 0


def test_summary_table(rows):
    text = fused_norm.summary(rows)
    assert "copy ceiling" in text and "triton" in text and "separate" in text


def test_moved_bytes_formulas():
    n = 16384 * 4096
    fwd, bwd = fused_norm.moved_bytes("rms_norm", 16384, 4096, 2)
    assert round(fwd / n) == 4 and round(bwd / n) == 6
    fwd, bwd = fused_norm.moved_bytes("add_rms_norm", 16384, 4096, 2)
    assert round(fwd / n) == 8 and round(bwd / n) == 8
    with pytest.raises(ValueError):
        fused_norm.moved_bytes("group_norm", 1, 1)


@pytest.mark.parametrize("op,fwd,bwd", [("rms_norm", 36, 92), ("layer_norm", 52, 122),
                                        ("add_rms_norm", 42, 98)])
def test_eager_traffic_matches_docstrings(op, fwd, bwd):
    """The bytes per element the module docstrings quote for eager bf16 (meta tensors:
    nothing is allocated)."""
    n = 16384 * 4096
    t = fused_norm.traffic_bytes(op, 16384, 4096, torch.bfloat16)
    assert round(t["fwd_bytes"] / n) == fwd and round(t["bwd_bytes"] / n) == bwd


def test_measure_records_errors():
    row = fused_norm.measure("rms_norm", "triton", 2, 70000, torch.float32, "cpu")
    assert "65536" in row["error"]
