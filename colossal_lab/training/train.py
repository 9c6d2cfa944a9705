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
from pathlib import Path

import torch

from colossal_lab import precision as precision_mod
from colossal_lab.config import ModelConfig, Switches
from colossal_lab.errors import UsageError
from colossal_lab.measure import hardware, mfu, timing
from colossal_lab.measure.progress import Progress
from colossal_lab.model import build_model
from colossal_lab.parallel import data_parallel, distributed
from colossal_lab.switches import checkpointing
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.apply import check as check_switches
from colossal_lab.switches.resolved import backends_in_use
from colossal_lab.training import checkpoint, checkpoint_io, run_checks
from colossal_lab.training import data as data_mod
from colossal_lab.training.optimizer import make_optimizer, moments_of
from colossal_lab.training.save_lock import SaveDirLock
from colossal_lab.training.signals import StopRequest
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
    checkpoint: Path | None = None
    """The newest checkpoint this run wrote (None: it wrote none)."""
    stopped_by: str | None = None
    """"SIGTERM" or "SIGINT" when a signal stopped the run early (after a save)."""


class NonFiniteLoss(UsageError):
    """The loss became NaN or infinite: the run stops before saving anything of it."""


def check(cfg: ModelConfig, switches: Switches | None = None, *, world: int = 1,
          batch: int = 8, seq_len: int = 256, steps: int = 100, lr: float = 3e-4,
          micro_batch: int | None = None, data: str = "corpus",
          vocab_size: int | None = None, max_files: int | None = None, seed: int = 0,
          save_every: int = 0, save_dir=None, resume: bool = False, export_hf=None,
          overwrite: bool = False, keep: int = 2) -> None:
    """What `train` refuses before building anything, for a run on `world` ranks: a
    parent process checks it before it launches them (`train --nproc`), so bad input
    ends in one line there instead of one traceback per rank."""
    if batch % world:
        raise UsageError(f"batch={batch} must divide over {world} data-parallel ranks")
    local = batch // world
    run_checks.check_run(cfg, batch=local, micro=micro_batch or local, seq_len=seq_len,
                         steps=steps, lr=lr, data=data, vocab=vocab_size or cfg.vocab_size,
                         save_every=save_every, keep=keep)
    save_dir = Path(save_dir) if save_dir is not None else None
    export_hf = Path(export_hf) if export_hf is not None else None
    if world > 1 and export_hf is not None:
        raise UsageError("the Hugging Face export of a run on several ranks is not built "
                         "yet: train on one process to export")
    run_checks.check_paths(save_dir, export_hf, resume=resume, overwrite=overwrite)
    if resume:
        _resume_point(save_dir, checkpoint.describe(switches or Switches(), cfg),
                      _run_of(batch, seq_len, data, seed, vocab_size or cfg.vocab_size,
                              max_files, lr, micro_batch or local, world), steps)


def _run_of(batch, seq_len, data, seed, vocab, max_files, lr, micro, world) -> dict:
    """What a resume must match besides switches and model: the trajectory's shape."""
    return {"batch": batch, "seq_len": seq_len, "data": data, "seed": seed, "vocab": vocab,
            "max_files": max_files, "lr": lr, "micro_batch": micro, "world_size": world}


def _resume_point(save_dir: Path, made_with: dict, run: dict, steps: int) -> Path:
    """The checkpoint to continue from, checked against this run."""
    path = checkpoint.find(save_dir)
    saved = checkpoint.read(path)
    checkpoint.check_made_with(path, saved, made_with)
    run_checks.check_resume(path, saved, run, steps)
    return path


