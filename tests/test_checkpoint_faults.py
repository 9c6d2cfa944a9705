"""Faults injected into training runs: nothing good is ever lost, nothing bad goes on.

A save killed at each of its named phases (`checkpoint_io.PHASES`, through the test
hook) and once by a real SIGKILL; a truncated and a bit-flipped shard; a fresh run into
a used save-dir and two runs into one; paths that cannot be written; resumes that would
not continue the run; a NaN loss; SIGTERM; FSDP2 with evaluation on two gloo ranks.
After each, the last good checkpoint resumes to the uninterrupted run's losses, bit
for bit. Runs are tiny (a 2-layer model, 16 tokens) and in-process, but for the kill.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from colossal_lab.config import Switches, tiny
from colossal_lab.parallel import distributed
from colossal_lab.training import checkpoint_io, train
from colossal_lab.training.checkpoint_io import CheckpointError
from colossal_lab.training.save_lock import SaveDirLock

CFG = tiny()
SW = Switches.naive("fp32")
RUN = dict(batch=4, seq_len=16, lr=3e-3, data="random", progress=False, log_every=1,
           eval_batches=1)
ROOT = Path(__file__).resolve().parents[1]


class Killed(BaseException):
    """Stands for the process dying at the hook's phase (not an Exception: nothing in
    the library may catch it)."""


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted run's losses, 6 steps."""
    return train.train(CFG, SW, steps=6, **RUN).losses


def _kill_at(phase: str, step: int, truncate: bool = False):
    def hook(name, folder):
        if name == phase and folder.name.endswith(f"step_{step}"):
            if truncate:
                shard = next(folder.glob("*.distcp"))
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            raise Killed(phase)
    return hook


@pytest.mark.parametrize("phase", checkpoint_io.PHASES)
def test_a_save_killed_at_any_phase_loses_nothing(phase, tmp_path, monkeypatch, straight):
    """Killed while saving step 4: the run resumes from step 2 (or, killed after
    `latest` moved, from step 4) and follows the uninterrupted run exactly."""
    train.train(CFG, SW, steps=2, save_dir=tmp_path, **RUN)
    monkeypatch.setattr(checkpoint_io, "fault_hook",
                        _kill_at(phase, 4, truncate=phase == "mid_shard"))
    with pytest.raises(Killed):
        train.train(CFG, SW, steps=4, save_dir=tmp_path, resume=True, **RUN)
    monkeypatch.setattr(checkpoint_io, "fault_hook", None)
    committed = phase == "after_latest"
    assert (tmp_path / "latest").read_text() == ("step_4" if committed else "step_2")
    resumed = train.train(CFG, SW, steps=6, save_dir=tmp_path, resume=True, **RUN)
    assert resumed.losses == straight
    kept = "step_4" if committed else "step_2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", kept, "step_6"]


KILLED_RUN = """
import sys, time
from pathlib import Path
from colossal_lab.__main__ import main
from colossal_lab.training import checkpoint_io

def hook(name, folder):
    if name == "mid_shard" and folder.name.endswith("step_4"):
        Path(sys.argv[1]).write_text("saving")
        time.sleep(120)

checkpoint_io.fault_hook = hook
main(sys.argv[2:])
"""


def test_a_real_sigkill_during_a_save(tmp_path, straight):
    """A process SIGKILLed with its step-4 shards half done: while it lives, a second
    run into the save-dir is refused by name; once dead, its lock is gone and step 2
    resumes exactly."""
    save = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--switches", "naive", "--data", "random",
            "--batch", "4", "--seq-len", "16", "--lr", "3e-3", "--save-dir", str(save)]
    train.train(CFG, SW, steps=2, save_dir=save, **RUN)
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(marker), *args,
                             "--steps", "4", "--resume"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(CheckpointError, match=f"in use by another run.*pid {proc.pid}"):
            train.train(CFG, SW, steps=6, save_dir=save, resume=True, **RUN)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(save.glob(".partial-step_4/*.distcp"))  # it died mid-save
    assert (save / "latest").read_text() == "step_2"
    resumed = train.train(CFG, SW, steps=6, save_dir=save, resume=True, **RUN)
    assert resumed.losses == straight


