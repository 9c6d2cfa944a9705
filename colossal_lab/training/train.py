"""The training loop: config → plain model → `apply_switches` → steps, reporting MFU honestly.

`train()` is the loop a reader runs (real text, a progress bar with loss, tokens/s, both
MFUs and peak memory); `measure_step()` times the same step for the benchmarks. Both run
`make_step`'s `Step` (`training.step`, whose names this module re-exports), so what is
measured is what is trained.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from colossal_lab import precision as precision_mod
from colossal_lab.config import ModelConfig, Switches
from colossal_lab.measure import hardware, mfu, timing
from colossal_lab.measure.progress import Progress
from colossal_lab.model import build_model
from colossal_lab.parallel import data_parallel, distributed
from colossal_lab.switches import checkpointing
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.apply import check as check_switches
from colossal_lab.switches.resolved import backends_in_use
from colossal_lab.training import checkpoint
from colossal_lab.training import data as data_mod
from colossal_lab.training.optimizer import make_optimizer, moments_of
from colossal_lab.training.step import (  # noqa: F401  (re-exported: `train.make_step`)
    LossFn,
    Step,
    hf_loss,
    make_step,
    our_loss,
)


class GcPauses:
    """Time Python's cyclic garbage collector spends, collection by collection.

    A full collection walks every live Python object (a process that imported torch
    and transformers holds millions) and blocks the thread that launches the kernels;
    if the GPU's queue runs dry meanwhile, that step is slower by the pause. Counting
    the pauses per step tells a slow step caused by the collector from one caused by
    the GPU."""

    def __init__(self):
        self.ms = 0.0
        self.full = 0  # collections of the oldest generation
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.full += info.get("generation") == 2

    def take(self) -> tuple[float, int]:
        """(ms, full collections) since the last call."""
        out, self.ms, self.full = (self.ms, self.full), 0.0, 0
        return out

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


@contextlib.contextmanager
def gc_between_steps(enabled: bool = True):
    """Keep Python's garbage collector out of the steps (`enabled=False`: leave it be).

    Collect once, move every survivor into the permanent generation (`gc.freeze`) and
    disable automatic collection while steps run; `collect_now()` runs a young
    collection between steps (`train` does every `gc_every` steps). Large training loops
    do the same (torchtitan's `gc_freq`, Megatron's manual GC): an automatic full
    collection in the middle of a step stalls the launching thread for tens to hundreds
    of milliseconds. Reference counting still frees almost everything at once."""
    if not enabled:
        yield
        return
    was = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


def collect_now() -> None:
    """A young-generation collection at a step boundary (under `gc_between_steps`)."""
    gc.collect(1)


@dataclass
class StepMeasurement:
    """One setup's throughput: a row of a results file."""

    setup: str
    preset: str
    batch: int
    seq_len: int
    micro_batch: int
    step_ms: float
    step_ms_p10: float
    step_ms_p90: float
    tokens_per_s: float
    mfu: float
    mfu_attn: float
    hfu: float
    peak_mem_gib: float | None
    n_params: int
    peak_tflops: float
    achieved_tflops: float
    steps_timed: int
    step_ms_all: list = field(default_factory=list)
    """Every timed step, in order (ms): the spread's raw material."""
    gc_ms_all: list = field(default_factory=list)
    """Milliseconds the garbage collector paused the host during each timed step."""
    gc_policy: str = "between_steps"
    """"between_steps" (`gc_between_steps`) or "python" (automatic collection on)."""
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def measure_step(step: Callable, batches: Iterator, *, cfg: ModelConfig, setup: str,
                 preset: str, batch: int, seq_len: int, micro_batch: int | None = None,
                 warmup: int = 3, iters: int = 20, peak_tflops: float | None = None,
                 recompute_flops: float = 0.0, progress: bool = True,
                 gc_policy: str = "between_steps",
                 extra: dict | None = None) -> StepMeasurement:
    """Time `iters` steps after `warmup` (each bracketed by CUDA events) and turn the
    median into tokens/s, MFU (6N), MFU (+attention) and HFU (which also counts the
    `recompute_flops` that activation checkpointing repeats). Every step's time and the
    garbage collector's pauses during it are kept; `gc_policy="between_steps"` keeps
    automatic collection out of the steps, as `train` does (`gc_between_steps`)."""
    if gc_policy not in ("between_steps", "python"):
        raise ValueError(f"gc_policy={gc_policy!r}; choose 'between_steps' or 'python'")
    dev = hardware.detect()
    peak = peak_tflops or dev.peak_tflops("bf16")
    if peak is None:  # CPU or unknown GPU: MFU against the measured matmul ceiling
        peak = hardware.measure_matmul_tflops(dtype=torch.float32)
    data = list(_take(batches, warmup + iters))
    timing.reset_peak_memory()
    bar = _progress(warmup + iters, setup, progress)
    pauses, gc_ms = GcPauses(), []

    def one(i):
        loss = step(*data[i])
        bar.update(1)
        return loss

    def timed(i, ms):
        gc_ms.append(round(pauses.take()[0], 3))
        times.append(round(ms, 3))

    times: list[float] = []
    with gc_between_steps(gc_policy == "between_steps"), pauses:
        timed_steps = timing.time_iterations(one, warmup=warmup, iters=iters,
                                       before_step=lambda i: pauses.take(), on_step=timed)
    bar.close()
    stats = mfu.step_stats(cfg, batch=batch, seq_len=seq_len,
                           step_time_s=timed_steps.median_ms / 1e3, peak_tflops=peak,
                           recompute_flops=recompute_flops)
    return StepMeasurement(
        setup=setup, preset=preset, batch=batch, seq_len=seq_len,
        micro_batch=micro_batch or batch, step_ms=timed_steps.median_ms,
        step_ms_p10=timed_steps.p10_ms, step_ms_p90=timed_steps.p90_ms,
        tokens_per_s=stats.tokens_per_s, mfu=stats.mfu, mfu_attn=stats.mfu_attn,
        hfu=stats.hfu, peak_mem_gib=timing.peak_memory_gib(), n_params=stats.n_params,
        peak_tflops=peak, achieved_tflops=stats.achieved_tflops, steps_timed=timed_steps.n,
        step_ms_all=times, gc_ms_all=gc_ms, gc_policy=gc_policy, extra=extra or {})


