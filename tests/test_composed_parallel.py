"""`bench composed_parallel` on the CPU: its quick form (two gloo processes, the tiny
model) on one setup of each layout, the ratio to the single-GPU best read from a
results file (present, absent, without the row), and the refusal of a measured run
without CUDA."""

import json
import math
import subprocess
import sys

import pytest
import torch

from colossal_lab.benchmarks import composed_parallel as cp
from colossal_lab.config import preset
from colossal_lab.measure import mfu

QUICK_SETUPS = ("dp2-overlap", "tp2-ring", "pp2-zbv")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    # an empty results folder: no single-GPU composed.json, whatever this tree holds
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path_factory.mktemp("results")))
        return cp.run(quick=True, setups=QUICK_SETUPS)


def test_quick_rows(rows):
    assert [r["setup"] for r in rows] == list(QUICK_SETUPS)
    q = cp.QUICK
    batches = {"dp2-overlap": 2 * q["dp_batch"], "tp2-ring": q["tp_batch"],
               "pp2-zbv": q["pp_m"]}
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["kind"] == cp.KIND and r["world"] == 2 and r["preset"] == "tiny"
        assert r["batch"] == batches[r["setup"]]
        assert r["steps_timed"] == q["iters"] == len(r["step_ms_all"])
        assert 0 < r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(
            r["batch"] * r["seq_len"] / (r["step_ms"] / 1e3))
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
        cfg = preset("tiny").replace(num_hidden_layers=r["layers"])
        assert r["mfu_per_gpu"] == pytest.approx(
            mfu.seed_flops(cfg, 1) * r["tokens_per_s_per_gpu"] / (r["peak_tflops"] * 1e12))
        assert len(r["peak_mem_gib_per_rank"]) == 2
        # no composed.json of this CPU: the ratio is absent, with the reason
        assert r["vs_single_gpu_best"] is None
        assert "bench composed" in r["vs_single_gpu_best_why"]
    by = {r["setup"]: r for r in rows}
    assert by["dp2-overlap"]["batch_per_rank"] == q["dp_batch"]
    assert by["tp2-ring"]["mode_ran"] == "ring"
    assert by["pp2-zbv"]["layers"] == q["pp_layers"] and by["pp2-zbv"]["m"] == q["pp_m"]


def _composed(tmp_path, rows, sha="abc123"):
    path = tmp_path / "composed.json"
    path.write_text(json.dumps({"name": "composed", "provenance": {"git_sha": sha},
                                "rows": rows}))
    return path


def test_vs_single_gpu_best_from_a_file(tmp_path):
    path = _composed(tmp_path, [
        {"setup": "hf-liger", "preset": "llama-7b-8l", "seq_len": 4096, "mfu": 0.52},
        {"setup": "ours-bf16", "preset": "llama-7b-8l", "seq_len": 4096, "mfu": 0.6,
         "tokens_per_s": 52000.0},
        {"setup": "ours-bf16", "preset": "llama-7b", "seq_len": 4096, "mfu": 0.5}])
    best = cp.single_gpu_best(path, "llama-7b-8l", 4096)
    assert (best["mfu"], best["tokens_per_s"], best["git_sha"], best["file"]) == (
        0.6, 52000.0, "abc123", str(path))
    assert "why" not in best
    assert cp.vs_single_gpu_best(0.45, best) == pytest.approx(0.75)
    assert cp.vs_single_gpu_best(None, best) is None


def test_vs_single_gpu_best_absent(tmp_path):
    best = cp.single_gpu_best(tmp_path / "composed.json", "llama-7b-8l", 4096)
    assert best["mfu"] is None and cp.vs_single_gpu_best(0.45, best) is None
    assert best["why"].startswith(f"no {tmp_path / 'composed.json'}: run")
    # a file without the row for this preset and sequence: also None, and said
    path = _composed(tmp_path, [{"setup": "ours-bf16", "preset": "llama-7b-8l",
                                 "seq_len": 8192, "mfu": 0.6}])
    best = cp.single_gpu_best(path, "llama-7b-8l", 4096)
    assert best["mfu"] is None and best["git_sha"] == "abc123"
    assert best["why"] == (f"{path} has no 'ours-bf16' row with an MFU for llama-7b-8l at "
                           "sequence 4096")


def test_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "colossal_lab", "bench", cp.NAME],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs CUDA" in lines[0] and cp.NAME in lines[0]