@pytest.mark.parametrize("damage", ["bit-flip", "truncate"])
def test_a_damaged_shard_is_detected_and_the_previous_one_resumes(damage, tmp_path,
                                                                   straight, capsys):
    train.train(CFG, SW, steps=4, save_every=2, save_dir=tmp_path, **RUN)
    shard = next((tmp_path / "step_4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "bit-flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[:-100]
    shard.write_bytes(bytes(data))
    resumed = train.train(CFG, SW, steps=6, save_dir=tmp_path, resume=True, **RUN)
    assert resumed.losses == straight
    err = capsys.readouterr().err
    assert "step_4 is corrupt" in err and "resuming from" in err and "step_2" in err
    # the one checkpoint left damaged: a clear error, no training on garbage
    shard = next((tmp_path / "step_6").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert [p.name for p in checkpoint_io.step_folders(tmp_path)] == ["step_6", "step_2"]
    assert (tmp_path / "corrupt-step_4").is_dir()  # set aside, for a look
    shutil.rmtree(tmp_path / "step_2")
    with pytest.raises(CheckpointError, match="step_6 is corrupt.*no older checkpoint"):
        train.train(CFG, SW, steps=8, save_dir=tmp_path, resume=True, **RUN)


def test_a_fresh_run_refuses_a_used_save_dir(tmp_path, straight):
    train.train(CFG, SW, steps=4, save_dir=tmp_path, **RUN)
    with pytest.raises(CheckpointError, match="not empty: continue its run with --resume"):
        train.train(CFG, SW, steps=2, save_dir=tmp_path, **RUN)
    assert (tmp_path / "latest").read_text() == "step_4"  # untouched
    r = train.train(CFG, SW, steps=2, save_dir=tmp_path, overwrite=True, **RUN)
    assert r.losses == straight[:2] and (tmp_path / "latest").read_text() == "step_2"
    assert not (tmp_path / "step_4").exists()


def test_two_runs_cannot_share_a_save_dir(tmp_path):
    with SaveDirLock(tmp_path):
        with pytest.raises(CheckpointError, match=f"in use by another run .*pid {os.getpid()}"):
            train.train(CFG, SW, steps=2, save_dir=tmp_path, **RUN)
    train.train(CFG, SW, steps=2, save_dir=tmp_path, **RUN)  # released: it runs


def test_keep_the_newest_k(tmp_path):
    train.train(CFG, SW, steps=5, save_every=1, keep=2, save_dir=tmp_path / "a", **RUN)
    assert [p.name for p in checkpoint_io.step_folders(tmp_path / "a")] == ["step_5",
                                                                          "step_4"]
    train.train(CFG, SW, steps=3, save_every=1, keep=1, save_dir=tmp_path / "b", **RUN)
    assert [p.name for p in checkpoint_io.step_folders(tmp_path / "b")] == ["step_3"]


def test_paths_that_cannot_be_written_fail_before_training(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(train, "build_model", lambda *a: calls.append(a))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for kw, says in (({"save_dir": "/sys/colossal_lab_ro"}, "cannot be written"),
                     ({"save_dir": a_file / "sub"}, "cannot be written"),
                     ({"save_dir": a_file}, "is a file"),
                     ({"export_hf": a_file}, "is an existing file"),
                     ({"export_hf": "/sys/colossal_lab_ro"}, "cannot be written"),
                     ({"save_dir": ""}, "name a folder")):
        with pytest.raises(ValueError, match=says):
            train.train(CFG, SW, steps=2, **kw, **RUN)
    assert calls == []  # nothing was built


def test_a_save_that_does_not_fit_says_how_much_it_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(CheckpointError, match=r"needs about [\d.]+ MiB and 0.0 MiB"):
        train.train(CFG, SW, steps=2, save_dir=tmp_path, **RUN)
    assert not (tmp_path / "latest").exists()


def test_resume_must_continue_the_same_run(tmp_path):
    train.train(CFG, SW, steps=4, save_dir=tmp_path, **RUN)
    with pytest.raises(CheckpointError, match=r"lr=0.003 \(now 0.001\)"):
        train.train(CFG, SW, steps=6, save_dir=tmp_path, resume=True, **{**RUN, "lr": 1e-3})
    with pytest.raises(CheckpointError, match="--steps 3 is not beyond the checkpoint's "
                                              "step 4"):
        train.train(CFG, SW, steps=3, save_dir=tmp_path, resume=True, **RUN)
    with pytest.raises(CheckpointError, match="--steps 4 is not beyond"):
        train.train(CFG, SW, steps=4, save_dir=tmp_path, resume=True, **RUN)
    with pytest.raises(CheckpointError, match="micro_batch=4 \\(now 2\\)"):
        train.train(CFG, SW, steps=6, save_dir=tmp_path, resume=True, micro_batch=2,
                    **RUN)


def _faulty_step(monkeypatch, at: int, fault):
    """`train.make_step` whose step number `at` (1-based) runs `fault(loss)`."""
    real = train.make_step
    count = [0]

    def make(*a, **kw):
        step = real(*a, **kw)

        class Faulty:
            def __getattr__(self, name):
                return getattr(step, name)

            def __call__(self, ids, labels):
                count[0] += 1
                loss = step(ids, labels)
                return fault(loss) if count[0] == at else loss
        return Faulty()

    monkeypatch.setattr(train, "make_step", make)


def test_a_nan_loss_stops_before_anything_is_saved(tmp_path, monkeypatch):
    _faulty_step(monkeypatch, 3, lambda loss: loss * float("nan"))
    with pytest.raises(train.NonFiniteLoss, match="the loss is nan at step 3"):
        train.train(CFG, SW, steps=5, save_every=1, save_dir=tmp_path,
                    **{**RUN, "log_every": 5})
    assert (tmp_path / "latest").read_text() == "step_2"
    assert [p.name for p in checkpoint_io.step_folders(tmp_path)] == ["step_2", "step_1"]


def test_sigterm_saves_at_the_step_boundary_and_stops(tmp_path, monkeypatch, straight):
    def term(loss):
        os.kill(os.getpid(), signal.SIGTERM)
        return loss
    _faulty_step(monkeypatch, 2, term)
    r = train.train(CFG, SW, steps=6, save_dir=tmp_path, **RUN)
    assert r.stopped_by == "SIGTERM" and r.losses == straight[:2]
    assert r.checkpoint == tmp_path / "step_2"
    monkeypatch.undo()
    resumed = train.train(CFG, SW, steps=6, save_dir=tmp_path, resume=True, **RUN)
    assert resumed.losses == straight


def _fsdp2_on_the_corpus(save_dir: str):
    """One rank: 5 fp32 steps on the corpus with FSDP2 and evaluation at the end; then
    3 steps saved and resumed to 5 (each rank its shards)."""
    sw = Switches.naive("fp32").replace(overlap_communication="fsdp2")
    kw = dict(batch=4, seq_len=32, lr=3e-3, data="corpus", max_files=40, progress=False,
              log_every=1, eval_batches=2)
    full = train.train(CFG, sw, steps=5, **kw)
    train.train(CFG, sw, steps=3, save_dir=save_dir, **kw)
    resumed = train.train(CFG, sw, steps=5, save_dir=save_dir, resume=True, **kw)
    return full.losses, full.val_loss, resumed.losses


def test_fsdp2_evaluates_and_follows_one_process(tmp_path):
    """FSDP2's forward all-gathers from every rank: evaluation runs on both, and the
    global loss follows the one-process run of the same global batches."""
    one = train.train(CFG, SW, steps=5, batch=4, seq_len=32, lr=3e-3, data="corpus",
                      max_files=40, progress=False, log_every=1, eval_batches=2)
    ranks = distributed.spawn(_fsdp2_on_the_corpus, 2, str(tmp_path), timeout_s=240,
                              collective_timeout_s=60)
    for losses, val, resumed in ranks:
        assert len(losses) == 5 and val is not None
        assert max(abs(a - b) for a, b in zip(losses, one.losses)) < 1e-5, \
            (losses, one.losses)
        assert abs(val - one.val_loss) < 1e-5
        assert resumed == losses  # resumed from the 2-rank checkpoint, bit for bit
    assert sorted(p.name for p in (tmp_path / "step_5").glob("rng_*")) == ["rng_0.pt",
                                                                           "rng_1.pt"]
    assert torch.isfinite(torch.tensor(ranks[0][0])).all()


def test_damaged_data_caches_are_rebuilt_with_a_warning(tmp_path):
    """A truncated token cache or a garbled tokenizer cache is named and rebuilt, the
    same ids come back."""
    from colossal_lab.training import data

    ids = data.load_tokens("val", 300, max_files=4, cache_dir=tmp_path)
    (npy,) = tmp_path.rglob("tokens-val-*.npy")
    npy.write_bytes(npy.read_bytes()[:90])
    with pytest.warns(UserWarning, match=f"token cache {npy} damaged"):
        assert torch.equal(data.load_tokens("val", 300, max_files=4, cache_dir=tmp_path),
                           ids)
    (tok,) = tmp_path.rglob("tokenizer-*.json")
    tok.write_text("{garbled")
    with pytest.warns(UserWarning, match="tokenizer cache .* damaged"):
        data.train_tokenizer(300, max_files=4, cache_dir=tmp_path)


def test_a_bf16_pure_export_writes_the_fp32_masters(tmp_path):
    transformers = pytest.importorskip("transformers")
    sw = Switches(False, "torch", "eager", "bf16-pure")
    train.train(CFG, sw, steps=2, export_hf=tmp_path / "hf", **RUN)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    w = hf.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.float32
    assert not torch.equal(w, w.bfloat16().float())  # not bf16 values in fp32 clothes
