"""Memory of a training step, measured and modelled.

What the forward keeps, what one more sequence costs, the largest batch that fits and
the fewest checkpointed layers that fit a batch.

`MemoryModel` is the model: peak memory as straight lines in the batch.
`benchmarks.steps.measure_one` uses the probes on a GPU (chapter 04): one extra forward +
backward (`memory_probe`) records the activation memory (peak during forward+backward
minus what was allocated just before the forward: parameters and optimizer states) and
what each decoder layer leaves allocated; a second probe at another batch gives the
memory per sequence, from which `verify_largest_batch` predicts the largest batch and
verifies it in one run, and `auto_ratio` picks the fewest checkpointed layers that fit
(`MemoryModel`). On a CPU the probes return nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass

import torch

from colossal_lab import precision
from colossal_lab.switches import checkpointing
from colossal_lab.switches import compile as compile_switch
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training import data
from colossal_lab.training.step import make_step

GIB = 2**30


# ------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of a training step as a straight line in the batch:

        peak(batch, k) = fixed + batch · (none − k / L · (none − full))

    `fixed` is what does not grow with the batch (weights, gradients, optimizer
    states, workspaces); `none` / `full` the memory one more sequence costs with no / all
    L layers checkpointed. Fitted from a few measured passes (`auto_ratio`,
    `benchmarks.checkpointing`), it answers the two questions of chapter 04: how large a
    batch fits, and the smallest number of checkpointed layers that fits a batch.

    **Two peaks.** The step's peak comes at one of two moments. When the backward starts,
    every activation the forward kept is alive and no gradient exists yet; when it
    ends, every gradient exists and the activations are gone. With few layers
    checkpointed the first is higher, with many the second. Given `base` (what is
    allocated before the forward: weights, fp32 masters and optimizer states, no
    gradients), the model takes the larger of two lines:

        peak(batch, k) = max(base + batch · per_sample(k),  fixed + batch · full)

    with `none` measured from `base`, and `fixed` and `full` from probes with every layer
    checkpointed, whose peak is the second. A single line through the two kinds of probe
    mixes the two moments and undercounts: for full LLaMA-7B with the exact optimizer
    (75 GiB before the forward, 12.5 GiB of bf16 gradients, 18.7 GiB of activations a
    sequence without checkpointing) it gives 101 GiB at batch 2, where the step reaches
    112 and the two lines say 113.

    **Gradient accumulation.** From the second micro-batch on, every gradient is alive
    before the forward starts, so the first line starts from base plus the gradients
    (`auto_ratio(..., accumulating=True)`): 12.5 GiB more for LLaMA-7B in bf16."""

    fixed_gib: float
    per_sample_none_gib: float
    per_sample_full_gib: float
    num_layers: int
    capacity_gib: float
    """What the allocator can hand out (device memory less the CUDA context), less a
    safety margin for fragmentation."""
    base_gib: float | None = None
    """Allocated before the forward (no gradients yet), where the first peak's line
    starts. None: one line from `fixed_gib`."""

    def per_sample(self, ckpt_layers: int) -> float:
        saved = self.per_sample_none_gib - self.per_sample_full_gib
        return self.per_sample_none_gib - ckpt_layers / self.num_layers * saved

    def peak(self, batch: int, ckpt_layers: int) -> float:
        if self.base_gib is None:
            return self.fixed_gib + batch * self.per_sample(ckpt_layers)
        return max(self.base_gib + batch * self.per_sample(ckpt_layers),
                   self.fixed_gib + batch * self.per_sample_full_gib)

    def largest_batch(self, ckpt_layers: int) -> int:
        """The largest batch whose peak fits (0 when not even one sequence does)."""
        return largest_batch(self.fixed_gib, self.per_sample(ckpt_layers), self.capacity_gib)

    def min_ckpt_layers(self, batch: int) -> int | None:
        """The fewest checkpointed layers that fit `batch` (None: not even all do)."""
        for k in range(self.num_layers + 1):
            if self.peak(batch, k) <= self.capacity_gib:
                return k
        return None


def largest_batch(fixed_gib: float, per_sample_gib: float, capacity_gib: float) -> int:
    """floor((capacity − fixed) / per sample), at least 0."""
    if per_sample_gib <= 0:
        raise ValueError(f"per-sample memory {per_sample_gib} GiB must be positive")
    fits = (capacity_gib - fixed_gib) / per_sample_gib
    return max(0, math.floor(fits + 1e-9))  # 1e-9: tolerate binary rounding


# ----------------------------------------------------------------------- the probes


