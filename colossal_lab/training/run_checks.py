"""Refuse a training run that cannot work or would lose work, before anything is built.

`train()` calls these first, so a mistake costs a second, not a run: numbers out of
range (`check_run`), a save-dir or export path that cannot be written or that already
holds another run (`check_paths`), and a resume that would not continue the run the
checkpoint was made by (`check_resume`: batch, sequence length, data, seed, vocabulary,
learning rate, micro-batch and the number of ranks all shape the loss trajectory).
Each raises `UsageError` (or `CheckpointError`) with what to change.
"""

from __future__ import annotations

import math
from pathlib import Path

from colossal_lab.config import ModelConfig
from colossal_lab.errors import UsageError
from colossal_lab.training import checkpoint_io
from colossal_lab.training.checkpoint_io import CheckpointError

MAX_STEPS = 10**9
"""More steps than any run takes: a larger number is a typo (``--steps 1e23``)."""
MAX_TOKENS_PER_STEP = 2**31
"""batch x seq_len beyond this overflows int32 indexing long before it fits a GPU."""


def _whole(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name}={value!r} must be a whole number >= {low}")


def check_run(cfg: ModelConfig, *, batch: int, micro: int, seq_len: int, steps: int,
              lr: float, data: str, vocab: int, save_every: int, keep: int = 2) -> None:
    """Refuse numbers that cannot work, before any data is read or memory allocated
    (`batch` and `micro` are one rank's)."""
    for name, value in (("steps", steps), ("batch", batch), ("micro_batch", micro),
                        ("seq_len", seq_len), ("keep", keep)):
        _whole(name, value)
    if steps > MAX_STEPS:
        raise UsageError(f"steps={steps} is more than {MAX_STEPS:,}: a typo?")
    if seq_len > cfg.max_position_embeddings:
        raise UsageError(f"seq_len={seq_len} > max_position_embeddings="
                         f"{cfg.max_position_embeddings}; use a shorter --seq-len or "
                         "a preset made for longer sequences")
    if batch * seq_len > MAX_TOKENS_PER_STEP:
        raise UsageError(f"batch={batch} x seq_len={seq_len} tokens per step is more "
                         f"than {MAX_TOKENS_PER_STEP:,}")
    if batch % micro:
        raise UsageError(f"micro_batch={micro} must divide batch={batch}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 \
            or not math.isfinite(lr):
        raise UsageError(f"lr={lr} must be a positive number")
    if vocab > cfg.vocab_size or vocab < 2:
        raise UsageError(f"tokenizer vocab {vocab} must be in [2, model vocab "
                         f"{cfg.vocab_size}]")
    if data not in ("corpus", "random"):
        raise UsageError(f"data={data!r}; choose 'corpus' or 'random'")
    _whole("save_every", save_every, 0)


def check_paths(save_dir: Path | None, export_hf: Path | None, *, resume: bool,
                overwrite: bool) -> None:
    """The save-dir and the export path can be written; a fresh run does not write
    into a save-dir that holds checkpoints (unless `overwrite`, which deletes them)."""
    if resume and save_dir is None:
        raise UsageError("resume needs save_dir: the folder the checkpoints are in")
    if resume and overwrite:
        raise UsageError("resume and overwrite contradict each other: choose one")
    if save_dir is not None:
        if str(save_dir).strip() in ("", "."):
            raise UsageError(f"save_dir={str(save_dir)!r}: name a folder for the checkpoints")
        if save_dir.exists() and not save_dir.is_dir():
            raise CheckpointError(f"save-dir {save_dir} is a file, not a folder")
        checkpoint_io.check_writable(save_dir, "save-dir")
        if not resume and checkpoint_io.holds_run(save_dir):
            if not overwrite:
                raise CheckpointError(
                    f"save-dir {save_dir} is not empty: continue its run with --resume, "
                    "or start afresh with --overwrite (which deletes what is there)")
    if export_hf is not None:
        if str(export_hf).strip() in ("", "."):
            raise UsageError(f"export_hf={str(export_hf)!r}: name a folder for the "
                             "transformers checkpoint")
        if export_hf.exists() and not export_hf.is_dir():
            raise UsageError(f"export path {export_hf} is an existing file; the export is "
                             "a folder: choose another path or remove the file")
        checkpoint_io.check_writable(export_hf, "export path")


def check_resume(path: Path, saved: dict, run: dict, steps: int) -> None:
    """The checkpoint at `path` (train state `saved`) continues this `run` to `steps`:
    everything that shapes the trajectory matches, and there are steps left to take."""
    made = saved.get("run") or {}
    differ = [k for k in sorted(set(made) | set(run)) if made.get(k) != run.get(k)]
    if differ:
        said = ", ".join(f"{k}={made.get(k)!r} (now {run.get(k)!r})" for k in differ)
        raise CheckpointError(f"the checkpoint {path} was made with {said}: resume with "
                              "the same batch, seq_len, data, seed, vocab, max_files, lr, "
                              "micro_batch and number of ranks")
    if steps <= saved["step"]:
        raise CheckpointError(f"--steps {steps} is not beyond the checkpoint's step "
                              f"{saved['step']} ({path}): ask for more steps to continue")
