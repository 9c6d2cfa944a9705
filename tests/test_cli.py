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
    assert Setup("p", "p", switches=Switches(precision="fp16")).precision == "fp16"
    with pytest.raises(ValueError, match="Hugging Face"):
        from colossal_lab.benchmarks.steps import build

        build(Setup("hf", "hf", impl="hf", switches=Switches(precision="fp8")), "tiny",
              torch.device("cpu"))