def memory_probe(model, loss_fn, input_ids: torch.Tensor, labels: torch.Tensor,
                 layers=None) -> dict:
    """One forward + backward (no optimizer step) in the model's precision, measured by
    the CUDA allocator.

    Returns (GiB) `before` (allocated just before the forward: parameters, optimizer
    states), `peak`, `activation` (= peak − before: everything the forward keeps and
    the backward allocates, gradients included), `saved` (allocated after the forward −
    before: what the forward keeps for the backward, and the loss) and `per_layer`: what
    each decoder layer in `layers` left allocated when its forward returned (from the
    second layer on). Empty on a CPU, which has no allocator statistics."""
    if input_ids.device.type != "cuda":
        return {}
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    marks: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_: marks.append(torch.cuda.memory_allocated()))
             for layer in (layers or ())]
    try:
        with precision.step_context(precision.of(model), input_ids.device):
            loss = loss_fn(model, input_ids, labels)
    finally:
        for h in hooks:
            h.remove()
    after_fwd = torch.cuda.memory_allocated()
    loss.backward()
    del loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    return {"before": before / GIB, "peak": peak / GIB, "activation": (peak - before) / GIB,
            "saved": (after_fwd - before) / GIB,
            "per_layer": [(b - a) / GIB for a, b in zip(marks, marks[1:])]}


