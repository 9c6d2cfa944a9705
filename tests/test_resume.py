"""Checkpoints: a run stopped and resumed follows the uninterrupted run's losses exactly
(on the CPU), in every precision; bad checkpoints are refused with one clear error; the
Hugging Face export loads in `transformers`."""

from __future__ import annotations

import json

import pytest
import torch

from colossal_lab.config import Switches, tiny
from colossal_lab.switches.checkpointing import GradientCheckpointConfig as Ckpt
from colossal_lab.training import checkpoint, train

CFG = tiny().replace(intermediate_size=176)  # widths multiples of 16: fp8 takes every linear
RUN = dict(batch=4, seq_len=16, lr=3e-3, data="random", progress=False, log_every=1,
           eval_batches=1)

SETUPS = {
    "fp32": Switches.naive("fp32"),
    "bf16-pure-fused": Switches(False, "torch", "eager", "bf16-pure"),
    "fp16-ckpt": Switches(False, False, False, "fp16", Ckpt(gradient_checkpointing_ratio=0.5)),
    "fp8-delayed": Switches(False, False, False, "fp8", extra={"fp8_scaling": "delayed",
                                                               "fp8_history": 4}),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_resume_is_exact(name, tmp_path):
    """6 steps straight, against 3 steps, a stop, and a resume to 6 in new objects:
    the same losses to the last bit (model, optimizer incl. fp32 masters, loss scale,
    fp8 amax histories and the data position all restored)."""
    sw = SETUPS[name]
    straight = train.train(CFG, sw, steps=6, **RUN).losses
    first = train.train(CFG, sw, steps=3, save_dir=tmp_path, **RUN)
    assert (tmp_path / "latest").read_text() == "step_3"
    resumed = train.train(CFG, sw, steps=6, save_dir=tmp_path, resume=True, **RUN)
    assert first.losses == straight[:3]
    assert resumed.losses == straight, (resumed.losses, straight)
    assert (tmp_path / "latest").read_text() == "step_6"


def test_save_every_and_resume_mid_run(tmp_path):
    """Checkpoints every 2 steps; resuming from the newest continues the same run."""
    straight = train.train(CFG, Switches.naive("fp32"), steps=5, **RUN).losses
    train.train(CFG, Switches.naive("fp32"), steps=4, save_dir=tmp_path, save_every=2,
                **RUN)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_4"]
    resumed = train.train(CFG, Switches.naive("fp32"), steps=5, save_dir=tmp_path,
                          resume=True, **RUN)
    assert resumed.losses == straight


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="latest is missing"):
        train.train(CFG, Switches.naive("fp32"), steps=2, save_dir=tmp_path, resume=True,
                    **RUN)
    train.train(CFG, Switches.naive("fp32"), steps=2, save_dir=tmp_path, **RUN)
    with pytest.raises(checkpoint.CheckpointError, match="other switches"):
        train.train(CFG, Switches.naive("bf16"), steps=3, save_dir=tmp_path, resume=True,
                    **RUN)
    with pytest.raises(checkpoint.CheckpointError, match="same batch"):
        train.train(CFG, Switches.naive("fp32"), steps=3, save_dir=tmp_path, resume=True,
                    **{**RUN, "batch": 2})
    (tmp_path / "step_2" / "train.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        train.train(CFG, Switches.naive("fp32"), steps=3, save_dir=tmp_path, resume=True,
                    **RUN)
    (tmp_path / "step_2" / "train.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        train.train(CFG, Switches.naive("fp32"), steps=3, save_dir=tmp_path, resume=True,
                    **RUN)
    with pytest.raises(ValueError, match="resume needs save_dir"):
        train.train(CFG, Switches.naive("fp32"), steps=3, resume=True, **RUN)


def test_corrupt_shard_is_one_clear_error(tmp_path):
    train.train(CFG, Switches.naive("fp32"), steps=1, save_dir=tmp_path, **RUN)
    shard = next((tmp_path / "step_1").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        train.train(CFG, Switches.naive("fp32"), steps=2, save_dir=tmp_path, resume=True,
                    **RUN)


def test_checkpoint_records_the_run(tmp_path):
    train.train(CFG, Switches.naive("fp16"), steps=2, save_dir=tmp_path, **RUN)
    state = json.loads((tmp_path / "step_2" / "train.json").read_text())
    assert state["step"] == 2 and len(state["losses"]) == 2
    assert state["made_with"]["switches"]["precision"] == "fp16"
    assert state["scaler"]["scale"] > 0 and state["run"]["batch"] == 4


def test_export_hf_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    sw = Switches(False, "torch", "eager", "fp32")  # fused projections: HF names anyway
    train.train(CFG, sw, steps=2, export_hf=tmp_path / "hf", **RUN)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    assert hf(ids).logits.shape == (2, 12, CFG.vocab_size)
    assert torch.isfinite(hf(ids).logits).all()


def test_bad_runs_fail_before_building():
    for kw, match in (({"steps": 0}, "steps=0"), ({"batch": 0}, "batch=0"),
                      ({"lr": -1.0}, "lr=-1.0"), ({"seq_len": 0}, "seq_len=0"),
                      ({"data": "web"}, "data='web'"), ({"save_every": -1}, "save_every")):
        with pytest.raises(ValueError, match=match):
            train.train(CFG, Switches.naive("fp32"), **{**RUN, **kw})