def train(cfg: ModelConfig, switches: Switches | None = None, *, batch: int = 8,
          seq_len: int = 256, steps: int = 100, lr: float = 3e-4, micro_batch: int | None = None,
          data: str = "corpus", vocab_size: int | None = None, max_files: int | None = None,
          seed: int = 0, device=None, progress: bool = True, log_every: int = 10,
          eval_batches: int = 4, gc_every: int = 100, save_dir=None, save_every: int = 0,
          resume: bool = False, export_hf=None, overwrite: bool = False,
          keep: int = 2) -> TrainResult:
    """Train `cfg` on the real-text corpus (`data="corpus"`) or random tokens
    (`data="random"`), with a progress bar showing loss, tokens/s, MFU and memory.

    Checkpoints (`colossal_lab.training.checkpoint`): with `save_dir`, every `save_every` steps
    and at the end, the newest `keep` kept; `resume=True` continues from the newest good
    one there exactly (same batches, same optimizer and loss-scale state: the loss
    trajectory of an uninterrupted run). A fresh run refuses a save-dir that holds
    checkpoints unless `overwrite=True` (which deletes them); the save-dir is locked
    for the run (`save_lock`). SIGTERM or SIGINT stops the run at the next step
    boundary, after a save (`signals`). A NaN or infinite loss stops it with
    `NonFiniteLoss` before anything of it is saved. `export_hf` writes a `transformers`
    checkpoint at the end. Paths are checked for writing before anything is built.
    Python's garbage collector is held out of the steps (`gc_between_steps`) and runs a
    young collection every `gc_every` steps, between two of them.

    Under torchrun (`colossal_lab.parallel.distributed.init()` called first) this is one rank of
    a data-parallel run (switch 8, `switches.overlap_communication`): every rank draws
    the same global batch of `batch` sequences and trains on its 1/world share, so the
    run follows the single-process one; every rank saves its part of each checkpoint
    and evaluates (FSDP2's forward needs them all); rank 0 prints; the loss shown is
    the global batch's. MFU counts the global tokens against world x the peak."""
    args = dict(locals())
    world = distributed.world_size()
    if batch % world:
        raise UsageError(f"batch={batch} must divide over {world} data-parallel ranks")
    local = batch // world  # this rank's sequences of each global batch
    run_checks.check_run(cfg, batch=local, micro=micro_batch or local, seq_len=seq_len,
                         steps=steps, lr=lr, data=data, vocab=vocab_size or cfg.vocab_size,
                         save_every=save_every, keep=keep)
    save_dir = args["save_dir"] = Path(save_dir) if save_dir is not None else None
    export_hf = args["export_hf"] = Path(export_hf) if export_hf is not None else None
    if world > 1 and export_hf is not None:
        raise UsageError("the Hugging Face export of a run on several ranks is not built "
                         "yet: train on one process to export")
    error = None
    lock = SaveDirLock(save_dir) if save_dir is not None and distributed.is_main() else None
    try:
        if distributed.is_main():
            try:
                run_checks.check_paths(save_dir, export_hf, resume=resume,
                                       overwrite=overwrite)
                if lock is not None:
                    lock.acquire()
                if overwrite and save_dir is not None:
                    checkpoint_io.clear(save_dir)
            except UsageError as e:
                error = e
        if distributed.all_max([1.0 if error else 0.0])[0]:  # every rank stops, or none
            raise error or UsageError("rank 0 refused the run's paths")
        return _train(**args)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: ModelConfig, switches: Switches | None, *, batch, seq_len, steps, lr,
           micro_batch, data, vocab_size, max_files, seed, device, progress, log_every,
           eval_batches, gc_every, save_dir, save_every, resume, export_hf, overwrite,
           keep) -> TrainResult:
    """`train` once its arguments and paths are checked (and the save-dir locked)."""
    switches = switches or Switches()
    env = distributed.env()
    world, rank = env.world_size, env.rank
    local = batch // world
    micro = micro_batch or local
    vocab = vocab_size or cfg.vocab_size
    torch.manual_seed(seed)
    device = torch.device(device) if device else (
        env.device if world > 1 else hardware.default_device())
    progress = progress and env.is_main
    check_switches(switches, device)  # before loading data or allocating a model
    made_with = checkpoint.describe(switches, cfg)
    run = _run_of(batch, seq_len, data, seed, vocab, max_files, lr, micro, world)
    if resume:  # everything checked before building anything
        resume_from = _resume_point(save_dir, made_with, run, steps)
        if env.is_main:  # what a fallback skipped is set aside, not resumed or kept
            checkpoint_io.set_aside_newer(save_dir, resume_from)

    torch.manual_seed(seed)  # every rank builds the same weights
    model = apply_switches(build_model(cfg, device), switches)  # DDP: the wrapper
    inner = data_parallel.unwrap(model)
    opt = make_optimizer(inner, lr)
    step = make_step(model, opt, micro_batches=local // micro)
    losses: list[float] = []  # the global batch's loss of every step so far
    start = 0
    if resume:
        state = checkpoint.load(resume_from, inner, opt, expect=made_with,
                                scaler=step.scaler)
        losses, start = list(state["losses"]), state["step"]
    if data == "corpus":
        train_seqs = data_mod.packed_sequences("train", seq_len, vocab, max_files=max_files)
        val_seqs = data_mod.packed_sequences("val", seq_len, vocab, max_files=max_files)
        batches = data_mod.batches(train_seqs, batch, seed=seed, device=device, start=start)
    else:
        val_seqs = None
        batches = data_mod.random_batches(vocab, batch, seq_len, seed=seed, device=device,
                                          start=start)
    pending: list[torch.Tensor] = []  # this rank's losses of the steps not yet checked

    def settle() -> float | None:
        """Move the pending losses into `losses` as the global batch's (the mean over
        the ranks), stopping the run at the first one that is not finite."""
        if not pending:
            return None
        values = distributed.all_mean(torch.stack(pending).float().tolist())
        for k, v in enumerate(values):
            if not math.isfinite(v):
                raise NonFiniteLoss(f"the loss is {v} at step {len(losses) + k + 1}: "
                                    "stopping before anything of it is saved (lower --lr, "
                                    "or another precision)")
        losses.extend(values)
        pending.clear()
        return values[-1]

    def save(done: int) -> Path:
        settle()  # nothing non-finite is ever saved
        step.flush()  # a deferred update belongs to the steps saved
        return checkpoint.save(save_dir, done, inner, opt, scaler=step.scaler, keep=keep,
                               train_state={"losses": list(losses), "made_with": made_with,
                                            "run": run})

    dev = hardware.detect()
    peak = dev.peak_tflops("bf16") or hardware.measure_matmul_tflops(dtype=torch.float32)
    peak *= world  # the global tokens against every rank's peak
    # HFU counts what checkpointing runs twice; MFU does not (same as measure_step)
    recompute = checkpointing.recompute_flops(
        cfg, batch, seq_len, switches.gradient_checkpoint_config,
        attention_backend=backends_in_use(inner)["attention_backend"])
    timing.reset_peak_memory()
    stats, saved_to, stopped_by, done = None, None, None, start
    t_start = time.perf_counter()
    bar = Progress(range(start, steps), desc=f"train {cfg.num_hidden_layers}L",
                   enabled=progress, mininterval=5.0)
    window_t, window_steps = time.perf_counter(), 0
    with gc_between_steps(), StopRequest() as stop:  # no automatic collection in a step
        for i in bar:
            ids, labels = next(batches)  # the global batch: this rank keeps its share
            if world > 1:
                ids, labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
            pending.append(step(ids, labels))
            done, window_steps = i + 1, window_steps + 1
            boundary = done % log_every == 0 or done == steps
            if boundary:
                loss_now = settle()  # syncs: the window's time is complete
                dt = (time.perf_counter() - window_t) / window_steps
                stats = mfu.step_stats(cfg, batch=batch, seq_len=seq_len, step_time_s=dt,
                                       peak_tflops=peak, recompute_flops=recompute)
                mem = timing.peak_memory_gib()
                bar.set_postfix(loss=f"{loss_now:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}",
                                mfu=f"{stats.mfu:.1%}", mfu_attn=f"{stats.mfu_attn:.1%}",
                                mem=f"{mem:.1f}G" if mem else "-", refresh=False)
                window_t, window_steps = time.perf_counter(), 0
            # one rank alone cannot stop: the ranks agree at each log boundary
            if world == 1 and stop.requested or world > 1 and boundary and \
                    distributed.all_max([float(stop.requested)])[0]:
                stopped_by = stop.name or "a signal on another rank"
                break
            if save_dir is not None and save_every and done % save_every == 0 \
                    and done < steps:
                saved_to = save(done)
            if gc_every and done % gc_every == 0:
                collect_now()
    bar.close()
    settle()
    step.flush()
    if save_dir is not None and done > start and (saved_to is None
                                                  or saved_to.name != f"step_{done}"):
        saved_to = save(done)
    val = evaluate(inner, val_seqs, batch, eval_batches) \
        if val_seqs is not None and stopped_by is None else None  # on every rank: FSDP2
    if export_hf is not None and stopped_by is None:
        export(inner, opt, export_hf)
    return TrainResult(losses, val, stats, timing.peak_memory_gib(),
                       time.perf_counter() - t_start, type(opt).__name__,
                       moments_of(opt), saved_to, stopped_by)


@torch.no_grad()
def export(model, optimizer, path: Path) -> None:
    """Write `model` as a `transformers` checkpoint at `path`. Parameters kept in bf16
    or fp16 with fp32 masters in the optimizer (`MasterAdamW`, our AdamW) are exported
    as the masters: the weights the run really holds, not their rounded copies."""
    master = getattr(optimizer, "master", None)
    swapped = []
    for p in model.parameters() if master is not None else ():
        m = master(p)
        if m is not None and m.dtype != p.dtype:
            swapped.append((p, p.data))
            p.data = m
    try:
        model.to_hf().save_pretrained(path)
    finally:
        for p, data in swapped:
            p.data = data


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
