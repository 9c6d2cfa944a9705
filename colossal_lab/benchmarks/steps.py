"""Whole training steps, timed side by side: the machinery behind every MFU delta.

A `Setup` is one way to train a model (our LLaMA with some `Switches`, or Hugging Face's
with SDPA / compile / Liger). `run_setups` times each in its own process, so an
out-of-memory in one cannot poison the next and compile caches do not leak between
them; a failure becomes a row with an `error` field. The chapters declare their setups
(`baseline.SETUPS`, `switch_deltas`), this module times them.

Memory is measured too, on a GPU: besides the step's peak, one extra forward+backward
(`memory_probe`) records the activation memory (peak during forward+backward minus
what was allocated just before the forward: parameters and optimizer states) and what
each decoder layer leaves allocated. A second probe at another batch gives the memory
one more sequence costs; from it `Setup.find_largest_batch` predicts the largest batch
that fits and verifies it in one run, and `Setup.auto_ratio` picks the fewest
checkpointed layers that fit the batch (chapter 04).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from colossal_lab.config import Switches, preset


@dataclass(frozen=True)
class Setup:
    """One way to train the model; `impl` is "ours" or "hf" (Hugging Face)."""

    name: str
    label: str
    impl: str = "ours"
    precision: str = "bf16"
    switches: Switches = field(default_factory=Switches)
    compile: bool = False
    liger: bool = False
    micro_batch: int | None = None
    """Gradient-accumulation slice; naive attention needs small slices to fit."""
    iters: int = 8
    warmup: int = 3
    preset: str | None = None
    """This setup's model preset, overriding the chapter's (e.g. full LLaMA-7B)."""
    batch: int | None = None
    """This setup's batch, overriding the chapter's."""
    find_largest_batch: bool = False
    """Predict the largest batch that fits from two memory probes and verify it by
    running it (GPU only): the `largest_batch*` fields of the row."""
    auto_ratio: bool = False
    """Before timing, set the fewest checkpointed layers (full recomputation) that fit
    `batch`, from three memory probes (GPU only; ours only)."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)  # nested dataclasses (a checkpoint config) as dicts
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Setup:
        d = json.loads(text)
        sw = d["switches"]
        if isinstance(sw.get("gradient_checkpoint_config"), dict):
            from colossal_lab.switches.checkpointing import resolve

            sw["gradient_checkpoint_config"] = resolve(sw["gradient_checkpoint_config"])
        d["switches"] = Switches(**sw)
        return cls(**d)


def build(setup: Setup, preset_name: str, device: torch.device):
    """The model for `setup` on `device` with fp32 weights, and its loss function."""
    from colossal_lab import train
    from colossal_lab.model import build_model

    cfg = preset(preset_name)
    if setup.impl == "ours":
        model = build_model(cfg, setup.switches, device)
        if setup.compile:
            model = torch.compile(model)
        return model, train.our_loss
    if setup.impl != "hf":
        raise ValueError(f"impl={setup.impl!r}; choose 'ours' or 'hf'")
    from transformers import AutoModelForCausalLM

    if setup.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches the module's classes: before building
    hf_cfg = cfg.to_hf()
    hf_cfg.use_cache = False
    with device:
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    model.train()
    if setup.compile:
        model = torch.compile(model)
    return model, train.hf_loss


def measure_one(setup: Setup, preset_name: str, seq_len: int, batch: int,
                progress: bool = True) -> dict:
    """Build, warm up and time one setup in this process; returns its results row.

    On a GPU the row also carries the memory probes' fields (`memory_probe`) and,
    when the setup asks, the largest batch (`find_largest_batch`) and the ratio chosen
    to fit (`auto_ratio`)."""
    from colossal_lab import data, train

    preset_name, batch = setup.preset or preset_name, setup.batch or batch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model, loss_fn = build(setup, preset_name, device)
    micro = min(setup.micro_batch or batch, batch)
    opt = train.make_optimizer(model)
    quick = device.type == "cpu"
    extra = {"label": setup.label, "precision": setup.precision}
    probe = _Prober(model, loss_fn, setup, cfg, seq_len, device)
    if setup.auto_ratio:
        extra.update(_auto_ratio(probe, model, opt, batch))
    step = train.make_step(model, opt, setup.precision, loss_fn, micro_batches=batch // micro)
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=0, device=device)
    acct = _recompute_accounting(model, setup, cfg, batch, seq_len, device)
    m = train.measure_step(step, batches, cfg=cfg, setup=setup.name, preset=preset_name,
                           batch=batch, seq_len=seq_len, micro_batch=micro,
                           warmup=1 if quick else setup.warmup,
                           iters=2 if quick else setup.iters, progress=progress,
                           recompute_fraction=acct.pop("_fraction"), extra=extra)
    row = m.row()
    _apply_accounting(row, cfg, acct)
    row.update(probe.fields(micro))
    if setup.find_largest_batch and probe.available:
        big, why = _guarded(_largest_batch, probe, model, opt, loss_fn, setup, cfg,
                            preset_name, seq_len, row, model=model)
        row.update(big if big is not None else {"largest_batch_note": why})
    return row


