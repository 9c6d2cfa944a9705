"""Every command's user errors end in one line and exit status 2; bugs keep their traceback.

Each case runs `main(argv)` in this process (the `--nproc` ones stop in the parent,
before torchrun starts) and checks the last line of stderr: ``python -m colossal_lab
CMD: error: ...`` with the expected words, and no traceback. An internal error injected
into `train` is not swallowed: it propagates (exit status 1 with its traceback).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colossal_lab.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
T = ["train", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq-len", "16",
     "--data", "random", "--switches", "naive"]
READ_ONLY = "/sys/colossal_lab_ro"  # not writable, even by root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the cases refer to: a made checkpoint, bad switches files, a plain file."""
    d = tmp_path_factory.mktemp("cli")
    main([*T, "--save-dir", str(d / "run")])
    (d / "file").write_text("not a folder")
    (d / "extra.json").write_text(json.dumps({"extra": "x"}))
    (d / "typo.json").write_text(json.dumps({"extra": {"fp8_scalng": "delayed"}}))
    (d / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (d / "notes.txt").write_text("hello")
    (d / "fake.ipynb").write_text("[1, 2]")
    for name, damage in (("badjson", "train.json"), ("latestdir", "latest")):
        main([*T, "--save-dir", str(d / name)])
        if damage == "train.json":
            (d / name / "step_2" / "train.json").write_text("{oops")
        else:
            (d / name / "latest").unlink()
            (d / name / "latest").mkdir()
    return d


def _argv(args, d: Path):
    return [a.replace("{d}", str(d)) for a in args]


CASES = [
    # train: the cases
    ([*T, "--device", "cuda"], "no CUDA GPU here"),
    ([*T, "--save-dir", READ_ONLY], "cannot be written"),
    ([*T, "--export-hf", READ_ONLY], "cannot be written"),
    ([*T, "--export-hf", "{d}/file"], "is an existing file"),
    ([*T, "--switches", "{d}/extra.json"], "extra='x' must be a JSON object"),
    ([*T, "--switches", "{d}/typo.json"], "unknown extra keys ['fp8_scalng']; known: "),
    ([*T, "--fp8-scaling", "delayed"], "--fp8-scaling delayed needs --precision fp8"),
    ([*T, "--steps", "3", "--save-dir", "{d}/badjson", "--resume"],
     "is corrupt: train.json"),
    ([*T, "--steps", "3", "--save-dir", "{d}/latestdir", "--resume"], "is a folder"),
    ([*T, "--steps", "1e23"], "'1e23' is not a whole number"),
    ([*T, "--steps", "100000000000000000000000"], "is more than 1,000,000,000"),
    ([*T, "--batch", "1e20"], "'1e20' is not a whole number"),
    ([*T, "--batch", "100000000000000000000"], "tokens per step is more than"),
    ([*T, "--seq-len", "99999999999"], "max_position_embeddings=256"),
    ([*T, "--nproc", "3"], "batch=2 must divide over 3 data-parallel ranks"),
    ([*T, "--nproc", "2", "--save-dir", "{d}/run"], "is not empty"),
    ([*T, "--save-dir", "{d}/run"], "is not empty: continue its run with --resume"),
    ([*T, "--save-dir", "{d}/run", "--resume"], "--steps 2 is not beyond"),
    ([*T, "--steps", "3", "--save-dir", "{d}/run", "--resume", "--lr", "0.01"],
     "lr=0.0003 (now 0.01)"),
    ([*T, "--save-dir", ""], "--save-dir is empty"),
    # train: more of ours
    ([*T, "--device", "tpu"], "--device tpu"),
    ([*T, "--device", "cuda:7"], "cuda:7"),
    ([*T, "--save-dir", "{d}/file"], "is a file, not a folder"),
    ([*T, "--save-dir", "{d}/file/sub"], "cannot be written"),
    ([*T, "--export-hf", ""], "--export-hf is empty"),
    ([*T, "--save-dir", "{d}/x", "--resume", "--overwrite"], "contradict"),
    ([*T, "--save-dir", "{d}/empty", "--resume"], "no checkpoint to resume"),
    ([*T, "--nproc", "2", "--export-hf", "{d}/hf2"], "export of a run on several ranks"),
    ([*T, "--nproc", "2", "--switches", "{d}/typo.json"], "unknown extra keys"),
    ([*T, "--steps", "3", "--nproc", "2", "--save-dir", "{d}/run", "--resume"],
     "world_size=1 (now 2)"),
    ([*T, "--steps", "3", "--save-dir", "{d}/run", "--resume", "--precision", "bf16"],
     "made with other switches"),
    ([*T, "--steps", "3", "--save-dir", "{d}/run", "--resume", "--preset", "1b"],
     "made with other model"),
    ([*T, "--switches", "{d}/binary.json"], "not valid JSON"),
    ([*T, "--switches", "{d}"], "neither a set"),
    ([*T, "--keep", "0"], "--keep: 0 must be >= 1"),
    # the other commands
    (["bench", "nosuchbench"], "unknown benchmark 'nosuchbench'"),
    (["bench", "spot_check", "--checks", "nosuch:x"], "write FILE:SETUP"),
    (["bench", "spot_check", "--old-tree", "{d}"], "no colossal_lab package"),
    (["bench", "pipeline_sim", "--reps", "3"], "time at least 20"),
    (["bench", "composed", "--pairs", "2", "--quick"], "--pairs N (N >= 1)"),
    (["bench", "composed", "--setups", "nosuch"], "invalid choice: 'nosuch'"),
    (["bench", "composed_curves", "--budget-s", "soon"], "invalid float value"),
    (["execute", "{d}/missing.ipynb"], "no such notebook"),
    (["execute", "{d}/notes.txt"], "is not a Jupyter notebook"),
    (["execute", "{d}/fake.ipynb"], "is not a Jupyter notebook"),
    (["doctor", "--switches", '{"extra": "x"}'], "extra='x' must be a JSON object"),
    (["doctor", "--switches", "{d}/typo.json"], "unknown extra keys"),
    (["doctor", "--pp", "4", "--batch", "4", "--microbatches", "3"],
     "--microbatches 3 must divide --batch 4"),
    (["doctor", "--preset", "tiny", "--profile", "--trace", READ_ONLY + "/t.json"],
     "cannot be written"),
    (["doctor", "--preset", "tiny", "--profile", "--trace", "{d}"], "is a folder"),
    (["env", "--no-measure", "--save"], "drop --no-measure"),
    (["wheelhouse", "--python", "312"], "give the node's version as 3.N"),
    (["wheelhouse", "--dest", READ_ONLY + "/whl"], "cannot be created"),
]


def _id(x):
    if isinstance(x, list):
        return " ".join(["train", *x[len(T):]] if x[:len(T)] == T else x)
    return None


@pytest.mark.parametrize("args, says", CASES, ids=_id)
def test_user_errors_are_one_line_and_exit_2(args, says, files, capsys):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as e:
        main(_argv(args, files))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2, err
    assert lines[-1].startswith(f"python -m colossal_lab {args[0]}: error: "), lines[-1]
    assert says in lines[-1], lines[-1]
    assert "Traceback" not in err


def test_bench_help_lists_the_benchmarks(capsys):
    main(["bench", "--help"])
    assert "composed" in capsys.readouterr().out


def test_an_internal_error_keeps_its_traceback(monkeypatch):
    """A bug is not a user error: it propagates in-process, and exits 1 with its
    traceback from the command line."""
    from colossal_lab.training import train

    def boom(*a, **kw):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(train, "train", boom)
    with pytest.raises(RuntimeError, match="an internal bug"):
        main(T)
    code = ("from colossal_lab.training import train\n"
            "def boom(*a, **kw): raise RuntimeError('an internal bug')\n"
            "train.train = boom\n"
            "from colossal_lab.__main__ import main\n"
            f"main({T!r})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "RuntimeError: an internal bug" in out.stderr
