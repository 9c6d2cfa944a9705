"""Loss curves on the real-text corpus: does a switch change what the model learns?

`run_curves` trains the same model from the same seed on the same batches once per
setup (`train.train`, data="corpus") and records every step's loss, the final loss (the
mean of the last `FINAL_WINDOW` steps) and the validation loss, with each setup's
relative difference from a reference setup. Chapter 06 compares precisions with it,
chapter 10 the naive model against every switch. A second run of the reference with
another seed (another initialisation and batch order) says how far two equally good
runs land apart: a difference inside that is noise.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from colossal_lab.config import ModelConfig, Switches
from colossal_lab.measure import mfu
from colossal_lab.training import train

FINAL_WINDOW = 20
"""Steps averaged into a curve's final loss."""


@dataclass(frozen=True)
class Curve:
    """One training run of a curve comparison."""

    name: str
    switches: Switches
    seed: int = 0
    fields: dict = field(default_factory=dict)
    """Extra columns for its row (e.g. the precision and fp8 scaling)."""


def run_curves(curves: Sequence[Curve], cfg: ModelConfig, run: dict, *, reference: str,
               progress: bool = False) -> list[dict]:
    """Train `cfg` once per curve with `run`'s arguments (batch, seq_len, steps, lr,
    max_files, log_every, eval_batches) and return one row each (kind "loss_curve");
    `rel_diff_vs_<reference>` compares final losses with the curve named `reference`."""

    rows = []
    for c in curves:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            r = train.train(cfg, c.switches, vocab_size=cfg.vocab_size, seed=c.seed,
                            progress=progress, **run)
        window = r.losses[-min(FINAL_WINDOW, len(r.losses)):]
        rows.append({"kind": "loss_curve", "setup": c.name, "seed": c.seed, **c.fields,
                     "precision": c.switches.precision, "optimizer": r.optimizer,
                     "optimizer_moments": r.optimizer_moments,
                     "n_params": mfu.count_params(cfg),
                     "batch": run["batch"], "seq_len": run["seq_len"],
                     "steps": run["steps"], "lr": run["lr"], "losses": r.losses,
                     "final_loss": sum(window) / len(window), "val_loss": r.val_loss,
                     "seconds": time.perf_counter() - t0,
                     "tokens_per_s": r.stats.tokens_per_s if r.stats else None})
        print(f"  curve {c.name:<14} final {rows[-1]['final_loss']:.4f}  val "
              f"{r.val_loss:.4f}  {rows[-1]['seconds']:.0f} s", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ref = next(r for r in rows if r["setup"] == reference)
    for r in rows:
        r[f"rel_diff_vs_{reference}"] = (r["final_loss"] - ref["final_loss"]) \
            / ref["final_loss"]
    return rows