# ------------------------------------------------------------------ recompute, HFU


def _recompute_accounting(model, setup: Setup, cfg, batch: int, seq_len: int,
                          device) -> dict:
    """What the step recomputes (our model's checkpoint config) and its FLOPs."""
    from colossal_lab.switches import checkpointing
    from colossal_lab.switches.attention import resolve_backend

    config = getattr(getattr(model, "model", None), "gradient_checkpoint_config", None)
    if setup.impl != "ours" or config is None:
        return {"_fraction": 0.0, "recompute_flops": 0.0, "ckpt_mode": None,
                "ckpt_layers": 0, "ckpt_ratio": 0.0}
    backend = resolve_backend(setup.switches.enable_flash_attention, device)
    spec = checkpointing.recompute_spec(config, cfg.num_hidden_layers,
                                        attention_backend=backend)
    flops = checkpointing.recompute_flops(cfg, batch, seq_len, config,
                                          attention_backend=backend)
    return {"_fraction": spec.fraction if spec.gemms else 0.0, "recompute_flops": flops,
            "ckpt_mode": config.mode, "ckpt_layers": spec.layers,
            "ckpt_ratio": spec.fraction}


def _apply_accounting(row: dict, cfg, acct: dict) -> None:
    """HFU from the exact recomputed FLOPs, and what ColossalAI's evaluator would call
    MFU for this step (8N per token whenever checkpointing is on)."""
    from colossal_lab import mfu
    from colossal_lab.switches.checkpointing import colossalai_flops

    t, peak = row["step_ms"] / 1e3, row["peak_tflops"] * 1e12
    tokens = row["batch"] * row["seq_len"]
    hw = mfu.hardware_flops(cfg, tokens, row["seq_len"],
                            recompute_flops=acct["recompute_flops"])
    row["hfu"] = hw / t / peak
    row["mfu_colossalai"] = colossalai_flops(cfg, tokens, acct["ckpt_layers"] > 0) / t / peak
    row["recompute_tflop"] = acct["recompute_flops"] / 1e12
    row.update({k: acct[k] for k in ("ckpt_mode", "ckpt_layers", "ckpt_ratio")})


# --------------------------------------------------------------------------- memory

GIB = 2**30


def memory_probe(model, loss_fn, precision: str, input_ids: torch.Tensor,
                 labels: torch.Tensor, layers=None) -> dict:
    """One forward + backward (no optimizer step), measured by the CUDA allocator.

    Returns (GiB) `before` (allocated just before the forward: parameters, optimizer
    states), `peak`, `activation` (= peak − before: everything the forward keeps and
    the backward allocates, gradients included), `saved` (allocated after the forward −
    before: what the forward keeps for the backward, and the loss) and `per_layer`: what
    each decoder layer in `layers` left allocated when its forward returned (from the
    second layer on). Empty on a CPU, which has no allocator statistics."""
    from colossal_lab import train

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
        with train.autocast(precision, input_ids.device):
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


def _guarded(fn, *args, model=None) -> tuple[object, str | None]:
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


class _Prober:
    """Memory probes of one model at any batch, remembered by batch."""

    def __init__(self, model, loss_fn, setup: Setup, cfg, seq_len: int, device):
        self.model, self.loss_fn, self.setup = model, loss_fn, setup
        self.cfg, self.seq_len, self.device = cfg, seq_len, device
        inner = getattr(model, "model", None)
        self.layers = None if setup.compile else getattr(inner, "layers", None)
        self.results: dict[int, dict] = {}
        self.available = device.type == "cuda"
        """Allocator statistics exist (a GPU)."""

    def __call__(self, batch: int) -> dict:
        from colossal_lab import data

        ids, labels = next(data.random_batches(self.cfg.vocab_size, batch, self.seq_len,
                                               seed=1, device=self.device))
        r = memory_probe(self.model, self.loss_fn, self.setup.precision, ids, labels,
                         self.layers)
        self.results[batch] = r
        return r

    def fields(self, batch: int) -> dict:
        """Row fields from a probe at `batch` (and the per-sample slope when another batch
        was probed)."""
        if not self.available:
            return {"activation_mem_gib": None, "saved_mem_gib": None, "layer_mem_gib": None}
        r = self.results.get(batch)
        if r is None:
            r, why = _guarded(self, batch, model=self.model)
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
        inner = getattr(self.model, "model", None)
        return inner.checkpointed_layers() if hasattr(inner, "checkpointed_layers") else None


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _slope(a: dict, b: dict, ba: int, bb: int, key: str = "peak") -> float:
    return (b[key] - a[key]) / (bb - ba)


