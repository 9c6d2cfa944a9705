"""Helpers for the book's notebooks: show library code, print tables, execute notebooks.

Notebooks never copy library code: `show_source(obj)` displays the real thing, so the
book and the library cannot drift apart; its output records what it showed, and
`integrity.check_notebook` fails when a committed output no longer matches the library.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
import re
import time
from pathlib import Path

from colossal_lab.benchmarks.two_gpu import format_targets
from colossal_lab.book.provenance import anchor
from colossal_lab.measure import results

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


MISSING = "—"
"""What a table shows for a value that was not measured (a footnote says why)."""
MARKS = "¹²³⁴⁵⁶⁷⁸⁹"
"""Footnote marks of a table's failed rows, in order."""


def _fmt(v, spec: str | None) -> str:
    if v is None:
        return MISSING
    if spec and isinstance(v, (int, float)):
        return format(v, spec)
    return str(v).replace("|", "\\|")  # a pipe inside a cell would end the cell


def failure_note(row: dict) -> str:
    """Why `row` has no numbers, in plain English, for a table's footnote: never the
    exception text (which the results file keeps). "out of memory at batch 3",
    "flash-attn is not installed on this node", ..."""
    error = str(row.get("error", ""))
    low = error.lower()
    who = row.get("provider") or row.get("setup") or row.get("case") or "this setup"
    if "out of memory" in low or "outofmemory" in low:
        at = f" at batch {row['batch']}" if row.get("batch") is not None else ""
        return f"{who}: out of memory{at} on this GPU"
    if "not installed" in low or "no module named" in low or "importerror" in low:
        module = re.search(r"No module named '([^'.]+)", error)
        return f"{module.group(1) if module else who} is not installed on this node"
    if "donated buffers" in low or "compiled with" in low:
        return (f"{who}: its compiled backward cannot be replayed in a CUDA graph, so "
                f"this timing was not taken")
    if "capture" in low:
        return f"{who}: could not be captured in a CUDA graph, so it was not timed"
    if "skip" in low:
        return f"{who}: skipped on this node"
    return f"{who}: did not run on this node (the results file keeps the error)"


def table(rows: list[dict], columns: dict[str, str | None], *, headers: dict | None = None):
    """A Markdown table of `rows`; `columns` maps a row key to a format spec
    (e.g. {"setup": None, "tokens_per_s": ",.0f", "mfu": ".1%"}). The book renders it as
    a table (`nb_render_markdown_format: myst`); a `|` inside a value or a header is
    escaped. A value not measured shows as "—"; a row with an `error` shows "—" with a
    footnote mark, and the footnote under the table says in words why
    (`failure_note`), never the exception."""
    from IPython.display import Markdown

    headers = headers or {}
    head = [_fmt(headers.get(c, c), None) for c in columns]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(columns)]
    notes: dict[str, str] = {}
    for r in rows:
        cells = [_fmt(r.get(c), spec) for c, spec in columns.items()]
        if "error" in r:  # keep what was measured; mark what failed
            note = failure_note(r)
            mark = notes.setdefault(note, MARKS[min(len(notes), len(MARKS) - 1)])
            cells[-1] = f"{cells[-1]} {mark}" if cells[-1] != MISSING else MISSING + mark
        out.append("| " + " | ".join(cells) + " |")
    if notes:
        out += [""] + [f"{mark} {note}.  " for note, mark in notes.items()]
    return Markdown("\n".join(out))


def glue_values(**values) -> None:
    """Glue each measured value under its name for the chapter's prose, where
    ``{glue:text}`name:.1%``` prints it: prose numbers are computed, never typed. Shown
    nowhere else (myst-nb `glue`, ``display=False``)."""
    from myst_nb import glue

    for name, value in values.items():
        glue(name, value, display=False)


def timing_words(timing: str | None) -> str | None:
    """A row's `timing` field in words for a table: "graph replay", "events", or
    "events (graph capture failed)"; None stays None."""
    if timing is None:
        return None
    t = str(timing)
    if "capture failed" in t or "/events" in t:
        return "events (graph capture failed)"
    return {"cuda_graph": "graph replay", "events": "events"}.get(t, t.split(":")[0])


# ------------------------------------------------------------------ captions


class Caption:
    """One line under a figure or table: the GPU and the results file its numbers come
    from, linked to the file's entry in the Measurements appendix (`provenance`). The
    output's metadata records the file's commit and date (`SOURCE_KEY`), which
    `integrity.check_notebook` compares with the file: the page shows no hash, the
    notebook still knows which run it showed."""

    def __init__(self, res):
        p = res.provenance
        self.file = res._file_label()
        self.gpu = f"{p.get('gpu_count', 1)} × {p.get('gpu')}" \
            if (p.get("gpu_count") or 1) > 1 else str(p.get("gpu"))
        self.how = "Measured live on" if getattr(res, "live", False) else "Measured on"
        self.meta = {"results": self.file, "git_sha": str(p.get("git_sha") or "?"),
                     "date": str(p.get("date") or "?")}

    @property
    def text(self) -> str:
        return f"{self.how} {self.gpu} · {self.file}"

    def __repr__(self) -> str:
        return self.text

    def _repr_mimebundle_(self, include=None, exclude=None):
        href = f"measurements.html#{anchor(self.file)}"
        html = (f'<p class="results-caption">{self.how} {self.gpu} · '
                f'<a href="{href}">{self.file}</a></p>')
        return {"text/plain": self.text, "text/html": html}, {SOURCE_KEY: self.meta}


