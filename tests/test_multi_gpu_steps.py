"""The multi-GPU step benchmarks on the CPU: `bench sequence_parallel_step` and `bench
pipeline_measured` in their quick form (two gloo processes, the tiny model; once more on
four, where TP = 4 and p = 4), their derived fields, the bubble formula, and the refusal
of a measured run without CUDA or at a world size they do not measure."""

import copy
import math
import os
import subprocess
import sys

import pytest
import torch

from colossal_lab.benchmarks import pipeline_measured as pm
from colossal_lab.benchmarks import pipeline_sim, two_gpu
from colossal_lab.benchmarks import sequence_parallel_step as sps
from colossal_lab.book import integrity


@pytest.fixture(scope="module")
def sp_rows():
    return sps.run(quick=True)


@pytest.fixture(scope="module")
def pp_rows():
    return pm.run(quick=True)


@pytest.fixture(scope="module")
def sp_rows_4():
    return sps.run(quick=True, world=4)


@pytest.fixture(scope="module")
def pp_rows_4():
    return pm.run(quick=True, world=4)


# ------------------------------------------------------------- sequence_parallel_step


def test_sequence_parallel_quick_rows(sp_rows):
    assert [r["mode"] for r in sp_rows] == list(sps.MODES)
    by = {r["mode"]: r for r in sp_rows}
    assert "symm_mem" in by["symm_mem"]["skipped"]  # gloo: said, not substituted
    assert "step_ms" not in by["symm_mem"]
    iters = sps.QUICK["iters"]
    for mode in ("all_reduce", "split_gather", "ring"):
        r = by[mode]
        assert r["mode_ran"] == mode
        assert r["steps_timed"] == iters == len(r["step_ms_all"])
        assert r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert math.isclose(r["tokens_per_s"], r["batch"] * r["seq_len"] / r["step_ms"] * 1e3)
        assert math.isclose(r["tokens_per_s_per_gpu"], r["tokens_per_s"] / 2)
        assert math.isclose(r["vs_tp"], by["all_reduce"]["step_ms"] / r["step_ms"])
        assert r["loss_ok"] and r["loss_diff"] <= r["loss_rtol"] * abs(r["loss_step2"])
        assert r["loss_step2"] != r["loss_step1"]  # the optimizer step changed something
        assert len(r["peak_mem_gib_per_rank"]) == 2
        assert r["activation_gib"] is None  # no allocator statistics on a CPU
    assert by["all_reduce"]["vs_tp"] == 1.0 and by["all_reduce"]["loss_diff"] == 0.0
    assert integrity.check_rows({"rows": sp_rows}) == []


def test_sequence_parallel_quick_rows_at_four_ranks(sp_rows_4):
    """TP = 4 (the tiny model's 2 key/value heads each on two ranks): every mode that
    runs here agrees with plain TP, per-GPU throughput is a quarter of the group's."""
    assert [r["mode"] for r in sp_rows_4] == list(sps.MODES)
    by = {r["mode"]: r for r in sp_rows_4}
    assert "symm_mem" in by["symm_mem"]["skipped"]
    for r in sp_rows_4:
        assert r["tp"] == r["world"] == 4
    for mode in ("all_reduce", "split_gather", "ring"):
        r = by[mode]
        assert r["mode_ran"] == mode and "error" not in r
        assert r["loss_ok"] and r["loss_step2"] != r["loss_step1"]
        assert math.isclose(r["tokens_per_s_per_gpu"], r["tokens_per_s"] / 4)
        assert len(r["peak_mem_gib_per_rank"]) == 4
    assert integrity.check_rows({"rows": sp_rows_4}) == []


def test_sequence_parallel_integrity_catches_a_bad_ratio(sp_rows):
    rows = copy.deepcopy(sp_rows)
    row = next(r for r in rows if r["mode"] == "ring")
    row["vs_tp"] *= 1.1
    row["tokens_per_s_per_gpu"] *= 2
    problems = integrity.check_rows({"rows": rows})
    assert any("vs_tp" in p for p in problems)
    assert any("tokens_per_s_per_gpu" in p for p in problems)
    rows[0]["activation_gib"], rows[0]["activation_gib_tp"] = 2.0, 4.0
    rows[0]["act_vs_tp"] = 0.4
    assert any("act_vs_tp" in p for p in integrity.check_rows({"rows": rows[:1]}))


# ------------------------------------------------------------------ pipeline_measured