def _auto_ratio(probe: _Prober, model, opt, batch: int) -> dict:
    """Set the fewest checkpointed layers (first of each stage, full recomputation)
    that fit `batch`, from probes at batch 1 and 2 with every layer checkpointed and at
    batch 1 with none (`checkpointing.MemoryModel`)."""
    from colossal_lab import data, train
    from colossal_lab.switches.checkpointing import GradientCheckpointConfig, MemoryModel

    if not probe.available:
        return {}
    inner = model.model
    base = inner.gradient_checkpoint_config or GradientCheckpointConfig()
    with_ratio = lambda r: dataclasses.replace(  # noqa: E731
        base, gradient_checkpointing_ratio=r, num_ckpt_layers_per_stage=None)
    inner.set_gradient_checkpointing(with_ratio(1.0))
    warm = train.make_step(model, opt, probe.setup.precision, probe.loss_fn)
    warm(*next(data.random_batches(probe.cfg.vocab_size, 1, probe.seq_len, seed=3,
                                   device=probe.device)))  # optimizer states exist now
    one, two = probe(1), probe(2)
    full = _slope(one, two, 1, 2)
    fixed = one["peak"] - full
    inner.set_gradient_checkpointing(with_ratio(0.0))
    none, _ = _guarded(probe, 1, model=model)
    n_layers = len(inner.layers)
    mm = MemoryModel(fixed, none["peak"] - fixed if none else float("inf"), full,
                     n_layers, capacity_gib())
    k = mm.min_ckpt_layers(batch) if none else n_layers
    k = n_layers if k is None else k
    inner.set_gradient_checkpointing(with_ratio(k / n_layers))
    probe.results.clear()  # those were other configurations
    return {"auto_ratio_ckpt_layers": k, "mem_fixed_gib": fixed,
            "mem_per_sample_none_gib": mm.per_sample_none_gib if none else None,
            "mem_per_sample_full_gib": full, "mem_capacity_gib": mm.capacity_gib,
            "predicted_peak_gib": mm.peak(batch, k)}


def _largest_batch(probe: _Prober, model, opt, loss_fn, setup: Setup, cfg,
                   preset_name: str, seq_len: int, row: dict) -> dict:
    """Predict the largest batch from the memory one more sequence costs (two probes),
    then verify it by timing a few steps at that batch (one step down if it does not
    fit). A prediction from one batch would mix the fixed memory into the slope."""
    from colossal_lab import data, train
    from colossal_lab.switches.checkpointing import largest_batch

    batch = row["batch"]
    other = batch // 2 if batch >= 2 else 2
    a = probe.results.get(batch) or probe(batch)
    b, why = probe.results.get(other), None
    if b is None:
        b, why = _guarded(probe, other, model=model)
    out = {"largest_batch_predicted": None, "largest_batch": None}
    if b is None and other > batch:  # batch 1 fits and 2 does not: nothing to predict
        out.update(largest_batch_predicted=batch, largest_batch=batch,
                   largest_batch_note=f"batch {other} failed in a probe: {why}")
        _copy_largest(out, row)
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
        _copy_largest(out, row)
        return out
    def time_at(bs: int) -> dict:
        acct = _recompute_accounting(model, setup, cfg, bs, seq_len, probe.device)
        step = train.make_step(model, opt, setup.precision, loss_fn)
        batches = data.random_batches(cfg.vocab_size, bs, seq_len, seed=2, device=probe.device)
        m = train.measure_step(step, batches, cfg=cfg, setup=setup.name, preset=preset_name,
                               batch=bs, seq_len=seq_len, warmup=1, iters=2, progress=False,
                               recompute_fraction=acct.pop("_fraction"))
        r = m.row()
        _apply_accounting(r, cfg, acct)
        return r

    for bs in (predicted, predicted - 1):
        if bs <= batch:
            break
        torch.cuda.empty_cache()
        r, why = _guarded(time_at, bs, model=model)
        if r is not None:
            out["largest_batch"] = bs
            _copy_largest(out, r)
            break
        out["largest_batch_note"] = f"batch {bs}: {why}"
        if why != "out of memory":
            break
    return out


