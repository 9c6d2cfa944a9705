"""`bench composed_2x2` on the CPU: its quick form (four gloo processes, the tiny model
with 4 layers) on every setup, the choice of the faster layout, the ratio's reference
row read from a results file, and the refusals (no CUDA, bad options) in-process."""

import json
import math

import pytest
import torch

from colossal_lab.benchmarks import composed_2x2 as cz
from colossal_lab.benchmarks import composed_parallel as cp
from colossal_lab.benchmarks import pipeline_measured as pm
from colossal_lab.config import preset
from colossal_lab.measure import mfu

FP32_RTOL = 1e-5


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    # an empty results folder: no single-GPU composed.json, whatever this tree holds
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path_factory.mktemp("results")))
        return cz.run(quick=True)


def test_quick_rows(rows):
    measured, choice = rows[:-1], rows[-1]
    assert [r["setup"] for r in measured] == list(cz.SETUPS)
    q = cz.QUICK
    cfg = preset("tiny").replace(num_hidden_layers=q["layers"])
    for r in measured:
        assert "error" not in r and "skipped" not in r, r
        assert r["kind"] == cz.KIND and r["world"] == 4 and r["preset"] == "tiny"
        assert r["layers"] == 4 and r["mesh"] == cz.MESHES[r["layout"]]
        assert r["mode_ran"] == r["mode"]
        assert r["steps_timed"] == q["iters"] == len(r["step_ms_all"])
        assert 0 < r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert math.isfinite(r["loss_step1"]) and math.isfinite(r["loss_step2"])
        assert r["tokens_per_s"] == pytest.approx(
            r["batch"] * r["seq_len"] / (r["step_ms"] / 1e3))
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 4)
        assert r["mfu_per_gpu"] == pytest.approx(
            mfu.seed_flops(cfg, 1) * r["tokens_per_s_per_gpu"] / (r["peak_tflops"] * 1e12))
        assert r["meets_target"] == (r["mfu_per_gpu"] >= 0.50) and r["target_mfu"] == 0.50
        assert len(r["peak_mem_gib_per_rank"]) == 4 and r["ckpt_ratio"] is None
        assert r["vs_single_gpu_best"] is None  # no composed.json: None, with the reason
        assert "bench composed" in r["vs_single_gpu_best_why"]
    by = {r["setup"]: r for r in measured}
    for s in ("dp2tp2-ring", "dp2tp2-split_gather"):
        assert by[s]["batch"] == 2 * q["dp_batch"] and by[s]["batch_per_dp_rank"] == 2
    for s, schedule in (("tp2pp2-zbv", "zbv"), ("tp2pp2-1f1b", "1f1b")):
        assert by[s]["batch"] == q["pp_m"] * pm.MICRO_BATCH and by[s]["m"] == q["pp_m"]
        assert by[s]["schedule"] == schedule and by[s]["mode"] == "ring"
    # dp_batch · 2 = m: the same seed-0 tokens from the same weights in every setup,
    # so the same loss before and after one (equally clipped) AdamW step
    ref = by["dp2tp2-ring"]
    for r in measured:
        for k in ("loss_step1", "loss_step2"):
            assert r[k] == pytest.approx(ref[k], rel=FP32_RTOL), (r["setup"], k)
    assert choice["kind"] == "choice" and choice["setup"] in cz.SETUPS
    assert choice["mfu_per_gpu"] == max(r["mfu_per_gpu"] for r in measured)
    assert choice["layout"] == by[choice["setup"]]["layout"]


def test_choice_skips_errors():
    rows = [{"setup": "dp2tp2-ring", "layout": "dp2tp2", "error": "OutOfMemoryError"},
            {"setup": "tp2pp2-zbv", "layout": "tp2pp2", "mfu_per_gpu": 0.41,
             "step_ms": 900.0, "meets_target": False}]
    c = cz.choice(rows)
    assert (c["setup"], c["layout"], c["candidates"]) == (
        "tp2pp2-zbv", "tp2pp2", {"tp2pp2-zbv": 0.41})
    none = cz.choice(rows[:1])
    assert none["setup"] is None and "error" in none["why"]


def test_single_gpu_reference_is_the_7b_row(tmp_path):
    path = tmp_path / "composed.json"
    path.write_text(json.dumps({"provenance": {"git_sha": "abc"}, "rows": [
        {"setup": "ours-bf16", "preset": "llama-7b-8l", "seq_len": 4096, "mfu": 0.6},
        {"setup": "ours-7b-bf16", "preset": "llama-7b", "seq_len": 4096, "mfu": 0.55}]}))
    best = cp.single_gpu_best(path, "llama-7b", 4096, setup=cz.SINGLE_GPU_SETUP)
    assert best["mfu"] == 0.55 and best["setup"] == "ours-7b-bf16"
    # the default is still composed_parallel's row
    assert cp.single_gpu_best(path, "llama-7b-8l", 4096)["mfu"] == 0.6


def test_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        cz.main([])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs CUDA" in lines[0] and cz.NAME in lines[0]
    assert "--nproc-per-node 4" in lines[0]


def test_refuses_the_wrong_world(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        cz.main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "needs exactly 4 ranks (world size is 2)" in err


@pytest.mark.parametrize("argv, says", [
    (["--iters", "5"], "at least 20 steps"),
    (["--dp-batch", "0"], "--dp-batch"),
    (["--pp-m", "0"], "--pp-m"),
    (["--pp-m", "1"], "--pp-m"),
    (["--ckpt-ratio", "1.5"], "--ckpt-ratio"),
    (["--ckpt-ratio", "nan"], "--ckpt-ratio"),
])
def test_bad_options(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cz.main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