def guarded(fn, *args, model=None) -> tuple[object, str | None]:
    """(`fn(*args)`, None), or (None, why) when it fails — out of memory, or anything
    else a very large batch can trigger — with the memory freed again, so that a probe
    never costs the measurement already made."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001
        why = ("out of memory" if isinstance(e, torch.cuda.OutOfMemoryError)
               else f"{type(e).__name__}: {str(e)[:200]}")
    if model is not None:  # outside the except block: the traceback's frames are gone
        model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None, why


def capacity_gib(margin: float = 0.03) -> float:
    """What the allocator can still hand out in total (free device memory plus what it
    already holds), less `margin` for fragmentation."""
    free, _ = torch.cuda.mem_get_info()
    return (free + torch.cuda.memory_reserved()) / GIB * (1 - margin)


class Prober:
    """Memory probes of one model at any batch, remembered by batch (`setup`: the
    `benchmarks.steps.Setup` being measured)."""

    def __init__(self, model, loss_fn, setup, cfg, seq_len: int, device):
        self.model, self.loss_fn, self.setup = model, loss_fn, setup
        self.cfg, self.seq_len, self.device = cfg, seq_len, device
        inner = getattr(model, "model", None)
        # a compiled layer would trace the probe's hooks into its graph: no per-layer marks
        compiled = setup.compile or compile_switch.resolve(
            setup.switches.enable_compile) in ("layers", "model")
        self.layers = None if compiled else getattr(inner, "layers", None)
        self.results: dict[int, dict] = {}
        self.available = device.type == "cuda"
        """Allocator statistics exist (a GPU)."""

    def __call__(self, batch: int) -> dict:
        ids, labels = next(data.random_batches(self.cfg.vocab_size, batch, self.seq_len,
                                               seed=1, device=self.device))
        r = memory_probe(self.model, self.loss_fn, ids, labels, self.layers)
        self.results[batch] = r
        return r

    def fields(self, batch: int) -> dict:
        """Row fields from a probe at `batch` (and the per-sample slope when another batch
        was probed)."""
        if not self.available:
            return {"activation_mem_gib": None, "saved_mem_gib": None, "layer_mem_gib": None}
        r = self.results.get(batch)
        if r is None:
            r, why = guarded(self, batch, model=self.model)
        if r is None:
            return {"activation_mem_gib": None, "probe_error": why}
        out = {"activation_mem_gib": r["activation"], "saved_mem_gib": r["saved"],
               "mem_before_gib": r["before"], "layer_mem_gib": _mean(r["per_layer"]),
               "probe_batch": batch}
        flags = self._flags()
        if flags and r["per_layer"]:  # layer i's figure is per_layer[i - 1]
            ck = [m for f, m in zip(flags[1:], r["per_layer"]) if f]
            st = [m for f, m in zip(flags[1:], r["per_layer"]) if not f]
            out["layer_mem_ckpt_gib"], out["layer_mem_stored_gib"] = _mean(ck), _mean(st)
        return out

    def _flags(self):
        return checkpointing.checkpointed(self.model) or None


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _slope(a: dict, b: dict, ba: int, bb: int, key: str = "peak") -> float:
    return (b[key] - a[key]) / (bb - ba)


def auto_ratio(probe: Prober, model, opt, batch: int, accumulating: bool = False) -> dict:
    """Set the fewest checkpointed layers (first of each stage, full recomputation)
    that fit a (micro-)batch of `batch` sequences, from probes at batch 1 and 2 with
    every layer checkpointed and at batch 1 with none (`MemoryModel` with two peaks:
    the last probe gives `base` and one sequence's activations; `accumulating`: a
    micro-batch after the first, which starts with every gradient alive). The
    checkpoint configs are applied through `apply_switches`, so `model.switches` says
    what was timed."""
    if not probe.available:
        return {}
    inner = model.model
    base = model.switches.gradient_checkpoint_config or checkpointing.GradientCheckpointConfig()

    def set_ratio(r: float) -> None:
        ckpt = dataclasses.replace(base, gradient_checkpointing_ratio=r,
                                   num_ckpt_layers_per_stage=None)
        apply_switches(model, model.switches.replace(gradient_checkpoint_config=ckpt))

    set_ratio(1.0)
    warm = make_step(model, opt, probe.loss_fn)
    warm(*next(data.random_batches(probe.cfg.vocab_size, 1, probe.seq_len, seed=3,
                                   device=probe.device)))
    warm.close()  # a deferred update applied: the optimizer's states exist now
    one, two = probe(1), probe(2)
    full = _slope(one, two, 1, 2)
    fixed = one["peak"] - full
    set_ratio(0.0)
    none, _ = guarded(probe, 1, model=model)
    n_layers = len(inner.layers)
    base_gib = none["before"] if none else None
    grads_gib = sum(p.numel() * p.element_size() for p in model.parameters()
                    if p.requires_grad) / GIB  # .grad has the parameter's dtype
    if accumulating and base_gib is not None:
        base_gib += grads_gib
    # none checkpointed peaks as the backward starts: a line from what the forward
    # starts with, one sequence's activations a sequence (`MemoryModel`, two peaks)
    mm = MemoryModel(fixed, none["activation"] if none else float("inf"), full,
                     n_layers, capacity_gib(), base_gib=base_gib)
    k = mm.min_ckpt_layers(batch) if none else n_layers
    k = n_layers if k is None else k
    set_ratio(k / n_layers)
    probe.results.clear()  # those were other configurations
    return {"auto_ratio_ckpt_layers": k, "mem_fixed_gib": fixed, "mem_base_gib": mm.base_gib,
            "mem_per_sample_none_gib": mm.per_sample_none_gib if none else None,
            "mem_per_sample_full_gib": full, "mem_capacity_gib": mm.capacity_gib,
            "predicted_peak_gib": mm.peak(batch, k),
            **({"mem_grads_held_gib": grads_gib} if accumulating else {})}


def verify_largest_batch(probe: Prober, row: dict, time_at) -> dict:
    """Predict the largest batch from the memory one more sequence costs (two probes),
    then verify it with `time_at(batch) -> row`, a few timed steps at that batch (one
    step down if it does not fit). A prediction from one batch would mix the fixed
    memory into the slope."""
    model = probe.model
    batch = row["batch"]
    other = batch // 2 if batch >= 2 else 2
    a = probe.results.get(batch) or probe(batch)
    b, why = probe.results.get(other), None
    if b is None:
        b, why = guarded(probe, other, model=model)
    out = {"largest_batch_predicted": None, "largest_batch": None}
    if b is None and other > batch:  # batch 1 fits and 2 does not: nothing to predict
        out.update(largest_batch_predicted=batch, largest_batch=batch,
                   largest_batch_note=f"batch {other} failed in a probe: {why}")
        copy_largest(out, row)
        return out
    if b is None:
        out["largest_batch_note"] = f"probe at batch {other} failed: {why}"
        return out
    per_sample = _slope(b, a, other, batch) if other < batch else _slope(a, b, batch, other)
    if per_sample <= 0:
        out["largest_batch_note"] = f"non-positive memory per sample {per_sample:.3f} GiB"
        return out
    fixed = max(a["peak"], row.get("peak_mem_gib") or 0.0) - batch * per_sample
    cap = capacity_gib()
    predicted = max(batch, largest_batch(fixed, per_sample, cap))
    out.update(largest_batch_predicted=predicted, mem_fixed_gib=fixed,
               mem_per_sample_gib=per_sample, mem_capacity_gib=cap,
               layer_mem_per_sample_gib=_per_sample_layer(a, b, batch, other))
    if predicted == batch:
        out["largest_batch"] = batch
        copy_largest(out, row)
        return out
    for bs in (predicted, predicted - 1):
        if bs <= batch:
            break
        torch.cuda.empty_cache()
        r, why = guarded(time_at, bs, model=model)
        if r is not None:
            out["largest_batch"] = bs
            copy_largest(out, r)
            break
        out["largest_batch_note"] = f"batch {bs}: {why}"
        if why != "out of memory":
            break
    return out


def _per_sample_layer(a: dict, b: dict, ba: int, bb: int):
    la, lb = _mean(a["per_layer"]), _mean(b["per_layer"])
    return None if la is None or lb is None else (la - lb) / (ba - bb)


def copy_largest(out: dict, r: dict) -> None:
    for k in ("tokens_per_s", "mfu", "mfu_attn", "hfu", "peak_mem_gib", "step_ms"):
        out[f"largest_batch_{k}"] = r.get(k)
