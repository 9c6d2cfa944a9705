"""Helpers for the book's notebooks: show library code, print tables, execute notebooks.

Notebooks never copy library code: `show_source(obj)` displays the real thing, so the
book and the library cannot drift apart; its output records what it showed, and
`integrity.check_notebook` fails when a committed output no longer matches the library.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import time
from pathlib import Path

from colossal_lab.benchmarks.two_gpu import format_targets
from colossal_lab.measure import results
from colossal_lab.measure.results import error_line

# A CPU build of torch cannot load torchao's compiled extensions, and torchao (imported by
# `transformers` when installed) says so on import, as does torch's pytree registry:
# noise about the machine in a chapter's output, not a result.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

SOURCE_KEY = "colossal_lab"
"""Output metadata key under which `show_source` records what it showed:
``{"colossal_lab": {"source_of": "module:qualname", "lines": [a, b] or None}}``.
`integrity.check_notebook` compares that output with the library's source today."""


def unwrap(obj):
    """The Python function behind a Triton kernel (`@triton.jit`, `@autotune`, ...)."""
    obj = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps the Python function
    while hasattr(obj, "fn") and not inspect.isfunction(obj):
        obj = obj.fn  # @triton.autotune / @triton.heuristics wrap the jit function
    return obj


def source_text(obj, lines: tuple[int, int] | None = None) -> str:
    """The source `show_source(obj, lines)` shows: lines `[a, b)` of it when given."""
    src = inspect.getsource(unwrap(obj))
    if lines:
        src = "\n".join(src.splitlines()[lines[0]:lines[1]])
    return src


def qualified_name(obj) -> str:
    """``module:qualname`` of `obj` (a Triton kernel: of its Python function)."""
    obj = unwrap(obj)
    return f"{obj.__module__}:{obj.__qualname__}"


class SourceDisplay:
    """What `show_source` returns: the source highlighted as IPython's `Code` shows it
    (HTML, LaTeX), the plain source as ``text/plain``, and metadata naming what was
    shown (`SOURCE_KEY`), so a test can later check the output is still current."""

    def __init__(self, source: str, source_of: str, lines=None):
        self.data = self.source = source
        self.source_of = source_of
        self.lines = list(lines) if lines else None

    def __repr__(self) -> str:
        return self.source

    def _repr_mimebundle_(self, include=None, exclude=None):
        from IPython.display import Code

        code = Code(self.source, language="python")
        data = {"text/plain": self.source, "text/html": code._repr_html_(),
                "text/latex": code._repr_latex_()}
        return data, {SOURCE_KEY: {"source_of": self.source_of, "lines": self.lines}}


def show_source(obj, lines: tuple[int, int] | None = None) -> SourceDisplay:
    """Display the source of a library function, class or Triton kernel (lines
    `[a, b)` of it when `lines` is given), recording what it showed."""
    return SourceDisplay(source_text(obj, lines), qualified_name(obj), lines)


def _fmt(v, spec: str | None) -> str:
    if v is None:
        return "–"
    if spec and isinstance(v, (int, float)):
        return format(v, spec)
    return str(v).replace("|", "\\|")  # a pipe inside a cell would end the cell


def table(rows: list[dict], columns: dict[str, str | None], *, headers: dict | None = None):
    """A Markdown table of `rows`; `columns` maps a row key to a format spec
    (e.g. {"setup": None, "tokens_per_s": ",.0f", "mfu": ".1%"}). The book renders it as
    a table (`nb_render_markdown_format: myst`); a `|` inside a value is escaped."""
    from IPython.display import Markdown

    headers = headers or {}
    head = [headers.get(c, c) for c in columns]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [_fmt(r.get(c), spec) for c, spec in columns.items()]
        if "error" in r:  # keep what was measured; say what failed
            why = _fmt(error_line(r["error"])[:60], None)
            cells[-1] = f"{cells[-1] if cells[-1] != '–' else ''} failed: {why}"
        out.append("| " + " | ".join(cells) + " |")
    return Markdown("\n".join(out))


def show_multi_gpu(name: str, what: str, columns: dict[str, str | None], *,
                   select=None, headers: dict | None = None, targets=None,
                   plot=None, gpus: str = "2 or 4") -> list:
    """Every multi-GPU run of benchmark `name` on record (`results.load_multi_gpu`: two
    GPUs, then four), each with its banner, its rows (those `select` keeps) as a
    `table` of `columns`, with `plot(rows)` a figure, and with `targets(rows)` (the
    benchmark's own verdicts over every row of the file) the benchmark's targets, met or
    not (`two_gpu.format_targets`). Without a run on record: one line saying so and the
    command that measures it (on `gpus` GPUs). Returns the runs."""
    from IPython.display import display

    runs = results.load_multi_gpu(name)
    if not runs:
        print(f"{what}: not yet measured on several GPUs (torchrun --nproc-per-node "
              f"{gpus} -m colossal_lab bench {name}).")
    for res in runs:
        print(res.banner())
        rows = [r for r in res.rows if select is None or select(r)]
        display(table(rows, columns, headers=headers))
        if plot is not None:
            display(plot(rows))
        if targets is not None:
            print(format_targets(targets(res.rows)))  # the world its rows record
    return runs


def execute(paths: list[str | Path], timeout: int = 1800, kernel: str = "python3") -> None:
    """Execute notebooks in place (each in its own folder), keeping their outputs: how
    the committed notebooks are refreshed on a GPU node."""
    import nbformat
    from nbclient import NotebookClient

    # A package installed without its bytecode (a GPU node's wheels, pip --no-compile)
    # is compiled on first import, and Python 3.12 warns there about invalid escapes in
    # its docstrings: noise on stderr, with a local path, in a committed output. The
    # kernel inherits this environment.
    os.environ["PYTHONWARNINGS"] = ",".join(
        w for w in (os.environ.get("PYTHONWARNINGS"), "ignore::SyntaxWarning") if w)
    for p in map(Path, paths):
        nb = nbformat.read(p, as_version=4)
        t0 = time.perf_counter()
        print(f"executing {p} ...", flush=True)
        client = NotebookClient(nb, timeout=timeout, kernel_name=kernel,
                                resources={"metadata": {"path": str(p.parent)}})
        try:
            client.execute()
        finally:
            nbformat.write(nb, p)  # keep what ran, even on failure: nothing lost
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None) -> None:
    """`python -m colossal_lab execute NOTEBOOK...`: execute them in place."""
    ap = argparse.ArgumentParser(description="Execute notebooks in place.")
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    a = ap.parse_args(argv)
    execute(a.paths, a.timeout)


if __name__ == "__main__":
    main()