class Captions:
    """One caption line for several results files (a page that reads many): the GPU(s),
    then each file linked to its Measurements entry; the metadata records each file's
    commit and date as `Caption` does, under ``"captions"``."""

    def __init__(self, many):
        self.items = list(dict((c.file, c) for c in (Caption(r) for r in many)).values())

    @property
    def text(self) -> str:
        gpus = " / ".join(dict.fromkeys(c.gpu for c in self.items))
        return f"Measured on {gpus} · " + ", ".join(c.file for c in self.items)

    def __repr__(self) -> str:
        return self.text

    def _repr_mimebundle_(self, include=None, exclude=None):
        gpus = " / ".join(dict.fromkeys(c.gpu for c in self.items))
        files = ", ".join(f'<a href="measurements.html#{anchor(c.file)}">{c.file}</a>'
                          for c in self.items)
        html = f'<p class="results-caption">Measured on {gpus} · {files}</p>'
        return ({"text/plain": self.text, "text/html": html},
                {SOURCE_KEY: {"captions": [c.meta for c in self.items]}})


def caption(res) -> Caption:
    """The caption line of a loaded `results.Results` (display it, or leave it last)."""
    return Caption(res)


def show_caption(res) -> None:
    """Display `res`'s caption: what `results.measure_or_load` does in the book."""
    from IPython.display import display

    display(Caption(res))


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


if _in_kernel():  # a notebook: measure_or_load shows a caption there, not a banner
    results.announce = show_caption


# ------------------------------------------------------------------ figure alt text


def figure_alt(fig) -> str:
    """What a figure shows, for its alt text: its title (or its panels' titles) and the
    axes' labels, e.g. "MFU per switch on NVIDIA H200 (MFU (6N) against setup)"."""
    titles = []
    if getattr(fig, "_suptitle", None) is not None and fig._suptitle.get_text():
        titles.append(fig._suptitle.get_text())
    axes = [ax for ax in fig.get_axes() if ax.get_visible()]
    for ax in axes:
        t = " ".join(x for x in (ax.get_title("left"), ax.get_title(),
                                 ax.get_title("right")) if x)
        if t and t not in titles:
            titles.append(t)
    labels = ""
    if axes:
        y, x = axes[0].get_ylabel(), axes[0].get_xlabel()
        if y and x:
            labels = f" ({y} against {x})"
        elif y or x:
            labels = f" ({y or x})"
    text = "; ".join(t.replace("\n", " ") for t in titles) or "Figure"
    return f"Figure: {text}{labels}"[:400]


def _with_alt(print_figure):
    """`IPython.core.pylabtools.print_figure`, writing the figure's alt text into the
    PNG (tEXt "Description"); the book's Sphinx extension makes it the image's alt."""
    if getattr(print_figure, "_alt", False):
        return print_figure

    @functools.wraps(print_figure)
    def wrapped(fig, fmt="png", bbox_inches="tight", base64=False, **kwargs):
        if fmt in ("png", "retina"):
            kwargs.setdefault("metadata", {"Description": figure_alt(fig)})
        return print_figure(fig, fmt, bbox_inches, base64, **kwargs)

    wrapped._alt = True
    return wrapped


def install_figure_alt() -> None:
    """Make every inline matplotlib figure carry its alt text (`figure_alt`), whether
    `%matplotlib inline` ran before this import or runs after it."""
    try:
        from IPython import get_ipython
        from IPython.core import pylabtools
        from matplotlib.figure import Figure
    except ImportError:
        return
    pylabtools.print_figure = _with_alt(pylabtools.print_figure)
    shell = get_ipython()
    if shell is None:
        return
    png = shell.display_formatter.formatters["image/png"]
    try:
        current = png.lookup_by_type(Figure)
    except KeyError:
        return
    if isinstance(current, functools.partial) and not getattr(current.func, "_alt", False):
        png.for_type(Figure, functools.partial(_with_alt(current.func), *current.args,
                                               **current.keywords))


install_figure_alt()


def show_multi_gpu(name: str, what: str, columns: dict[str, str | None], *,
                   select=None, headers: dict | None = None, targets=None,
                   plot=None, gpus: str = "2 or 4") -> list:
    """Every multi-GPU run of benchmark `name` on record (`results.load_multi_gpu`: two
    GPUs, then four), each with its caption, its rows (those `select` keeps) as a
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
        display(Caption(res))
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
