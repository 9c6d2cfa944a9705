"""One training step: forward, backward, clipping and the optimizer, as a callable `Step`.

`make_step(model, optimizer)` builds it; `train()` runs it in a loop and `measure_step()`
times it for the benchmarks, so what is measured is what is trained. The step asks the
precision module for its autocast, TF32 mode and loss scaler: the precision is the one
the model was given (`apply_switches`; a plain model is fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from colossal_lab import precision as precision_mod
from colossal_lab.parallel import data_parallel, grad_norm
from colossal_lab.switches import compile as compile_switch
from colossal_lab.switches import deferred_adamw
from colossal_lab.switches.step_graph import GraphedStep

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def our_loss(model, input_ids, labels):
    """Our model takes already-shifted labels and returns the mean cross-entropy."""
    return model(input_ids, labels)


def hf_loss(model, input_ids, labels):
    """Hugging Face models shift `labels` themselves: pass the inputs as labels."""
    return model(input_ids=input_ids, labels=input_ids).loss


class Step:
    """`step(input_ids, labels) -> loss`: forward and backward over `micro_batches`
    slices of the batch (gradient accumulation), clipping, then the optimizer step.

    fp16 scales the loss dynamically (`scaler`, a `DynamicLossScaler`): gradients are
    unscaled before clipping and an overflowing step is skipped, all on device. With
    data parallelism (switch 8) every micro-batch but the last accumulates locally
    (`no_sync`), and the reduction is finished after the last backward, before clipping
    and the optimizer. With `extra["adamw_defer"]` and our AdamW the update is applied
    during the next step's forward (`deferred`, `switches.deferred_adamw`); `flush()`
    applies it now: call it before reading the weights or the optimizer's state."""

    def __init__(self, model, optimizer, loss_fn: LossFn = our_loss, micro_batches: int = 1,
                 clip: float | None = 1.0):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.micro_batches, self.clip = micro_batches, clip
        self.inner = data_parallel.unwrap(model)  # DDP / torch.compile wrappers: call `model`
        self.device = next(self.inner.parameters()).device
        self.precision = precision_mod.of(self.inner)
        """The model's precision ("fp32", "bf16", ...: `precision.PRECISIONS`)."""
        self.scaler = precision_mod.loss_scaler(self.precision)
        """fp16's `DynamicLossScaler`; None in every other precision."""
        self.sync = data_parallel.of(model)
        self.switches = getattr(self.inner, "switches", None)
        ours = hasattr(optimizer, "take_coefficient")  # FusedAdamW: its update in parts
        self.deferred = deferred_adamw.DeferredUpdate(self.inner, optimizer, self.device) \
            if ours and deferred_adamw.requested(self.switches) else None
        """The update held back for the next forward (`adamw_defer`), or None."""

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with precision_mod.matmul_mode(self.precision):  # "tf32": the backward's matmuls too
            return self._step(input_ids, labels)

    def _step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        scaler, optimizer = self.scaler, self.optimizer
        total = torch.zeros((), device=self.device)
        chunks = list(zip(input_ids.chunk(self.micro_batches),
                          labels.chunk(self.micro_batches)))
        for i, (ids, lab) in enumerate(chunks):
            last = i == len(chunks) - 1
            with contextlib.nullcontext() if last else self.sync.no_sync():
                with precision_mod.autocast(self.precision, self.device):
                    loss = self.loss_fn(self.model, ids, lab) / len(chunks)
                (loss if scaler is None else scaler.scale(loss)).backward()
            total += loss.detach()
        self.sync.finish()  # every rank's gradients: the mean over the data-parallel ranks
        if scaler is not None:
            scaler.unscale_(optimizer)
        if self.clip is not None:  # by the whole model's norm, also when split over ranks;
            grad_norm.clip_(self.inner, optimizer, self.clip)  # FusedAdamW: inside its step
        if self.deferred is not None:  # applied during the next forward, or by `flush`
            self.deferred.defer()
            return total
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return total

    def flush(self) -> None:
        """Apply a deferred update now (a no-op without one)."""
        if self.deferred is not None:
            self.deferred.flush()

    def close(self) -> None:
        """Apply a deferred update and take its hooks off the model, for a step that is
        done with (another `make_step` on the same model adds hooks of its own)."""
        if self.deferred is not None:
            self.deferred.remove()
            self.deferred = None


def make_step(model, optimizer, loss_fn: LossFn = our_loss, micro_batches: int = 1,
              clip: float | None = 1.0) -> Step | GraphedStep:
    """The training step of `model` and `optimizer` (`Step`); with
    `enable_compile="graph"` a `GraphedStep`: run eagerly once, then replayed as one
    CUDA graph (`switches.step_graph`)."""
    step = Step(model, optimizer, loss_fn, micro_batches, clip)
    if compile_switch.resolve(getattr(step.switches, "enable_compile", False)) == "graph":
        return GraphedStep(step, optimizer, step.device)
    return step
