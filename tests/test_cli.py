import subprocess
import sys

import pytest
import torch

from colossal_lab import benchmarks
from colossal_lab.benchmarks import baseline


def run(*args):
    return subprocess.run([sys.executable, "-m", "colossal_lab", *args], capture_output=True,
                          text=True, timeout=300)


def test_env_prints_device():
    out = run("env", "--no-measure")
    assert out.returncode == 0, out.stderr
    assert "device" in out.stdout and "torch" in out.stdout


def test_train_cli_runs():
    out = run("train", "--preset", "tiny", "--steps", "3", "--data", "random", "--batch", "2",
              "--seq-len", "32", "--precision", "fp32", "--log-every", "1")
    assert out.returncode == 0, out.stderr
    assert "final loss" in out.stdout and "MFU" in out.stdout


def test_unknown_benchmark():
    with pytest.raises(ValueError, match="unknown benchmark"):
        benchmarks.get("nope")


def test_baseline_quick_rows():
    rows = baseline.run(quick=True)
    assert [r["setup"] for r in rows] == ["ours-fp32-naive", "ours-bf16-naive",
                                          "ours-bf16-sdpa", "hf-bf16-sdpa"]
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < r["mfu_attn"]


def test_isolated_setup_and_failure_row():
    from colossal_lab.benchmarks.steps import Setup, measure_isolated

    setup = next(s for s in baseline.SETUPS if s.name == "ours-bf16-sdpa")
    ok = measure_isolated(setup, "tiny", 32, 2)
    assert "error" not in ok and ok["setup"] == "ours-bf16-sdpa" and ok["tokens_per_s"] > 0
    assert ok["attention_backend"] == "sdpa" and ok["norm_backend"] == "torch"
    assert len(ok["step_ms_all"]) == ok["steps_timed"] == len(ok["gc_ms_all"])
    bad = measure_isolated(Setup("broken", "broken", impl="nonsense"), "tiny", 32, 2)
    assert "nonsense" in bad["error"]


def test_setup_json_round_trip():
    from colossal_lab.benchmarks.steps import Setup

    for s in baseline.SETUPS:
        assert Setup.from_json(s.to_json()) == s


def test_setup_rules():
    from colossal_lab.benchmarks.steps import Setup
    from colossal_lab.config import Switches

    with pytest.raises(ValueError, match="at least 20"):
        Setup("short", "short", iters=8)
    assert not hasattr(Setup("p", "p"), "precision")  # the switches hold it, only they
    with pytest.raises(ValueError, match="Hugging Face"):
        from colossal_lab.benchmarks.steps import build

        build(Setup("hf", "hf", impl="hf", switches=Switches(precision="fp8")), "tiny",
              torch.device("cpu"))


def test_spot_check_rows_and_quick_run():
    """`bench spot_check`: the recorded row found by FILE:SETUP, the verdict from
    `compare.versus`, and the quick CPU run compares a fresh row with itself."""
    from colossal_lab.benchmarks import spot_check

    setup, recorded, prov = spot_check.find("precision_step:fp8-delayed", gpu="h200")
    assert setup.switches.precision == "fp8" and recorded["setup"] == "fp8-delayed"
    assert prov["git_sha"]
    with pytest.raises(ValueError, match="FILE:SETUP"):
        spot_check.find("precision_step")
    with pytest.raises(ValueError, match="recorded rows"):
        spot_check.find("precision_step:fp9", gpu="h200")
    slower = {**recorded, "step_ms": recorded["step_ms_p90"] * 1.2,
              "step_ms_p10": recorded["step_ms_p90"] * 1.1,
              "step_ms_p90": recorded["step_ms_p90"] * 1.3}
    row = spot_check.spot_row("x", recorded, prov, slower)
    assert row["verdict"] == "slower" and not row["level"]
    assert row["speedup_vs_recorded"] == pytest.approx(1 / 1.2 * recorded["step_ms"]
                                                       / recorded["step_ms_p90"])
    assert spot_check.spot_row("x", recorded, prov, recorded)["verdict"] == "level"
    failed = spot_check.spot_row("x", recorded, prov, {"error": "out of memory"})
    assert failed["error"] == "out of memory" and "verdict" not in failed
    rows = spot_check.run(quick=True)
    assert rows[0]["verdict"] == "level" and rows[0]["speedup_vs_recorded"] == 1.0
    assert "level" in spot_check.summary(rows)
