"""Whole training steps, timed side by side: the machinery behind every MFU delta.

A `Setup` is one way to train a model (our LLaMA with some `Switches`, or Hugging Face's
with SDPA / compile / Liger). `run_setups` times each in its own process, so an
out-of-memory in one cannot poison the next and compile caches do not leak between
them; a failure becomes a row with an `error` field. The chapters declare their setups
(`baseline.SETUPS`, `switch_deltas`), this module times them.
"""

from __future__ import annotations

import argparse
import dataclasses
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

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["switches"] = dataclasses.asdict(self.switches)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Setup:
        d = json.loads(text)
        d["switches"] = Switches(**d["switches"])
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
    """Build, warm up and time one setup in this process; returns its results row."""
    from colossal_lab import data, train

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model, loss_fn = build(setup, preset_name, device)
    micro = min(setup.micro_batch or batch, batch)
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt, setup.precision, loss_fn, micro_batches=batch // micro)
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=0, device=device)
    quick = device.type == "cpu"
    m = train.measure_step(step, batches, cfg=cfg, setup=setup.name, preset=preset_name,
                           batch=batch, seq_len=seq_len, micro_batch=micro,
                           warmup=1 if quick else 3, iters=2 if quick else setup.iters,
                           progress=progress,
                           extra={"label": setup.label, "precision": setup.precision})
    return m.row()


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
        return {"setup": setup.name, "label": setup.label, "preset": preset_name,
                "seq_len": seq_len, "batch": batch, "error": reason[-500:]}


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
    return (f"  {r['setup']:<26} {r['tokens_per_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"+attn {r['mfu_attn']:6.1%}  {mem}")


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
    """A chapter's MFU delta: `setups` side by side (`quick`: tiny model, in-process)."""
    if quick:
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
