"""Chapter 00's baseline: our model with every switch off against what a user would pick.

One training step (AdamW, random tokens) of the same model shape, timed side by side in
one run: our LLaMA naive in fp32 and in bf16 (eager attention, eager norm), our LLaMA
with PyTorch's SDPA (a sanity check that our model is no slower than Hugging Face's),
and Hugging Face `LlamaForCausalLM` with SDPA, + `torch.compile`, and with Liger's
kernels. Each setup runs in its own process so an out-of-memory in one cannot poison the
next and compile caches do not leak between them.

    python -m colossal_lab bench baseline            # llama-7b-8l, seq 4096, batch 4
    python -m colossal_lab bench baseline --quick    # tiny model, CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from colossal_lab.config import Switches, preset
from colossal_lab.results import save_results


@dataclass(frozen=True)
class Setup:
    """One way to train the model; `impl` is "ours" or "hf" (Hugging Face)."""

    name: str
    label: str
    impl: str
    precision: str = "bf16"
    switches: Switches = field(default_factory=Switches)
    compile: bool = False
    liger: bool = False
    micro_batch: int | None = None
    """Gradient-accumulation slice; naive attention needs small slices to fit."""
    iters: int = 8


SETUPS = (
    Setup("ours-fp32-naive", "ours: fp32, naive attention + norm", "ours", "fp32",
          Switches.naive("fp32"), micro_batch=1, iters=4),
    Setup("ours-bf16-naive", "ours: bf16, naive attention + norm", "ours", "bf16",
          Switches.naive("bf16"), micro_batch=1),
    Setup("ours-bf16-sdpa", "ours: bf16, SDPA + F.rms_norm", "ours", "bf16",
          Switches(enable_flash_attention="sdpa", enable_fused_normalization="torch")),
    Setup("hf-bf16-sdpa", "HF transformers: bf16, SDPA", "hf", "bf16"),
    Setup("hf-bf16-sdpa-compile", "HF transformers: bf16, SDPA, torch.compile", "hf", "bf16",
          compile=True),
    Setup("hf-bf16-sdpa-liger", "HF transformers: bf16, SDPA, Liger kernels", "hf", "bf16",
          liger=True),
)
SETUP_NAMES = tuple(s.name for s in SETUPS)


def _setup(name: str) -> Setup:
    for s in SETUPS:
        if s.name == name:
            return s
    raise ValueError(f"unknown setup {name!r}; choose from {SETUP_NAMES}")


def build(setup: Setup, preset_name: str, device: torch.device):
    """The model for `setup` on `device` with fp32 weights, and its loss function."""
    from colossal_lab import train
    from colossal_lab.model import build_model

    cfg = preset(preset_name)
    if setup.impl == "ours":
        return build_model(cfg, setup.switches, device), train.our_loss
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


def measure_one(name: str, preset_name: str, seq_len: int, batch: int,
                progress: bool = True) -> dict:
    """Build, warm up and time one setup in this process; returns its results row."""
    from colossal_lab import data, train

    setup = _setup(name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model, loss_fn = build(setup, preset_name, device)
    micro = min(setup.micro_batch or batch, batch)
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt, setup.precision, loss_fn, micro_batches=batch // micro)
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=0, device=device)
    quick = device.type == "cpu"
    m = train.measure_step(step, batches, cfg=cfg, setup=name, preset=preset_name,
                           batch=batch, seq_len=seq_len, micro_batch=micro,
                           warmup=1 if quick else 3, iters=2 if quick else setup.iters,
                           progress=progress,
                           extra={"label": setup.label, "precision": setup.precision})
    return m.row()


def measure_isolated(name: str, preset_name: str, seq_len: int, batch: int) -> dict:
    """`measure_one` in a child process; a failure (say, out of memory) becomes a row
    with an `error` field instead of ending the run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "colossal_lab.benchmarks.baseline", "--one", name,
               "--preset", preset_name, "--seq-len", str(seq_len), "--batch", str(batch),
               "--json-out", out]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        tail = [line for line in proc.stdout.strip().splitlines() if line.strip()][-3:]
        reason = "out of memory" if "OutOfMemoryError" in proc.stdout else " | ".join(tail)
        setup = _setup(name)
        return {"setup": name, "label": setup.label, "preset": preset_name,
                "seq_len": seq_len, "batch": batch, "error": reason[-500:]}


def run(quick: bool = False, *, preset_name: str = "llama-7b-8l", seq_len: int = 4096,
        batch: int = 4, setups=None, isolate: bool | None = None) -> list[dict]:
    """Every setup, side by side. `quick`: the tiny model at seq 64 (CPU smoke test)."""
    if quick:
        preset_name, seq_len, batch = "tiny", 64, 2
        setups = setups or ("ours-fp32-naive", "ours-bf16-naive", "ours-bf16-sdpa",
                            "hf-bf16-sdpa")
    setups = setups or SETUP_NAMES
    isolate = (not quick) if isolate is None else isolate
    rows = []
    for name in setups:
        print(f"[baseline] {name} ...", flush=True)
        if isolate:
            row = measure_isolated(name, preset_name, seq_len, batch)
        else:
            row = measure_one(name, preset_name, seq_len, batch, progress=False)
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    if "error" in r:
        return f"  {r['setup']:<24} failed: {r['error'][:80]}"
    mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else "-"
    return (f"  {r['setup']:<24} {r['tokens_per_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"+attn {r['mfu_attn']:6.1%}  {mem}")


def config_of(preset_name="llama-7b-8l", seq_len=4096, batch=4) -> dict:
    return {"preset": preset_name, "seq_len": seq_len, "batch": batch, "optimizer": "AdamW",
            "data": "random tokens", "mfu_peak": "dense bf16 datasheet peak",
            "attention_flops": "causal, half of 12·L·d·S per token"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--preset", default="llama-7b-8l")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--setups", nargs="*", choices=SETUP_NAMES)
    p.add_argument("--one", choices=SETUP_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:  # child process of measure_isolated
        row = measure_one(a.one, a.preset, a.seq_len, a.batch)
        with open(a.json_out, "w") as f:
            json.dump(row, f)
        return
    rows = run(a.quick, preset_name=a.preset, seq_len=a.seq_len, batch=a.batch,
               setups=a.setups)
    if not a.quick:
        path = save_results("baseline", rows, config=config_of(a.preset, a.seq_len, a.batch),
                            command="python -m colossal_lab bench baseline")
        print(f"saved {path}")


if __name__ == "__main__":
    main()
