"""`python -m colossal_lab train`: every switch from the command line, one run.

    python -m colossal_lab train --preset llama-7b-8l --seq-len 4096 --batch 4 \\
        --switches best --steps 200 --save-dir runs/a --save-every 50
    python -m colossal_lab train ... --save-dir runs/a --resume     # continues exactly
    python -m colossal_lab train ... --export-hf runs/a/hf          # transformers loads it

The switches come from a named set (`SWITCH_SETS`: naive, bf16, best, best-fp8) or a
JSON file of `Switches` fields (`--switches FILE`), then each flag overrides one field.
Bad input of any kind (a value out of range, an unknown name, an unreadable switches
file, a checkpoint that cannot be resumed) ends with one line and exit status 2, as
argparse's own errors do: never a traceback from inside the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from colossal_lab.config import PRESETS, SWITCH_SETS, Switches, preset
from colossal_lab.errors import UsageError
from colossal_lab.fallback import BackendUnavailable
from colossal_lab.ops import attention, cross_entropy, embedding, norm, rope, swiglu
from colossal_lab.parallel import data_parallel, distributed
from colossal_lab.precision import OPTIMIZER_BACKENDS, PRECISIONS
from colossal_lab.switches import checkpointing
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.switches.compile import MODES as COMPILE_MODES
from colossal_lab.training import train

CKPT_MODES = ("none", "full", "selective", "elementwise")


def whole(low: int):
    """An argparse type: a whole number >= `low`, or a one-line error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text) if text.strip() not in ("0", "0.0") else 0.0
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1]")
    return value


def _backend(names: tuple[str, ...]):
    """A switch value: true/false (on/off) or one of `names`."""
    def parse(text: str):
        low = text.lower()
        if low in ("true", "on"):
            return True
        if low in ("false", "off"):
            return False
        if text not in names:
            raise argparse.ArgumentTypeError(
                f"{text!r}; choose true, false or one of {', '.join(names)}")
        return text
    return parse