def test_pipeline_quick_rows(pp_rows):
    rows = [r for r in pp_rows if "schedule" in r]
    assert [r["schedule"] for r in rows] == list(pm.SCHEDULES)  # torch 2.13 has ZB-V
    base = rows[0]
    for r in rows:
        assert r["m"] == 4 and r["p"] == 2 and r["steps_timed"] == pm.QUICK["iters"]
        assert r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert math.isclose(r["tokens_per_s"], r["m"] * r["seq_len"] / r["step_ms"] * 1e3)
        assert math.isclose(r["bubble"], pm.bubble(r["useful_ms_per_rank"], r["step_ms"]))
        assert 0 < r["bubble_sim"] < 1 and r["sim_link"] == pm.SIM_LINK
        assert math.isclose(r["speedup_vs_1f1b"], base["step_ms"] / r["step_ms"])
        assert r["grad_ok"] and r["grad_max_abs"] > 0
        assert r["grad_rel_diff"] <= pm.GRAD_RTOL["fp32"]
        assert r["loss_ok"]
    assert base["grad_max_abs_diff"] == 0.0 and base["speedup_vs_1f1b"] == 1.0
    # ZB-V holds both ends of the V on rank 0: more useful work there than rank 1
    zbv = next(r for r in rows if r["schedule"] == "zbv")
    assert zbv["useful_ms_per_rank"][0] > zbv["useful_ms_per_rank"][1]
    assert {r["part"] for r in pp_rows if r.get("kind") == "costs"} == {"layer", "head"}
    assert integrity.check_rows({"rows": pp_rows}) == []
    bad = copy.deepcopy(pp_rows)
    bad[1]["bubble"] += 0.05
    assert any("bubble" in p for p in integrity.check_rows({"rows": bad}))


def test_pipeline_quick_rows_at_four_ranks(pp_rows_4):
    """p = 4: every schedule runs (8 layers, one per ZB-V virtual stage; m = 8) and
    matches 1F1B's gradients and loss; the bubble is against the simulator at p = 4."""
    rows = [r for r in pp_rows_4 if "schedule" in r]
    assert pm.quick_sizes(4) == (8, (8,))
    assert [r["schedule"] for r in rows] == list(pm.SCHEDULES)
    base = rows[0]
    for r in rows:
        assert (r["p"], r["world"], r["m"], r["layers"]) == (4, 4, 8, 8)
        assert "error" not in r and "skipped" not in r, r.get("error") or r.get("skipped")
        assert r["grad_ok"] and r["loss_ok"] and r["grad_max_abs"] > 0
        assert len(r["useful_ms_per_rank"]) == 4
        assert 0 < r["bubble_sim"] < 1
        assert math.isclose(r["speedup_vs_1f1b"], base["step_ms"] / r["step_ms"])
    zbv = next(r for r in rows if r["schedule"] == "zbv")
    assert zbv["chunks"] == 2
    assert zbv["useful_ms_per_rank"][0] == max(zbv["useful_ms_per_rank"])  # the head
    assert integrity.check_rows({"rows": pp_rows_4}) == []


def test_quick_and_measured_sizes_follow_p():
    assert pm.quick_sizes(pm.P) == (pm.QUICK["layers"], pm.QUICK["ms"])
    assert pm.MS == {2: (4, 8, 16), 4: (8, 16, 32)}  # issue #21's m at p = 4
    assert set(pm.MS) == set(two_gpu.WORLDS)


FBW = [{"kind": "measure", "part": "layer", "f_ms": 1.0, "b_ms": 2.0, "w_ms": 1.0,
        "f_undivided_ms": 1.0, "full_bwd_ms": 3.0},
       {"kind": "measure", "part": "head", "f_ms": 0.5, "b_ms": 1.0, "w_ms": 0.5,
        "f_undivided_ms": 0.5, "full_bwd_ms": 1.5}]


@pytest.mark.parametrize("schedule, want", [
    ("1f1b", [4 * 16.0, 4 * 18.0]),  # 4 layers each, the head on rank 1
    ("zb-h1", [4 * 16.0, 4 * 18.0]),
    ("zbv", [4 * 18.0, 4 * 16.0]),  # stages 0 and 3 on rank 0: the head too
    ("torch-zbv", [4 * 18.0, 4 * 16.0])])
def test_useful_time_per_rank(schedule, want):
    assert pm.useful_per_rank(FBW, schedule, m=4, num_layers=8) == pytest.approx(want)


@pytest.mark.parametrize("schedule, want", [
    ("1f1b", [8 * 8.0, 8 * 8.0, 8 * 8.0, 8 * 10.0]),  # 2 layers each, the head last
    ("zbv", [8 * 10.0, 8 * 8.0, 8 * 8.0, 8 * 8.0])])  # rank 0: stages 0 and 7, the head
def test_useful_time_per_rank_at_four(schedule, want):
    got = pm.useful_per_rank(FBW, schedule, m=8, num_layers=8, p=4)
    assert got == pytest.approx(want)