def _per_sample_layer(a: dict, b: dict, ba: int, bb: int):
    la, lb = _mean(a["per_layer"]), _mean(b["per_layer"])
    return None if la is None or lb is None else (la - lb) / (ba - bb)


def _copy_largest(out: dict, r: dict) -> None:
    for k in ("tokens_per_s", "mfu", "mfu_attn", "hfu", "peak_mem_gib", "step_ms"):
        out[f"largest_batch_{k}"] = r.get(k)


def measure_isolated(setup: Setup, preset_name: str, seq_len: int, batch: int) -> dict:
    """`measure_one` in a child process; a failure becomes a row with an `error`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "colossal_lab.benchmarks.steps", "--setup-json",
               setup.to_json(), "--preset", preset_name, "--seq-len", str(seq_len),
               "--batch", str(batch), "--json-out", out]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        tail = [line for line in proc.stdout.strip().splitlines() if line.strip()][-3:]
        reason = "out of memory" if "OutOfMemoryError" in proc.stdout else " | ".join(tail)
        return {"setup": setup.name, "label": setup.label,
                "preset": setup.preset or preset_name, "seq_len": seq_len,
                "batch": setup.batch or batch, "error": reason[-500:]}


def run_setups(setups, *, preset_name: str, seq_len: int, batch: int,
               isolate: bool = True, tag: str = "steps") -> list[dict]:
    """Time every setup, side by side; prints one line per setup as it finishes."""
    rows = []
    for s in setups:
        print(f"[{tag}] {s.name} ...", flush=True)
        row = (measure_isolated(s, preset_name, seq_len, batch) if isolate
               else measure_one(s, preset_name, seq_len, batch, progress=False))
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    if "error" in r:
        return f"  {r['setup']:<26} failed: {r['error'][:80]}"
    mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else "-"
    if r.get("activation_mem_gib") is not None:
        mem += f" (activations {r['activation_mem_gib']:.1f})"
    hfu = f"  HFU {r['hfu']:6.1%}" if r.get("ckpt_layers") else ""
    big = (f"  largest batch {r['largest_batch']} (predicted {r['largest_batch_predicted']})"
           if r.get("largest_batch_predicted") is not None else "")
    return (f"  {r['setup']:<26} {r['tokens_per_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"+attn {r['mfu_attn']:6.1%}{hfu}  {mem}{big}")


def _child(argv=None) -> None:
    p = argparse.ArgumentParser(description="time one setup (child of measure_isolated)")
    p.add_argument("--setup-json", required=True)
    p.add_argument("--preset", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    row = measure_one(Setup.from_json(a.setup_json), a.preset, a.seq_len, a.batch)
    with open(a.json_out, "w") as f:
        json.dump(row, f)


def run_chapter(name: str, setups, quick: bool = False, *, preset_name: str = "llama-7b-8l",
                seq_len: int = 4096, batch: int = 4) -> list[dict]:
    """A chapter's MFU delta: `setups` side by side (`quick`: tiny model, in-process;
    per-setup preset and batch overrides are dropped)."""
    if quick:
        setups = [dataclasses.replace(s, preset=None, batch=None) for s in setups]
        return run_setups(setups, preset_name="tiny", seq_len=64, batch=2, isolate=False,
                          tag=name)
    return run_setups(setups, preset_name=preset_name, seq_len=seq_len, batch=batch, tag=name)


def step_config(preset_name="llama-7b-8l", seq_len=4096, batch=4) -> dict:
    return {"preset": preset_name, "seq_len": seq_len, "batch": batch, "optimizer": "AdamW",
            "data": "random tokens", "mfu_peak": "dense bf16 datasheet peak",
            "attention_flops": "causal, half of 12·L·d·S per token"}


def main_for(name: str, setups, argv=None) -> None:
    """The command line of a chapter's MFU-delta benchmark: time `setups` side by side
    and save `results/<gpu>/<name>.json` (`--quick`: tiny model on CPU, not saved)."""
    p = argparse.ArgumentParser(description=f"MFU delta: {name}")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--preset", default="llama-7b-8l")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--setups", nargs="*", choices=[s.name for s in setups])
    a = p.parse_args(argv)
    chosen = [s for s in setups if a.setups is None or s.name in a.setups]
    rows = run_chapter(name, chosen, a.quick, preset_name=a.preset, seq_len=a.seq_len,
                       batch=a.batch)
    if not a.quick:
        from colossal_lab.results import save_results

        path = save_results(name, rows, config=step_config(a.preset, a.seq_len, a.batch),
                            command=f"python -m colossal_lab bench {name}")
        print(f"saved {path}")


if __name__ == "__main__":
    _child()
