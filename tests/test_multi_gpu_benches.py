"""The multi-GPU benchmarks on the CPU: `bench collectives` and `bench
grad_overlap_measured` in their `--quick` form (2 gloo processes), their formulas (bus
bandwidth, overlap efficiency), the merge of one link's rows into a file that holds the
others', the integrity rules that recompute their derived fields, and the refusal to
measure a "multi-GPU" number without GPUs.

Each quick run starts 2 processes (a few seconds each to import torch): one run per
benchmark, shared by the module (`coll_rows`, `dp_rows`)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from colossal_lab.benchmarks import collectives as coll
from colossal_lab.benchmarks import grad_overlap
from colossal_lab.benchmarks import grad_overlap_measured as gom
from colossal_lab.book import integrity
from colossal_lab.measure import results


@pytest.fixture(scope="module")
def coll_rows():
    return coll.run(quick=True)


@pytest.fixture(scope="module")
def dp_rows():
    return gom.run(quick=True)


# ------------------------------------------------------------------ collectives


def test_bus_factor_is_nccl_tests_convention():
    assert coll.bus_factor("all_reduce", 2) == 1.0
    assert coll.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert coll.bus_factor("all_gather", 2) == 0.5
    assert coll.bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="choose one of"):
        coll.bus_factor("broadcast", 2)


def test_collectives_quick_rows(coll_rows):
    assert {(r["op"], r["size_bytes"]) for r in coll_rows} == {
        (op, n) for op in coll.OPS for n in coll.QUICK_SIZES}
    for r in coll_rows:
        assert r["link"] == coll.QUICK_LINK and r["world"] == 2 and r["backend"] == "gloo"
        assert r["reps"] == coll.QUICK_REPS == len(r["ms_all"])
        assert 0 < r["ms_p10"] <= r["ms"] <= r["ms_p90"]
        assert r["busbw_gbps"] > 0
        assert r["busbw_gbps_p90time"] <= r["busbw_gbps"] <= r["busbw_gbps_p10time"]
        # S / t, in GB/s, and the bus factor of 2 ranks
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / (r["ms"] / 1e3) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(
            r["algbw_gbps"] * (1.0 if r["op"] == "all_reduce" else 0.5))


def test_set_link_sets_nccl_env(monkeypatch):
    for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(k, raising=False)
    coll.set_link("sockets")
    assert (os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_SHM_DISABLE"],
            os.environ["NCCL_NVLS_ENABLE"]) == ("1", "1", "0")
    coll.set_link("host")
    assert os.environ["NCCL_P2P_DISABLE"] == "1" and "NCCL_SHM_DISABLE" not in os.environ
    coll.set_link("nvlink")  # NCCL's own choice, even after a shell disabled P2P
    assert "NCCL_P2P_DISABLE" not in os.environ and os.environ["NCCL_NVLS_ENABLE"] == "0"
    with pytest.raises(ValueError, match="choose one of"):
        coll.set_link("infiniband")


# ------------------------------------------------------------ grad_overlap_measured


def test_name_is_what_chapter_08_loads():
    assert gom.NAME == grad_overlap.MEASURED == "grad_overlap_measured"


def test_overlap_efficiency_formula():
    # T_sync 100, T_nocomm 60: 40 ms of communication; T_overlap 70 hides 30 of it
    assert gom.overlap_efficiency(100.0, 70.0, 60.0) == pytest.approx(0.75)
    assert gom.overlap_efficiency(100.0, 60.0, 60.0) == pytest.approx(1.0)
    assert gom.overlap_efficiency(100.0, 100.0, 60.0) == pytest.approx(0.0)
    assert gom.overlap_efficiency(100.0, 110.0, 60.0) == pytest.approx(-0.25)
    assert gom.overlap_efficiency(60.0, 50.0, 60.0) is None  # nothing to hide
    assert gom.comm_share(100.0, 60.0, 20.0) == pytest.approx(2.0)
    assert gom.comm_share(100.0, 60.0, 0.0) is None


def test_grad_overlap_measured_quick_rows(dp_rows):
    by = {r["backend"]: r for r in dp_rows}
    assert list(by) == list(gom.BACKENDS) and len(dp_rows) == len(gom.BACKENDS)
    t0, ts = by["nocomm"]["step_ms"], by["naive"]["step_ms"]
    for r in dp_rows:
        assert r["kind"] == "dp_step" and r["world"] == 2 and r["link"] == coll.QUICK_LINK
        assert r["t_nocomm_ms"] == t0 and r["t_sync_ms"] == ts
        assert 0 < r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert r["tokens_per_s"] == pytest.approx(
            r["batch"] * r["seq_len"] / (r["step_ms"] / 1e3))
        assert r["measured_exposed_ms"] == pytest.approx(r["step_ms"] - t0)
        assert r["backward_ms"] > 0 and r["allreduce_flat_ms"] > 0
        if r["backend"] not in gom.OVERLAPPED:
            assert r["overlap_efficiency"] is None
        elif ts > t0:
            assert r["overlap_efficiency"] == pytest.approx((ts - r["step_ms"]) / (ts - t0))
    assert by["nocomm"]["measured_exposed_ms"] == 0.0
    # the model on the measured link: naive exposes its whole flat all-reduce, which
    # at that all-reduce's own bus bandwidth takes the time measured for it
    assert by["naive"]["predicted_exposed_ms"] == pytest.approx(
        by["naive"]["allreduce_flat_ms"], rel=1e-6)
    assert by["overlap"]["predicted_exposed_ms"] >= 0
    assert by["fsdp2"]["predicted_exposed_ms"] is None
    assert by["overlap"]["link_busbw_gbps"] > 0
    # fp32, divided then summed in the same order: ours and DDP reduce exactly as naive
    for b in ("overlap", "ddp", "fsdp2"):
        r = by[b]
        assert r["grad_max_abs"] > 0
        assert r["grad_max_abs_diff_vs_naive"] <= 1e-6 + 1e-5 * r["grad_max_abs"], b
    assert by["naive"]["grad_max_abs_diff_vs_naive"] == 0.0


# ------------------------------------------------------------------ integrity


def test_integrity_recomputes_the_new_fields(coll_rows, dp_rows):
    doc = {"rows": copy.deepcopy(coll_rows + dp_rows)}
    assert integrity.check_rows(doc) == []
    coll_row = next(r for r in doc["rows"] if r.get("kind") == "collective")
    coll_row["busbw_gbps"] *= 1.5
    dp_row = next(r for r in doc["rows"] if r.get("backend") == "overlap")
    dp_row["t_nocomm_ms"] *= 0.5  # E and the exposed time no longer follow
    problems = "\n".join(integrity.check_rows(doc))
    assert "busbw_gbps=" in problems
    assert "measured_exposed_ms=" in problems


def test_integrity_overlap_efficiency_from_times():
    row = {"kind": "dp_step", "backend": "ddp", "step_ms": 70.0, "t_nocomm_ms": 60.0,
           "t_sync_ms": 100.0, "backward_ms": 20.0, "overlap_efficiency": 0.75,
           "comm_share": 2.0, "measured_exposed_ms": 10.0}
    assert integrity.check_rows({"rows": [row]}) == []
    assert "overlap_efficiency=" in "\n".join(
        integrity.check_rows({"rows": [{**row, "overlap_efficiency": 0.5}]}))
    assert "comm_share=" in "\n".join(
        integrity.check_rows({"rows": [{**row, "comm_share": 1.0}]}))


# ---------------------------------------------------------------------- merge


def test_merge_rows_replaces_only_this_links_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    assert results.merge_rows("coll", [{"link": "host", "v": 1}], "link", gpu="h200x2") \
        == [{"link": "host", "v": 1}]  # no file yet
    first = [{"link": "nvlink", "v": 1}, {"link": "host", "v": 1}]
    results.save_results("coll", first, gpu="h200x2")
    merged = results.merge_rows("coll", [{"link": "host", "v": 2}, {"link": "host", "v": 3}],
                                "link", gpu="h200x2")
    assert merged == [{"link": "nvlink", "v": 1}, {"link": "host", "v": 2},
                      {"link": "host", "v": 3}]
    results.save_results("coll", merged, gpu="h200x2")
    on_disk = json.loads((tmp_path / "h200x2" / "coll.json").read_text())["rows"]
    assert on_disk == merged
    # by (link, preset): another preset of the same link is kept
    rows = [{"link": "nvlink", "preset": "1b", "v": 1},
            {"link": "nvlink", "preset": "7b", "v": 1}]
    results.save_results("dp", rows, gpu="h200x2")
    merged = results.merge_rows("dp", [{"link": "nvlink", "preset": "1b", "v": 2}],
                                ("link", "preset"), gpu="h200x2")
    assert sorted((r["preset"], r["v"]) for r in merged) == [("1b", 2), ("7b", 1)]
    with pytest.raises(KeyError, match="link"):
        results.merge_rows("dp", [{"preset": "1b"}], ("link", "preset"), gpu="h200x2")


# --------------------------------------------------------------------- refusal


@pytest.mark.parametrize("module", [coll, gom], ids=["collectives", "grad_overlap_measured"])
def test_refuses_without_cuda(module, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    with pytest.raises(SystemExit) as e:
        module.main(["--link", "host"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs CUDA" in err
    assert "NCCL_NVLS_ENABLE" not in os.environ  # refused before touching anything


def test_refuses_one_rank(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        coll.main([])
    assert e.value.code == 2 and "at least 2 ranks" in capsys.readouterr().err


def test_partial_rows_survive_a_failed_setup_and_go_when_the_run_ends(tmp_path, monkeypatch):
    """`bench <chapter>` saves the rows it has after each setup under partial/: a run
    killed in its second setup keeps the first; a finished run leaves only the result."""
    from colossal_lab.benchmarks import steps

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    slug = results.hardware.detect().slug
    setups = [steps.Setup("a", "first"), steps.Setup("b", "second")]

    def measure(s, *_):
        if s.name == "b" and fail:
            raise KeyboardInterrupt  # the time limit, in the second setup
        return {"setup": s.name, "step_ms": 1.0}

    monkeypatch.setattr(steps, "measure_isolated", measure)
    monkeypatch.setattr(steps, "format_row", lambda r: r["setup"])
    fail = True
    with pytest.raises(KeyboardInterrupt):
        steps.main_for("demo", setups, [])
    kept = json.loads((tmp_path / slug / "partial" / "demo.json").read_text())
    assert kept["partial"] is True and [r["setup"] for r in kept["rows"]] == ["a"]
    assert not (tmp_path / slug / "demo.json").exists()
    fail = False
    steps.main_for("demo", setups, [])
    done = json.loads((tmp_path / slug / "demo.json").read_text())
    assert [r["setup"] for r in done["rows"]] == ["a", "b"]
    assert not (tmp_path / slug / "partial" / "demo.json").exists()


def test_resume_keeps_the_finished_setups_and_measures_the_rest(tmp_path, monkeypatch, capsys):
    """`--resume` measures only what the interrupted run lacks (a failed setup runs
    again), saves all rows with the interrupted run's provenance in `resumed_from`, and
    refuses with no partial run or one of another configuration."""
    from colossal_lab.benchmarks import steps

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    setups = [steps.Setup(n, n) for n in "abc"]
    measured = []

    def measure(s, *_):
        measured.append(s.name)
        return {"setup": s.name, "step_ms": 2.0}

    monkeypatch.setattr(steps, "measure_isolated", measure)
    monkeypatch.setattr(steps, "format_row", lambda r: r["setup"])
    with pytest.raises(SystemExit) as e:
        steps.main_for("demo", setups, ["--resume"])
    assert e.value.code == 2 and "no interrupted run" in capsys.readouterr().err
    rows = [{"setup": "a", "step_ms": 1.0}, {"setup": "b", "error": "boom"}]
    results.save_partial("demo", rows, config=steps.step_config(), command="first")
    with pytest.raises(SystemExit):
        steps.main_for("demo", setups, ["--resume", "--batch", "8"])
    assert "not {" in capsys.readouterr().err and measured == []
    steps.main_for("demo", setups, ["--resume"])
    assert measured == ["b", "c"]
    doc = json.loads(next(tmp_path.glob("*/demo.json")).read_text())
    assert [(r["setup"], r["step_ms"]) for r in doc["rows"]] == [("a", 1.0), ("b", 2.0),
                                                                 ("c", 2.0)]
    assert doc["rows"][0]["measured_at"] and "measured_at" not in doc["rows"][1]
    assert [p["command"] for p in doc["config"]["resumed_from"]] == ["first"]
    assert results.load_partial("demo") is None