def add_arguments(t: argparse.ArgumentParser) -> None:
    """The `train` command's flags, in groups: run, switches, data parallelism, checkpoints."""
    run = t.add_argument_group("run")
    run.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    run.add_argument("--steps", type=whole(1), default=50)
    run.add_argument("--batch", type=whole(1), default=8)
    run.add_argument("--micro-batch", type=whole(1))
    run.add_argument("--seq-len", type=whole(2), default=128)
    run.add_argument("--lr", type=_positive_float, default=3e-4)
    run.add_argument("--data", default="corpus", choices=["corpus", "random"])
    run.add_argument("--vocab-size", type=whole(2), help="tokenizer vocabulary "
                     "(default: the preset's)")
    run.add_argument("--max-files", type=whole(1), help="use a subset of the corpus")
    run.add_argument("--seed", type=whole(0), default=0)
    run.add_argument("--log-every", type=whole(1), default=10)
    run.add_argument("--device", help="cuda, cuda:1, cpu (default: the GPU if any)")
    sw = t.add_argument_group("switches (a set or file, then one flag per field)")
    sw.add_argument("--switches", default="best", help=f"one of {', '.join(SWITCH_SETS)} "
                    "or a JSON file of Switches fields (default: best)")
    sw.add_argument("--attention", type=_backend(attention.BACKENDS))
    sw.add_argument("--norm", type=_backend(norm.BACKENDS))
    sw.add_argument("--projections", type=_backend(swiglu.ACTIVATIONS))
    sw.add_argument("--rope", type=_backend(rope.BACKENDS), help="our RoPE kernel")
    sw.add_argument("--loss", type=_backend(cross_entropy.BACKENDS), help="fused head + loss")
    sw.add_argument("--embedding", type=_backend(embedding.BACKENDS),
                    help="our embedding backward")
    sw.add_argument("--checkpointing", choices=CKPT_MODES)
    sw.add_argument("--ckpt-ratio", type=_fraction, help="share of layers to checkpoint")
    sw.add_argument("--precision", choices=PRECISIONS)
    sw.add_argument("--optimizer", type=_backend(OPTIMIZER_BACKENDS),
                    help="AdamW: 'torch' (clipping, then torch's or MasterAdamW) or "
                         "'triton' (ours, one pass, clipping folded in)")
    sw.add_argument("--compile", type=_backend(COMPILE_MODES),
                    help="torch.compile: 'layers' (each decoder layer, = true) or "
                         "'model' (the whole forward), the first step compiles; or "
                         "'graph': the whole step replayed as a CUDA graph")
    sw.add_argument("--compile-backend", help="torch.compile backend (default inductor; "
                    "aot_eager or eager to trace without generating code)")
    sw.add_argument("--fp8-scaling", choices=["dynamic", "delayed"])
    dp = t.add_argument_group("data parallelism (switch 8)")
    dp.add_argument("--nproc", type=whole(1), default=1, help="processes on this node "
                    "(re-launched through torchrun; one per GPU, gloo on a CPU)")
    dp.add_argument("--dp", type=_backend(data_parallel.BACKENDS),
                    help="gradient reduction: true (= overlap), naive, overlap, ddp, fsdp2")
    dp.add_argument("--dp-bucket-elems", type=whole(1), help="elements per bucket "
                    f"(default {data_parallel.DEFAULT_BUCKET_ELEMS:,}, ColossalAI's 12M)")
    dp.add_argument("--dp-reduce-dtype", choices=["bfloat16", "float32"],
                    help="reduce gradients in this dtype (default: theirs)")
    dp.add_argument("--dist-timeout", type=_positive_float, default=600.0,
                    help="seconds any collective may wait before the run stops")
    ck = t.add_argument_group("checkpoints")
    ck.add_argument("--save-dir", help="folder for checkpoints (step_N/, latest)")
    ck.add_argument("--save-every", type=whole(0), default=0, help="steps between "
                    "checkpoints (0: only at the end)")
    ck.add_argument("--resume", action="store_true", help="continue from --save-dir's "
                    "newest checkpoint")
    ck.add_argument("--overwrite", action="store_true", help="start afresh in a --save-dir "
                    "that holds checkpoints, deleting them (without it, such a run refuses)")
    ck.add_argument("--keep", type=whole(1), default=2, help="checkpoints to keep, newest "
                    "first (default 2: the previous good one stays)")
    ck.add_argument("--export-hf", help="write a transformers checkpoint (a folder) here "
                    "at the end")


def load_switches(spec: str) -> Switches:
    """A named set or a JSON file of `Switches` fields; ValueError saying what is wrong."""
    if spec in SWITCH_SETS:
        return SWITCH_SETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--switches {spec!r}: neither a set ({', '.join(SWITCH_SETS)}) "
                         "nor a file")
    try:
        fields = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--switches {spec}: not valid JSON ({e})") from None
    return Switches.from_dict(fields, checkpoint_config=checkpointing.resolve,
                              where=f"--switches {spec}")


def switches_from(a: argparse.Namespace) -> Switches:
    """The set or file, then each given flag over its field."""
    sw = load_switches(a.switches)
    changes = {k: v for k, v in (("enable_flash_attention", a.attention),
                                 ("enable_fused_normalization", a.norm),
                                 ("enable_fused_projections", a.projections),
                                 ("enable_fused_rope", a.rope),
                                 ("enable_fused_cross_entropy", a.loss),
                                 ("enable_fused_embedding", a.embedding),
                                 ("precision", a.precision),
                                 ("enable_fused_optimizer", a.optimizer),
                                 ("enable_compile", a.compile),
                                 ("overlap_communication", a.dp)) if v is not None}
    if a.checkpointing == "none":
        changes["gradient_checkpoint_config"] = None
    elif a.checkpointing is not None or a.ckpt_ratio is not None:
        changes["gradient_checkpoint_config"] = GradientCheckpointConfig(
            gradient_checkpointing_ratio=a.ckpt_ratio, mode=a.checkpointing or "full")
    extra = {k: v for k, v in (("fp8_scaling", a.fp8_scaling),
                               ("compile_backend", a.compile_backend),
                               ("dp_bucket_elems", a.dp_bucket_elems),
                               ("dp_reduce_dtype", a.dp_reduce_dtype)) if v is not None}
    if extra:
        changes["extra"] = {**sw.extra, **extra}
    return sw.replace(**changes)


