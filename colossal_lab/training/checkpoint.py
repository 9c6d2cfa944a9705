"""Training checkpoints that resume exactly, in `torch.distributed.checkpoint` format.

A checkpoint is a folder `<dir>/step_<N>/` holding everything the next step depends on:

    model          parameters and buffers (Hugging Face names, whatever the switches)
    optimizer      its state: AdamW moments, or MasterAdamW's fp32 masters and moments
    fp8            the amax histories of fp8 linears (delayed scaling reads them; where
                   each writes next is in train.json)
    train.json     step, the losses so far, the data position, the loss scale, the
                   switches, model config and run (batch, lr, ranks, ...) it was made with
    rng_<rank>.pt  each rank's CPU and CUDA generator states
    manifest.json  every file's size and SHA-256 (`checkpoint_io`)

Tensors go through `torch.distributed.checkpoint` (DCP): under data parallelism each
rank writes its part (FSDP2's shards; a replicated tensor once) and loads its part back.
How a checkpoint reaches the disk (a folder written aside, then renamed; `<dir>/latest`
moved last; the newest `keep` kept; checksums verified on resume) is `checkpoint_io`'s
job. Resuming needs the same switches and model config: a checkpoint made with others
is refused, with what differs.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from colossal_lab.parallel import distributed
from colossal_lab.training import checkpoint_io
from colossal_lab.training.checkpoint_io import LATEST, CheckpointError

__all__ = ["LATEST", "REQUIRED", "CheckpointError", "check_made_with", "describe", "find",
           "load", "read", "save"]


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


def _bytes(state: dict) -> int:
    """Bytes the checkpoint of `state` takes, summed over the ranks: a sharded tensor
    (`DTensor`) counts its local shard on every rank, a replicated one counts once."""
    total = 0
    for t in _tensors(state):
        local = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(t, "to_local") or distributed.rank() == 0:
            total += local.numel() * local.element_size()
    return int(distributed.all_sum([float(total)])[0])


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _rng_name(rank: int) -> str:
    return f"rng_{rank}.pt"


def _agree(error: str | None) -> None:
    """Raise `error` on every rank if any rank has one (a rank that raised alone would
    leave the others waiting in the save's collectives)."""
    failed = distributed.all_max([1.0 if error else 0.0])[0]
    if failed:
        raise CheckpointError(error or "another rank could not save its checkpoint")


def save(directory: str | Path, step: int, model, optimizer, *, train_state: dict,
         scaler=None, keep: int = 2) -> Path:
    """Write ``<directory>/step_<step>/`` beside the others and point ``latest`` at it
    (`checkpoint_io`: a new folder, fsync, rename, then `latest`), keeping the newest
    `keep`. Every rank calls it: each writes its shards and its RNG state, rank 0 the
    train state and the manifest, and renames after a barrier."""
    dcp, get_optim, _ = _dcp()
    directory = Path(directory)
    rank = distributed.rank()
    state = {"model": _model_state(model), "optimizer": get_optim(model, optimizer),
             "fp8": _fp8_state(model)}
    need = int(_bytes(state) * 1.05) + (1 << 20)
    error = None
    if rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            checkpoint_io.check_free_space(directory, need)
        except (CheckpointError, OSError) as e:
            error = str(e)
    _agree(error)
    tmp = directory / f"{checkpoint_io.PARTIAL}step_{step}"
    if rank == 0:
        checkpoint_io.begin(directory, step)
        checkpoint_io.phase("before_shards", tmp)
    distributed.barrier()
    _quiet(dcp.save, state, checkpoint_id=str(tmp))
    checkpoint_io.phase("mid_shard", tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / _rng_name(rank))
    extra = {**train_state, "step": step, "fp8_scaling": _fp8_scaling(model),
             "scaler": scaler.state_dict() if scaler is not None else None,
             "world_size": distributed.world_size()}
    distributed.barrier()
    path = directory / f"step_{step}"
    if rank == 0:
        (tmp / "train.json").write_text(json.dumps(extra, indent=1))
        config = {k: train_state.get(k) for k in ("made_with", "run")}
        path = checkpoint_io.commit(directory, tmp, step, config, keep)
    distributed.barrier()
    return path


REQUIRED = ("train.json", ".metadata")
"""The parts every checkpoint has (besides its shards and each rank's RNG state)."""


def find(directory: str | Path) -> Path:
    """The checkpoint to resume under `directory`: the one `latest` names if it
    verifies against its manifest, else the newest older one that does (a warning
    says why); `CheckpointError` when none does."""
    return checkpoint_io.find_good(Path(directory), REQUIRED)


def read(path: Path) -> dict:
    """The train state of the checkpoint at `path` (train.json)."""
    try:
        extra = json.loads((path / "train.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: train.json: {e}") from None
    if not isinstance(extra, dict) or not isinstance(extra.get("step"), int):
        raise CheckpointError(f"checkpoint {path} is corrupt: train.json holds no step")
    return extra


def check_made_with(path: Path, extra: dict, expect: dict) -> None:
    """Refuse a checkpoint made with other switches or another model config."""
    made = extra.get("made_with")
    if made != expect:
        diff = sorted(k for k in set(made or {}) | set(expect)
                      if (made or {}).get(k) != expect.get(k))
        raise CheckpointError(f"checkpoint {path} was made with other {', '.join(diff)}: "
                              "resume with the same switches and preset")


def load(path: str | Path, model, optimizer, *, expect: dict, scaler=None) -> dict:
    """Restore model, optimizer, fp8 histories, loss scale and this rank's RNG from the
    checkpoint at `path` (`find`); returns its train state (step, losses, data
    position). `expect` (`describe`) must match what the checkpoint was made with."""
    dcp, get_optim, set_optim = _dcp()
    path = Path(path)
    extra = read(path)
    check_made_with(path, extra, expect)
    state = {"model": _model_state(model), "optimizer": get_optim(model, optimizer),
             "fp8": _fp8_state(model)}
    from torch.distributed.checkpoint.api import CheckpointException  # lazy: DCP is heavy

    rng_file = path / _rng_name(distributed.rank())
    if not rng_file.exists() and distributed.world_size() == 1:
        rng_file = path / "rng.pt"  # saved before each rank kept its own
    try:
        _quiet(dcp.load, state, checkpoint_id=str(path))
        rng = torch.load(rng_file, weights_only=True)
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
