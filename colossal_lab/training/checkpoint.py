"""Training checkpoints that resume exactly, in `torch.distributed.checkpoint` format.

A checkpoint is a folder `<dir>/step_<N>/` holding everything the next step depends on:

    model          parameters and buffers (Hugging Face names, whatever the switches)
    optimizer      its state: AdamW moments, or MasterAdamW's fp32 masters and moments
    fp8            the amax histories of fp8 linears (delayed scaling reads them; where
                   each writes next is in train.json)
    train.json     step, the losses so far, the data position, the loss scale, the
                   switches and model config it was made with
    rng.pt         CPU and CUDA generator states

Tensors go through `torch.distributed.checkpoint` (DCP): one process writes one shard
today, and the same format is what sharded multi-GPU runs save and load (each rank its
part), so nothing changes when data and tensor parallelism arrive. `<dir>/latest` names
the newest complete checkpoint; it is written last, so an interrupted save leaves the
previous one in charge. Resuming needs the same switches and model config: a checkpoint
made with others is refused, with what differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: missing, incomplete, corrupt, or made
    with other switches or another model."""


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    return dcp, get_optimizer_state_dict, set_optimizer_state_dict


def _model_state(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their module names as the model holds
    them now (a fused `qkv_proj` stays one tensor), loaded in place by DCP. The
    Hugging Face layout is for exports (`--export-hf`), not for resuming."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        for b, buf in mod.named_buffers(recurse=False):
            if b not in mod._non_persistent_buffers_set:
                state[f"{mod_name}.{b}" if mod_name else b] = buf
    return state


def _fp8_state(model) -> dict[str, torch.Tensor]:
    """The fp8 amax histories (non-persistent buffers, so not in the state dict)."""
    return {f"{name}.{b}": buf for name, m in model.named_modules()
            for b, buf in m.named_buffers(recurse=False) if b.startswith("amax_history")}


def _fp8_scaling(model) -> dict[str, dict]:
    """Host-side delayed-scaling state of each fp8 linear (`Fp8Linear.scaling_state`)."""
    return {name: m.scaling_state() for name, m in model.named_modules()
            if hasattr(m, "scaling_state")}


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*")
        return fn(*args, **kwargs)


def describe(switches, cfg) -> dict:
    """What a checkpoint must match to be resumed: switches and model config as JSON."""
    sw = dataclasses.asdict(switches)
    return {"switches": json.loads(json.dumps(sw, default=str)),
            "model": dataclasses.asdict(cfg)}


def save(directory: str | Path, step: int, model, optimizer, *, train_state: dict,
         scaler=None) -> Path:
    """Write `<directory>/step_<step>/` and point `<directory>/latest` at it."""
    dcp, get_optim, _ = _dcp()
    directory = Path(directory)
    path = directory / f"step_{step}"
    state = {"model": _model_state(model), "optimizer": get_optim(model, optimizer),
             "fp8": _fp8_state(model)}
    _quiet(dcp.save, state, checkpoint_id=str(path))
    extra = {**train_state, "step": step, "fp8_scaling": _fp8_scaling(model),
             "scaler": scaler.state_dict() if scaler is not None else None}
    (path / "train.json").write_text(json.dumps(extra, indent=1))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, path / "rng.pt")
    tmp = directory / (LATEST + ".tmp")
    tmp.write_text(path.name)
    os.replace(tmp, directory / LATEST)  # atomic: the old one stays until this lands
    return path


def find(directory: str | Path) -> Path:
    """The newest complete checkpoint under `directory` (what `latest` names)."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists():
        raise CheckpointError(f"no checkpoint to resume in {directory} "
                              f"({LATEST} is missing): train with --save-dir first")
    path = directory / pointer.read_text().strip()
    for part in ("train.json", "rng.pt", ".metadata"):
        if not (path / part).exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {part} is missing")
    return path


def load(directory: str | Path, model, optimizer, *, expect: dict, scaler=None) -> dict:
    """Restore model, optimizer, fp8 histories, loss scale and RNG from the newest
    checkpoint under `directory`; returns its train state (step, losses, data
    position). `expect` (`describe`) must match what the checkpoint was made with."""
    dcp, get_optim, set_optim = _dcp()
    path = find(directory)
    try:
        extra = json.loads((path / "train.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: train.json: {e}") from None
    made = extra.get("made_with")
    if made != expect:
        diff = sorted(k for k in set(made or {}) | set(expect)
                      if (made or {}).get(k) != expect.get(k))
        raise CheckpointError(f"checkpoint {path} was made with other {', '.join(diff)}: "
                              "resume with the same switches and preset")
    state = {"model": _model_state(model), "optimizer": get_optim(model, optimizer),
             "fp8": _fp8_state(model)}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _quiet(dcp.load, state, checkpoint_id=str(path))
        rng = torch.load(path / "rng.pt", weights_only=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- one clear message
        raise CheckpointError(f"checkpoint {path} is corrupt: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}") from None
    set_optim(model, optimizer, optim_state_dict=state["optimizer"])  # model: in place
    modules = dict(model.named_modules())
    for name, st in extra.get("fp8_scaling", {}).items():
        modules[name].load_scaling_state(st)
    if scaler is not None and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return extra
