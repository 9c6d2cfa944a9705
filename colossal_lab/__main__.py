"""`python -m colossal_lab {env,train,bench,execute,wheelhouse}`."""

from __future__ import annotations

import argparse
import sys


def cmd_env(a) -> None:
    """The device, its datasheet peaks and the ceilings it really reaches."""
    import platform

    import torch

    from colossal_lab import hardware

    dev = hardware.detect()
    print(f"device      {dev.describe()}")
    print(f"software    torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"python {platform.python_version()}")
    if dev.spec is not None:
        s = dev.spec
        print(f"datasheet   bf16 {s.bf16:g}  fp16 {s.fp16:g}  tf32 {s.tf32:g}  fp32 {s.fp32:g}  "
              f"fp8 {s.fp8 or '-'} TFLOP/s dense; memory {s.mem_gbps:g} GB/s")
        print(f"            source: {s.source}")
    elif dev.kind == "cuda":
        print("datasheet   unknown GPU: pass peak_tflops explicitly to the MFU functions")
    if a.no_measure:
        return
    print("measuring ceilings (median of many, random data) ...", flush=True)
    row = hardware.ceilings_row()
    peak, mem = row["peak_bf16_tflops"], row["datasheet_mem_gbps"]

    def frac(x, p):
        return f" ({x / p:.0%} of datasheet)" if p and x else ""

    print(f"matmul bf16 {row['matmul_bf16_tflops']:8.1f} TFLOP/s"
          f"{frac(row['matmul_bf16_tflops'], peak)}")
    for key, name in (("matmul_tf32_tflops", "tf32"), ("matmul_fp32_tflops", "fp32"),
                      ("matmul_fp8_tflops", "fp8 ")):
        if row[key]:
            print(f"matmul {name} {row[key]:8.1f} TFLOP/s")
    print(f"copy        {row['copy_gbps']:8.1f} GB/s (read + write){frac(row['copy_gbps'], mem)}")
    if a.save:
        from colossal_lab.results import save_results

        print("saved", save_results("env", [row], command="python -m colossal_lab env --save"))


def cmd_train(a) -> None:
    from colossal_lab import train
    from colossal_lab.config import Switches, preset

    cfg = preset(a.preset)
    if a.seq_len > cfg.max_position_embeddings:
        cfg = cfg.replace(max_position_embeddings=a.seq_len)
    sw = Switches(enable_flash_attention=_backend(a.attention),
                  enable_fused_normalization=_backend(a.norm), precision=a.precision)
    if a.vocab_size and a.vocab_size != cfg.vocab_size:
        cfg = cfg.replace(vocab_size=a.vocab_size)
    r = train.train(cfg, sw, batch=a.batch, seq_len=a.seq_len, steps=a.steps, lr=a.lr,
                    micro_batch=a.micro_batch, data=a.data, max_files=a.max_files,
                    log_every=a.log_every)
    print(f"final loss {r.losses[-1]:.4f}" + (f", validation {r.val_loss:.4f}"
                                               if r.val_loss is not None else ""))
    if r.stats:
        print(r.stats)
    if r.peak_mem_gib:
        print(f"peak memory {r.peak_mem_gib:.1f} GiB")


def _backend(v: str):
    return {"false": False, "off": False, "true": True, "on": True}.get(v.lower(), v)


def cmd_bench(a, rest) -> None:
    from colossal_lab import benchmarks

    benchmarks.get(a.name).main(rest)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m colossal_lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("env", help="device, peak FLOP/s and measured ceilings")
    e.add_argument("--no-measure", action="store_true", help="skip the ceiling measurements")
    e.add_argument("--save", action="store_true", help="save results/<gpu>/env.json")

    t = sub.add_parser("train", help="train a preset on the real-text corpus")
    t.add_argument("--preset", default="tiny")
    t.add_argument("--steps", type=int, default=50)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--micro-batch", type=int)
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    t.add_argument("--attention", default="true", help="false, true or a backend name")
    t.add_argument("--norm", default="true", help="false, true or a backend name")
    t.add_argument("--data", default="corpus", choices=["corpus", "random"])
    t.add_argument("--vocab-size", type=int, help="tokenizer vocabulary (default: preset's)")
    t.add_argument("--max-files", type=int, help="use a subset of the corpus")
    t.add_argument("--log-every", type=int, default=10)

    b = sub.add_parser("bench", help="run a GPU benchmark and save its results",
                       add_help=False)
    b.add_argument("name")

    sub.add_parser("execute", help="execute notebooks in place (refresh their outputs)",
                   add_help=False)
    w = sub.add_parser("wheelhouse", help="download wheels for an offline GPU node",
                       add_help=False)

    a, rest = p.parse_known_args(argv)
    if a.cmd == "bench":
        return cmd_bench(a, rest)
    if a.cmd == "execute":
        from colossal_lab import notebook

        return notebook.main(rest)
    if a.cmd == "wheelhouse":
        from colossal_lab import wheelhouse

        return wheelhouse.main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    del w
    {"env": cmd_env, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    main()