def test_bubble_formula_known_numbers():
    from colossal_lab.parallel.pipeline import schedules as sch
    from colossal_lab.parallel.pipeline.simulate import simulate

    assert pm.bubble([3.0, 3.0], 4.0) == pytest.approx(0.25)
    assert pm.bubble([4.0, 4.0], 4.0) == 0.0
    assert pm.bubble([2.0, 4.0], 4.0) == pytest.approx(0.25)
    for p, m in ((2, 4), (2, 8), (4, 8)):  # 1F1B, equal stages: (p − 1)/(m + p − 1)
        tl = simulate(sch.one_f_one_b(p, m), f=1.0, b=2.0, w=0.0)
        assert pm.bubble(tl.busy, tl.makespan) == pytest.approx(tl.bubble)
        assert tl.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_simulated_bubble_is_the_simulators():
    rows = [*FBW, {"kind": "p2p", f"comm_ms[{pm.SIM_LINK}]": 0.1}]
    for r in rows[:2]:
        r.update(layers=8, micro_batch=1, seq_len=16, act_mib=None)
    got = pm._sim(rows, "torch-zbv", 8, 8)
    want = pipeline_sim.simulate_rows(rows, ps=(2,), ms=(8,), schedules=("zbv",),
                                      links=(pm.SIM_LINK,), num_layers=8)[0]
    assert got["bubble_sim"] == want["bubble"] and got["sim_schedule"] == "zbv"
    got = pm._sim(rows, "zbv", 8, 8, p=4)
    want = pipeline_sim.simulate_rows(rows, ps=(4,), ms=(8,), schedules=("zbv",),
                                      links=(pm.SIM_LINK,), num_layers=8)[0]
    assert got["bubble_sim"] == want["bubble"]


def test_compare_grads_sees_a_difference():
    ref = {"a": torch.ones(3), "b": torch.full((2, 2), -4.0)}
    mine = {"a": torch.ones(3), "b": torch.full((2, 2), -4.0)}
    assert pm.compare_grads(mine, ref, "cpu") == (0.0, 4.0)
    mine["a"][1] += 0.5
    assert pm.compare_grads(mine, ref, "cpu") == (0.5, 4.0)


# ----------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", ["sequence_parallel_step", "pipeline_measured"])
def test_refuses_without_cuda(name):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "colossal_lab", "bench", name],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs CUDA" in lines[0] and name in lines[0]


def test_refusal_by_world_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "exactly 2 ranks" in two_gpu.refusal(quick=False)  # composed_parallel's
    assert two_gpu.refusal(quick=False, worlds=two_gpu.WORLDS) is None
    monkeypatch.setenv("WORLD_SIZE", "3")
    why = two_gpu.refusal(quick=False, worlds=two_gpu.WORLDS)
    assert "needs 2 or 4 ranks (world size is 3)" in why
    assert "--nproc-per-node 2 or 4" in why
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert two_gpu.refusal(quick=False) is None
    assert two_gpu.refusal(quick=False, worlds=two_gpu.WORLDS) is None
    assert two_gpu.refusal(quick=True) is None


@pytest.mark.parametrize("module", [sps, pm], ids=["sequence_parallel_step",
                                                   "pipeline_measured"])
def test_refuses_a_world_of_three(module, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    with pytest.raises(SystemExit) as e:
        module.main([])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and module.NAME in lines[0] and "2 or 4 ranks" in lines[0]
    assert "NCCL_NVLS_ENABLE" not in os.environ  # refused before touching anything


@pytest.mark.parametrize("module", [sps, pm], ids=["sequence_parallel_step",
                                                   "pipeline_measured"])
def test_world_flag_is_for_quick_runs(module, capsys):
    for argv, says in ((["--quick", "--world", "3"], "invalid choice"),
                       (["--world", "4"], "--world 4 is for --quick")):
        with pytest.raises(SystemExit) as e:
            module.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_save_writes_the_world_it_ran_at(monkeypatch):
    from colossal_lab.measure import results

    saved = {}
    monkeypatch.setattr(results, "save_results", lambda name, rows, **kw: saved.update(kw))
    two_gpu.save("pipeline_measured", [], {}, ["--ms", "8"], world=4)
    assert saved["command"] == ("torchrun --nproc-per-node 4 -m colossal_lab bench "
                                "pipeline_measured --ms 8")
    assert saved["gpu"].endswith("x4")


def test_a_failing_case_becomes_its_rows_error():
    assert two_gpu.attempt(lambda x: x + 1, 1) == (2, None)
    out, why = two_gpu.attempt(lambda: 1 / 0)
    assert out is None and why.startswith("ZeroDivisionError")
