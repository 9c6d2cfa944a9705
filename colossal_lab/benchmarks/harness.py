"""The benchmarks' one command line: flags, saving with provenance, resuming, planning.

A benchmark module states what it measures as a `Benchmark` named `BENCH`: its name,
its own flags as data (`opt`, or `flag` for the shared ones in `COMMON`), how to run
from the parsed flags and what configuration to record. `main(BENCH, argv)` parses,
runs, and saves `results/<gpu>/<name>.json` through `results.save_results`; a
benchmark with a flow of its own (several files, torchrun ranks, a resumable sweep)
gives `execute`, which gets the parsed `Invocation`.

    BENCH = Benchmark(
        "rope", __doc__, options=[opt("--seq", nargs="*", type=int), flag("name")],
        run=lambda a: run(a.quick, seqs=a.seq), config=lambda a: config_of())
    main = BENCH.main

Long sweeps are cut into invocations of bounded time by `pack`, from a benchmark's
own cost estimate.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from colossal_lab.errors import UsageError
from colossal_lab.measure import hardware, results

SUPPRESS = argparse.SUPPRESS
"""A flag's help that hides it (a child process's flags)."""

Option = tuple[tuple[str, ...], dict]
"""One flag: the names argparse's `add_argument` takes, and its keyword arguments."""


def opt(*flags: str, **kw) -> Option:
    """A flag, declared as data: `opt("--seq", nargs="*", type=int)`."""
    return flags, kw


COMMON: dict[str, Option] = {
    "name": opt("--name", help="results file name (keep partial runs apart)"),
    "resume": opt("--resume", action="store_true",
                  help="keep the results file's rows and measure only what it lacks "
                       "(rows with an error run again)"),
    "redo": opt("--redo", action="store_true",
                help="with --resume: measure the selected cases again, replacing their "
                     "rows"),
    "dry_run": opt("--dry-run", action="store_true",
                   help="print the cases and an estimate of their time; run nothing"),
    "rounds": opt("--rounds", type=int, default=1,
                  help="time each case's providers this many times, in turns (order "
                       "rotated each round), and keep each row's median (default 1)"),
    "iters": opt("--iters", type=int, default=None, help="timed steps"),
    "reps": opt("--reps", type=int, default=None, help="timed repetitions"),
    "providers": opt("--providers", nargs="*"),
    "preset": opt("--preset", default="llama-7b-8l"),
    "seq_len": opt("--seq-len", type=int, default=4096),
    "batch": opt("--batch", type=int, default=4),
}
"""Flags several benchmarks share, by name; a benchmark takes one with `flag`."""


def flag(name: str, **override) -> Option:
    """The shared flag `COMMON[name]`, with keyword arguments replaced by `override`
    (a default, choices, a help text that says what the flag means here)."""
    flags, kw = COMMON[name]
    return flags, {**kw, **override}


def _no_config(args: argparse.Namespace) -> dict:
    return {}


@dataclass(frozen=True)
class Benchmark:
    """What one benchmark module declares; the harness does the rest."""

    name: str
    """`bench NAME` on the command line, and the default results file name."""
    doc: str
    """The module's docstring: its first line describes the command."""
    run: Callable[[argparse.Namespace], list[dict]] | None = None
    """Rows from the parsed flags (`--quick` included): the default flow."""
    options: Sequence[Option] = ()
    """The benchmark's own flags (`opt`, `flag`); `--quick` every benchmark has."""
    config: Callable[[argparse.Namespace], dict] = _no_config
    """The configuration recorded next to the rows."""
    quick_help: str = "tiny shapes on the CPU, not saved"
    """What `--quick` does here."""
    file_name: Callable[[argparse.Namespace], str] | None = None
    """The results file's name from the flags (default `--name`, else `name`)."""
    check: Callable[[argparse.Namespace], str | None] | None = None
    """A usage error for flags that do not go together (None: they do)."""
    summary: Callable[[list[dict]], str] | None = None
    """The lines printed after a measured run is saved."""
    execute: Callable[[Invocation], None] | None = None
    """A flow of the benchmark's own, instead of run, then save."""
    prog: str | None = None
    """The program's name in usage lines (default argparse's)."""
    description: str | None = None
    """The usage line's text (default the docstring's first line)."""

    def parser(self) -> argparse.ArgumentParser:
        p = _Parser(prog=self.prog,
                                    description=self.description
                                    or self.doc.strip().splitlines()[0])
        p.add_argument("--quick", action="store_true", help=self.quick_help)
        for flags, kw in self.options:
            p.add_argument(*flags, **kw)
        return p

    def main(self, argv: Sequence[str] | None = None) -> None:
        main(self, argv)


