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


@pytest.mark.parametrize("argv, says", [(["bench", "nope"], "unknown benchmark 'nope'"),
                                        (["bench"], "which benchmark?")])
def test_bench_user_errors_are_one_line_and_exit_2(argv, says, capsys):
    from colossal_lab.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err
    assert "composed" in err  # names the benchmarks there are


def test_bench_help_lists_the_benchmarks(capsys):
    from colossal_lab.__main__ import main

    main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in benchmarks.BENCHMARKS)


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


BAD_TRAIN_ARGS = [
    (["--steps", "0"], "--steps: 0 must be >= 1"),
    (["--steps", "x"], "'x' is not a whole number"),
    (["--batch", "0"], "--batch: 0 must be >= 1"),
    (["--micro-batch", "0"], "--micro-batch: 0 must be >= 1"),
    (["--batch", "4", "--micro-batch", "3"], "micro_batch=3 must divide batch=4"),
    (["--seq-len", "1"], "--seq-len: 1 must be >= 2"),
    (["--lr", "0"], "--lr: 0.0 must be a positive number"),
    (["--lr", "nan"], "--lr: nan must be a positive number"),
    (["--preset", "gpt5"], "invalid choice: 'gpt5'"),
    (["--data", "web"], "invalid choice: 'web'"),
    (["--vocab-size", "1"], "--vocab-size: 1 must be >= 2"),
    (["--max-files", "0"], "--max-files: 0 must be >= 1"),
    (["--seed", "-1"], "--seed: -1 must be >= 0"),
    (["--log-every", "0"], "--log-every: 0 must be >= 1"),
    (["--attention", "fast"], "'fast'; choose true, false or one of"),
    (["--norm", "apex2"], "'apex2'; choose true, false or one of"),
    (["--projections", "cuda"], "'cuda'; choose true, false or one of"),
    (["--rope", "fast"], "'fast'; choose true, false or one of"),
    (["--loss", "fast"], "'fast'; choose true, false or one of"),
    (["--embedding", "sparse"], "'sparse'; choose true, false or one of"),
    (["--checkpointing", "half"], "invalid choice: 'half'"),
    (["--ckpt-ratio", "1.5"], "--ckpt-ratio: 1.5 must be in [0, 1]"),
    (["--precision", "fp4"], "invalid choice: 'fp4'"),
    (["--fp8-scaling", "lazy"], "invalid choice: 'lazy'"),
    (["--compile", "graphs"], "'graphs'; choose true, false or one of layers, model, graph"),
    (["--compile", "layers", "--compile-backend", "nope"], "compile_backend']='nope'"),
    (["--switches", "fastest"], "neither a set"),
    (["--save-every", "-2"], "--save-every: -2 must be >= 0"),
    (["--resume"], "resume needs save_dir"),
    (["--precision", "fp8", "--fp8-scaling", "delayed", "--checkpointing", "selective"],
     "fp8_scaling='delayed'"),
]


@pytest.mark.parametrize("args,message", BAD_TRAIN_ARGS, ids=lambda x: " ".join(x)
                         if isinstance(x, list) else None)
def test_train_cli_bad_input_is_one_line(args, message, capsys):
    """Every bad value ends in argparse's way: exit status 2 and one error line, never
    a traceback from inside the run."""
    from colossal_lab.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--data", "random", "--steps", "2", "--batch", "2", "--seq-len",
              "16", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m colossal_lab train: error: ")
    assert message in err[-1], err[-1]
    assert "Traceback" not in "\n".join(err)


def test_train_cli_switches_file_and_resume(tmp_path, capsys):
    """A switches file, flags over it, a checkpoint, an exact resume, a corrupt file."""
    import json

    from colossal_lab.__main__ import main
    from colossal_lab.training.cli import load_switches

    f = tmp_path / "sw.json"
    f.write_text(json.dumps({"precision": "fp32", "enable_fused_projections": "eager",
                             "gradient_checkpoint_config": {"mode": "selective"}}))
    sw = load_switches(str(f))
    assert sw.precision == "fp32" and sw.gradient_checkpoint_config.mode == "selective"
    base = ["train", "--data", "random", "--batch", "2", "--seq-len", "16", "--switches",
            str(f), "--norm", "torch", "--log-every", "1", "--save-dir", str(tmp_path / "c")]
    main([*base, "--steps", "2"])
    main([*base, "--steps", "3", "--resume"])
    out = capsys.readouterr().out
    assert "checkpoint:" in out and (tmp_path / "c" / "latest").read_text() == "step_3"
    f.write_text("{\"precision\": ")
    with pytest.raises(SystemExit):
        main([*base, "--steps", "1"])
    assert "not valid JSON" in capsys.readouterr().err
    f.write_text(json.dumps({"precison": "fp32"}))
    with pytest.raises(SystemExit):
        main([*base, "--steps", "1"])
    assert "unknown fields ['precison']" in capsys.readouterr().err


def test_composed_quick_runs_every_setup():
    """`bench composed --quick`: every finale setup runs (tiny model, CPU) and records
    the backends that ran: our RoPE and fused loss where asked for."""
    from colossal_lab.benchmarks import composed
    from colossal_lab.benchmarks.steps import runs_quick

    rows = composed.run(quick=True)
    by = {r["setup"]: r for r in rows}
    # Liger and torchao need a GPU; compiled setups minutes of compilation
    left = {"hf-liger", "ours-bf16-compile", "ours-bf16-graph", "ours-fp8",
            "hf-torchao-fp8", "hf-torchao-fp8-rowwise"}
    assert {s.name for s in composed.SETUPS if not runs_quick(s)} == left
    assert set(by) == set(composed.SETUP_NAMES) - left
    assert not [r for r in rows if "error" in r]
    assert by["ours-bf16"]["precision"] == "bf16-pure"
    assert by["ours-bf16"]["loss_backend"] == "chunked"  # True on a CPU: torch chunks
    assert by["ours-bf16-s123"]["rope_backend"] == "eager"
    # our AdamW's options: on a CPU True picks torch's, which neither defers nor keeps
    # bf16 moments, and the rows say what ran
    gpu = torch.cuda.is_available()
    assert by["ours-bf16-defer"]["optimizer_deferred"] is gpu
    assert not by["ours-bf16"]["optimizer_deferred"]
    assert by["ours-bf16"]["optimizer_moments"] == ("bf16" if gpu else "fp32")


def test_train_cli_on_two_processes_follows_one(tmp_path):
    """`train --nproc 2` re-launches itself through torchrun (gloo on the CPU); the two
    ranks split each global batch and reduce their gradients (switch 8, ours), so the
    loss follows the one-process run of the same global batches."""
    args = ["train", "--preset", "tiny", "--data", "random", "--steps", "4", "--batch",
            "4", "--seq-len", "16", "--switches", "naive", "--log-every", "1"]
    one = run(*args)
    two = run(*args, "--nproc", "2", "--dp", "overlap", "--dp-bucket-elems", "20000",
              "--dist-timeout", "60")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-2000:]
    assert "2 ranks (gloo), gradient reduction overlap" in two.stdout
    loss = [float(next(x for x in o.stdout.splitlines() if x.startswith("final loss"))
                  .split()[2].rstrip(",")) for o in (one, two)]
    assert abs(loss[0] - loss[1]) < 1e-4, loss  # fp32: reduction order only
    assert two.stdout.count("final loss") == 1  # rank 0 prints
