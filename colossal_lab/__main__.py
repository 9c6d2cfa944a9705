"""`python -m colossal_lab {env,train,bench,doctor,execute,wheelhouse}`."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from colossal_lab import benchmarks, doctor, wheelhouse
from colossal_lab.book import notebook
from colossal_lab.errors import UsageError
from colossal_lab.fallback import BackendUnavailable
from colossal_lab.measure import hardware
from colossal_lab.measure.results import save_results
from colossal_lab.training import cli as cli_train


def cmd_env(a) -> None:
    """The device, its datasheet peaks and the ceilings it really reaches."""
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
        print("saved", save_results("env", [row], command="python -m colossal_lab env --save"))


def cmd_bench(a, rest, error) -> None:
    """Run one benchmark; without a name, list them (`bench --help` too)."""
    names = ", ".join(sorted(benchmarks.BENCHMARKS))
    if a.name is None:
        if {"-h", "--help"} & set(rest):
            print("usage: python -m colossal_lab bench NAME [options]\n\n"
                  f"benchmarks: {names}\n\n`bench NAME --help` lists one's options.")
            return
        error(f"which benchmark? choose one of: {names}")
    if a.name not in benchmarks.BENCHMARKS:
        error(f"unknown benchmark {a.name!r}; choose one of: {names}")
    benchmarks.get(a.name).main(rest)


def check_notebooks(rest: list[str]) -> None:
    """`execute`'s paths exist and are notebooks (JSON with cells), before any runs."""
    skip = False
    for arg in rest:
        if skip or arg.startswith("-"):
            skip = arg == "--timeout"
            continue
        path = Path(arg)
        if not path.is_file():
            raise UsageError(f"{arg}: no such notebook")
        try:
            cells = json.loads(path.read_text()).get("cells")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            cells = None
        if path.suffix != ".ipynb" or not isinstance(cells, list):
            raise UsageError(f"{arg} is not a Jupyter notebook (.ipynb)")


def main(argv=None) -> None:
    """Parse `argv` and run the command. A `UsageError` (or a backend that cannot run
    here) from any command ends as one line on stderr and exit status 2; every other
    exception is a bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m colossal_lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("env", help="device, peak FLOP/s and measured ceilings")
    e.add_argument("--no-measure", action="store_true", help="skip the ceiling measurements")
    e.add_argument("--save", action="store_true", help="save results/<gpu>/env.json")

    t = sub.add_parser("train", help="train a preset with any switches; checkpoints, "
                       "exact resume, Hugging Face export")
    cli_train.add_arguments(t)

    b = sub.add_parser("bench", help="run a GPU benchmark and save its results",
                       add_help=False)
    b.add_argument("name", nargs="?", metavar="NAME", help="the benchmark to run")

    d = sub.add_parser("doctor", help="the tutorial's tuning checklist, run on a configuration")
    doctor.add_arguments(d)

    x = sub.add_parser("execute", help="execute notebooks in place (refresh their outputs)",
                       add_help=False)
    w = sub.add_parser("wheelhouse", help="download wheels for an offline GPU node",
                       add_help=False)

    a, rest = p.parse_known_args(argv)
    parser = {"env": e, "train": t, "bench": b, "doctor": d, "execute": x,
              "wheelhouse": w}[a.cmd]
    try:
        dispatch(a, rest, p, parser, argv)
    except (UsageError, BackendUnavailable) as exc:  # one line, not the usage again
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def dispatch(a, rest: list[str], p, parser, argv: list[str]) -> None:
    """Run command `a.cmd` (`parser` its subparser, for its `error`)."""
    if a.cmd == "bench":
        return cmd_bench(a, rest, parser.error)
    if a.cmd == "execute":
        if not {"-h", "--help"} & set(rest):
            check_notebooks(rest)
        return notebook.main(rest)
    if a.cmd == "wheelhouse":
        return wheelhouse.main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.cmd == "train":
        return cli_train.run(a, argv)
    if a.cmd == "doctor":
        return doctor.run(a, parser.error)
    if a.save and a.no_measure:
        raise UsageError("--save records the measured ceilings: drop --no-measure")
    cmd_env(a)


if __name__ == "__main__":
    main()