@dataclass
class Invocation:
    """One parsed command line of a benchmark."""

    bench: Benchmark
    args: argparse.Namespace
    argv: list[str]
    parser: argparse.ArgumentParser = field(repr=False)

    def error(self, message: str):
        """A usage error: one line and exit status 2 (`main`)."""
        raise UsageError(message)

    @property
    def command(self) -> str:
        """The command line, as the results file's provenance records it."""
        return " ".join([f"python -m colossal_lab bench {self.bench.name}",
                         shlex.join(self.argv)]).strip()

    @property
    def file_name(self) -> str:
        if self.bench.file_name is not None:
            return self.bench.file_name(self.args)
        return getattr(self.args, "name", None) or self.bench.name

    def save(self, rows: list[dict], *, name: str | None = None,
             config: dict | None = None, command: str | None = None,
             gpu: str | None = None, quiet: bool = False) -> Path:
        """`results/<gpu>/<name>.json` with provenance (`results.save_results`)."""
        path = results.save_results(
            name or self.file_name, rows,
            config=self.bench.config(self.args) if config is None else config,
            command=command or self.command, gpu=gpu)
        if not quiet:
            print(f"saved {path}")
        return path

    def resume(self, config: dict, *, name: str | None = None, gpu: str | None = None,
               missing_ok: bool = False, **keep) -> tuple[list[dict], dict]:
        """(rows kept, config) of `--resume`: the saved file's finished rows, checked
        against `config` (`results.resumed_rows`, whose keywords `keep` passes on).
        `missing_ok`: no saved file is a first chunk (nothing kept), not an error."""
        name = name or self.file_name
        try:
            recorded = results.load_results(name, gpu=gpu or hardware.detect().slug)
        except FileNotFoundError:
            if missing_ok:
                return [], config
            recorded = None
        return results.resumed_rows(name, recorded, config, self.error,
                                    what="results file", **keep)


def parse(bench: Benchmark, argv: Sequence[str] | None = None) -> Invocation:
    """The `Invocation` of `argv` (default the process's), its flags checked."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = bench.parser()
    call = Invocation(bench, p.parse_args(argv), argv, p)
    problem = bench.check(call.args) if bench.check else None
    if problem:
        call.error(problem)
    return call


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are `UsageError`s: one line, not the usage again."""

    def error(self, message: str):
        raise UsageError(message)


def main(bench: Benchmark, argv: Sequence[str] | None = None) -> None:
    """Run `bench` from the command line `argv`: its own flow (`execute`), or run and,
    unless `--quick`, save with provenance and print the summary. Bad input (a
    `UsageError`, from the flags or from the benchmark) ends in one line on stderr and
    exit status 2; anything else is a bug and keeps its traceback."""
    try:
        _main(bench, argv)
    except UsageError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"python -m colossal_lab bench: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(bench: Benchmark, argv: Sequence[str] | None = None) -> None:
    call = parse(bench, argv)
    if bench.execute is not None:
        bench.execute(call)
        return
    rows = bench.run(call.args)
    if call.args.quick:
        return
    call.save(rows)
    if bench.summary is not None:
        print(bench.summary(rows))


def counted(name: str, doc: str, run: Callable, config: Callable[[int], dict], *,
            count: str, default: int, what: str, **kw) -> Benchmark:
    """A benchmark whose one flag is how many times it times (`count`: "reps" or
    "iters", `default` when not given): `run(quick, <count>=n)`, `config(n)`."""
    return Benchmark(
        name, doc, options=[flag(count, help=f"{what} (default {default})")],
        run=lambda a: run(a.quick, **{count: getattr(a, count)}),
        config=lambda a: config(getattr(a, count) or default), **kw)


def at_least(n: int, what: str = "steps") -> Callable[[argparse.Namespace], str]:
    """A `check` for `--iters`: a measured run times at least `n`."""

    def check(a: argparse.Namespace) -> str | None:
        if not a.quick and a.iters is not None and a.iters < n:
            return f"--iters {a.iters}: time at least {n} {what}, or p10-p90 means nothing"
        return None

    return check


def whole_at_least(n: int) -> Callable[[str], int]:
    """A flag's type: a whole number >= `n`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < n:
            raise argparse.ArgumentTypeError(f"{value} < {n}: give {n} or more")
        return value

    return parse


def share(text: str) -> float:
    """A flag's type: a share in [0, 1] (of the layers to recompute, say)."""
    value = float(text)
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"{text} is not a share in [0, 1]")
    return value


# ---------------------------------------------------------------------- progress lines


def row_line(head: str, row: dict, figure: Callable[[dict], str], width: int = 90) -> str:
    """`head` and the row's `figure`, or that it failed and why (`width` characters)."""
    if "error" in row:
        return f"{head} failed: {row['error'][:width]}"
    return head + figure(row)


def case_line(head: str, case: list[dict], cell: Callable[[dict], str]) -> str:
    """`head`, then each provider's `cell` of one case, or that it failed."""
    return head + ", ".join(f"{r['provider']} failed: {r['error'][:60]}" if "error" in r
                            else cell(r) for r in case)


# ------------------------------------------------------------------------- planning


def pack(items: Sequence, cost: Callable[[list], float], budget_s: float) -> list[list]:
    """`items`, in order, cut into chunks whose `cost` fits `budget_s` where it can: a
    chunk grows while the next item still fits; an item over budget alone is a chunk
    of its own (the caller may split it finer). `cost` takes a chunk, so what a chunk
    pays once (a process start, a compilation) is counted once."""
    chunks: list[list] = []
    cur: list = []
    for item in items:
        if cur and cost([*cur, item]) > budget_s:
            chunks.append(cur)
            cur = []
        cur.append(item)
    return chunks + ([cur] if cur else [])


def then_resume(i: int, resume_first: bool = False) -> str:
    """" --resume" for every chunk but a fresh run's first: later chunks append."""
    return " --resume" if i or resume_first else ""