def _take(it: Iterator, n: int):
    for _ in range(n):
        yield next(it)


def _progress(total: int, desc: str, enabled: bool):
    return Progress(total=total, desc=desc, enabled=enabled, leave=False)


@dataclass
class TrainResult:
    losses: list[float]
    val_loss: float | None
    stats: mfu.StepStats | None
    peak_mem_gib: float | None
    seconds: float
    optimizer: str | None = None  # the optimizer's class, and the dtype of its moments
    optimizer_moments: str | None = None


def _check_run(cfg: ModelConfig, *, batch: int, micro: int, seq_len: int, steps: int,
               lr: float, data: str, vocab: int, save_every: int) -> None:
    """Refuse a run that cannot work, before any data is read or memory allocated."""
    for name, value in (("steps", steps), ("batch", batch), ("micro_batch", micro),
                        ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if batch % micro:
        raise ValueError(f"micro_batch={micro} must divide batch={batch}")
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} > max_position_embeddings="
                         f"{cfg.max_position_embeddings}; raise it in the config")
    if not lr > 0 or not math.isfinite(lr):
        raise ValueError(f"lr={lr} must be a positive number")
    if vocab > cfg.vocab_size or vocab < 2:
        raise ValueError(f"tokenizer vocab {vocab} must be in [2, model vocab "
                         f"{cfg.vocab_size}]")
    if data not in ("corpus", "random"):
        raise ValueError(f"data={data!r}; choose 'corpus' or 'random'")
    if save_every < 0:
        raise ValueError(f"save_every={save_every} must be >= 0")