def relaunch(argv: list[str], nproc: int) -> int:
    """Run this same command on `nproc` processes through torchrun (one node), without
    `--nproc`; returns torchrun's exit status."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "colossal_lab", *rest]
    return subprocess.call(cmd)


def _check_device(text: str | None) -> None:
    if text is None:
        return
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device {text}: choose cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: no CUDA GPU here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: there are {torch.cuda.device_count()} "
                             "GPUs (cuda:0 ...)")
    elif dev.type != "cpu":
        raise UsageError(f"--device {text}: choose cpu, cuda or cuda:N")


def setup_of(a: argparse.Namespace) -> tuple:
    """(ModelConfig, Switches, train keyword arguments) for `a`, checked for what
    argparse cannot see (`UsageError`)."""
    if a.save_dir is not None and not a.save_dir.strip():
        raise UsageError("--save-dir is empty: name a folder for the checkpoints")
    if a.export_hf is not None and not a.export_hf.strip():
        raise UsageError("--export-hf is empty: name a folder for the export")
    _check_device(a.device)
    sw = switches_from(a)
    if a.fp8_scaling is not None and sw.precision != "fp8":
        raise UsageError(f"--fp8-scaling {a.fp8_scaling} needs --precision fp8 (the "
                         f"switches say {sw.precision})")
    cfg = preset(a.preset)
    if a.vocab_size and a.vocab_size != cfg.vocab_size:
        cfg = cfg.replace(vocab_size=a.vocab_size)
    kw = dict(batch=a.batch, seq_len=a.seq_len, steps=a.steps, lr=a.lr,
              micro_batch=a.micro_batch, data=a.data, max_files=a.max_files, seed=a.seed,
              save_dir=a.save_dir, save_every=a.save_every, resume=a.resume,
              export_hf=a.export_hf, overwrite=a.overwrite, keep=a.keep)
    return cfg, sw, kw


def run(a: argparse.Namespace, argv: list[str] | None = None) -> None:
    """Train as `a` says; bad input raises `UsageError` (one line and exit status 2 at
    the dispatch). With `--nproc N` outside torchrun, check what can be checked here,
    then re-launch `argv` through it; under torchrun, this is one rank
    (`colossal_lab.parallel.distributed`), and rank 0 prints."""
    if a.nproc > 1 and "WORLD_SIZE" not in os.environ:
        try:
            cfg, sw, kw = setup_of(a)
            train.check(cfg, sw, world=a.nproc, **kw)
        except (ValueError, BackendUnavailable) as e:
            raise UsageError(str(e).splitlines()[0]) from None
        sys.exit(relaunch(argv if argv is not None else sys.argv[1:], a.nproc))
    env = distributed.init(timeout_s=a.dist_timeout)
    try:
        cfg, sw, kw = setup_of(a)
        with distributed.guard("train") if env.world_size > 1 else contextlib.nullcontext():
            r = train.train(cfg, sw, device=a.device, log_every=a.log_every, **kw)
    except (ValueError, BackendUnavailable) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    distributed.destroy()
    if not env.is_main:
        return
    if env.world_size > 1:
        print(f"{env.world_size} ranks ({env.backend}), gradient reduction "
              f"{sw.overlap_communication or 'naive'}")
    if r.stopped_by:
        print(f"stopped by {r.stopped_by} after step {len(r.losses)}"
              + (f": resume with --resume from {r.checkpoint}" if r.checkpoint else ""))
    if r.losses:
        print(f"final loss {r.losses[-1]:.4f}" + (f", validation {r.val_loss:.4f}"
                                                   if r.val_loss is not None else ""))
    if r.stats:
        print(r.stats)
    if r.peak_mem_gib:
        print(f"peak memory {r.peak_mem_gib:.1f} GiB")
    if r.checkpoint:
        print(f"checkpoint: {r.checkpoint}")
    if a.export_hf and not r.stopped_by:
        print(f"transformers checkpoint: {a.export_hf}")