def train(cfg: ModelConfig, switches: Switches | None = None, *, batch: int = 8,
          seq_len: int = 256, steps: int = 100, lr: float = 3e-4, micro_batch: int | None = None,
          data: str = "corpus", vocab_size: int | None = None, max_files: int | None = None,
          seed: int = 0, device=None, progress: bool = True, log_every: int = 10,
          eval_batches: int = 4, gc_every: int = 100, save_dir=None, save_every: int = 0,
          resume: bool = False, export_hf=None) -> TrainResult:
    """Train `cfg` on the real-text corpus (`data="corpus"`) or random tokens
    (`data="random"`), with a progress bar showing loss, tokens/s, MFU and memory.

    Checkpoints (`colossal_lab.training.checkpoint`): with `save_dir`, every `save_every` steps
    and at the end; `resume=True` continues from the newest one there exactly (same
    batches, same optimizer and loss-scale state: the loss trajectory of an
    uninterrupted run). `export_hf` writes a `transformers` checkpoint at the end.
    Python's garbage collector is held out of the steps (`gc_between_steps`) and runs a
    young collection every `gc_every` steps, between two of them.

    Under torchrun (`colossal_lab.parallel.distributed.init()` called first) this is one rank of
    a data-parallel run (switch 8, `switches.overlap_communication`): every rank draws
    the same global batch of `batch` sequences and trains on its 1/world share, so the
    run follows the single-process one; rank 0 prints and exports; MFU counts the
    global tokens against world x the peak."""
    switches = switches or Switches()
    env = distributed.env()
    world, rank = env.world_size, env.rank
    if batch % world:
        raise ValueError(f"batch={batch} must divide over {world} data-parallel ranks")
    local = batch // world  # this rank's sequences of each global batch
    micro = micro_batch or local
    vocab = vocab_size or cfg.vocab_size
    _check_run(cfg, batch=local, micro=micro, seq_len=seq_len, steps=steps, lr=lr,
               data=data, vocab=vocab, save_every=save_every)
    if resume and save_dir is None:
        raise ValueError("resume needs save_dir: the folder the checkpoints are in")
    if world > 1 and (save_dir is not None or export_hf is not None):
        raise ValueError("checkpoints and exports of a run on several ranks are not built "
                         "yet: train on one process to save or export")
    torch.manual_seed(seed)
    device = torch.device(device) if device else (
        env.device if world > 1 else hardware.default_device())
    progress = progress and env.is_main
    check_switches(switches, device)  # before loading data or allocating a model
    made_with = checkpoint.describe(switches, cfg)
    if resume:
        checkpoint.find(save_dir)  # fail before building anything

    torch.manual_seed(seed)  # every rank builds the same weights
    model = apply_switches(build_model(cfg, device), switches)  # DDP: the wrapper
    inner = data_parallel.unwrap(model)
    opt = make_optimizer(inner, lr)
    step = make_step(model, opt, micro_batches=local // micro)
    losses, start = [], 0
    if resume:
        state = checkpoint.load(save_dir, inner, opt, expect=made_with, scaler=step.scaler)
        losses, start = list(state["losses"]), state["step"]
        if state.get("run") != {"batch": batch, "seq_len": seq_len, "data": data,
                                "seed": seed, "vocab": vocab, "max_files": max_files}:
            raise checkpoint.CheckpointError(
                f"the checkpoint in {save_dir} was made with {state.get('run')}: resume "
                "with the same batch, seq_len, data, seed, vocab and max_files")
    run = {"batch": batch, "seq_len": seq_len, "data": data, "seed": seed, "vocab": vocab,
           "max_files": max_files}
    if data == "corpus":
        train_seqs = data_mod.packed_sequences("train", seq_len, vocab, max_files=max_files)
        val_seqs = data_mod.packed_sequences("val", seq_len, vocab, max_files=max_files)
        batches = data_mod.batches(train_seqs, batch, seed=seed, device=device, start=start)
    else:
        val_seqs = None
        batches = data_mod.random_batches(vocab, batch, seq_len, seed=seed, device=device,
                                          start=start)

    def save(done: int) -> None:
        step.flush()  # a deferred update belongs to the steps saved
        checkpoint.save(save_dir, done, inner, opt, scaler=step.scaler, train_state={
            "losses": [x if isinstance(x, float) else x.item() for x in losses],
            "made_with": made_with, "run": run})

    dev = hardware.detect()
    peak = dev.peak_tflops("bf16") or hardware.measure_matmul_tflops(dtype=torch.float32)
    peak *= world  # the global tokens against every rank's peak
    # HFU counts what checkpointing runs twice; MFU does not (same as measure_step)
    recompute = checkpointing.recompute_flops(
        cfg, batch, seq_len, switches.gradient_checkpoint_config,
        attention_backend=backends_in_use(inner)["attention_backend"])
    timing.reset_peak_memory()
    stats = None
    t_start = time.perf_counter()
    bar = Progress(range(start, steps), desc=f"train {cfg.num_hidden_layers}L",
                   enabled=progress, mininterval=5.0)
    window_t, window_steps = time.perf_counter(), 0
    with gc_between_steps():  # no automatic collection inside a step
        for i in bar:
            ids, labels = next(batches)  # the global batch: this rank keeps its share
            if world > 1:
                ids, labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
            loss = step(ids, labels)
            window_steps += 1
            if (i + 1) % log_every == 0 or i + 1 == steps:
                losses_now = loss.item()  # syncs: the window's time is complete
                dt = (time.perf_counter() - window_t) / window_steps
                stats = mfu.step_stats(cfg, batch=batch, seq_len=seq_len, step_time_s=dt,
                                       peak_tflops=peak, recompute_flops=recompute)
                mem = timing.peak_memory_gib()
                bar.set_postfix(loss=f"{losses_now:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}",
                                mfu=f"{stats.mfu:.1%}", mfu_attn=f"{stats.mfu_attn:.1%}",
                                mem=f"{mem:.1f}G" if mem else "-", refresh=False)
                window_t, window_steps = time.perf_counter(), 0
            losses.append(loss)
            if save_dir is not None and save_every and (i + 1) % save_every == 0 \
                    and i + 1 < steps:
                save(i + 1)
            if gc_every and (i + 1) % gc_every == 0:
                collect_now()
    losses = [x if isinstance(x, float) else x.item() for x in losses]
    if world > 1:  # the global batch's loss: the mean of the ranks' shares
        losses = distributed.all_mean(losses)
    step.flush()
    if save_dir is not None and start < steps:
        save(steps)
    val = evaluate(inner, val_seqs, batch, eval_batches) \
        if val_seqs is not None and env.is_main else None
    if export_hf is not None:
        inner.to_hf().save_pretrained(export_hf)
    return TrainResult(losses, val, stats, timing.peak_memory_gib(),
                       time.perf_counter() - t_start, type(opt).__name__,
                       moments_of(opt))


@torch.no_grad()
def evaluate(model, seqs: torch.Tensor, batch: int, max_batches: int) -> float:
    """Mean validation loss over the first `max_batches` batches of `seqs`, in the
    model's precision."""
    device = next(model.parameters()).device
    precision = precision_mod.of(model)
    model.eval()
    total, n = 0.0, 0
    for i in range(0, min(len(seqs), batch * max_batches), batch):
        chunk = seqs[i:i + batch].to(device)
        with precision_mod.step_context(precision, device):
            total += model(chunk[:, :-1], chunk[:, 1:]).item()
        n += 1
    model.train()
    return total / max(n, 1) if n else math.nan
