"""The package's shape, checked: layers that import only downward, few and explained lazy
imports, small modules, and docstrings that teach rather than narrate.

The layers themselves are declared once, as `import-linter` contracts in pyproject.toml;
`test_imports.py` finds import cycles.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from importlinter import cli as import_linter

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "colossal_lab"
SOURCES = sorted(PKG.rglob("*.py"))

MAX_LINES = 600
LONG_KERNELS = {
    # one kernel family per file: the forward, its launch plans and the autograd
    # Function read top to bottom, as the book shows them
    "colossal_lab/kernels/flash_attention.py",
    "colossal_lab/kernels/flash_attention_hopper.py",
    "colossal_lab/kernels/flash_attention_hopper_backward.py",
}
MAX_LAZY = 40
LAZY_REGISTRY = "colossal_lab/benchmarks/__init__.py"


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_import_linter_contracts_hold(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = import_linter.lint_imports(config_filename=str(ROOT / "pyproject.toml"),
                                      no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert "Contracts: " in out and " 0 broken" in out, out
    assert code == 0, out


def _function_level_imports(path: Path):
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "colossal_lab") or isinstance(node, ast.Import) and any(
                    a.name.startswith("colossal_lab") for a in node.names):
                yield node.lineno, lines[node.lineno - 1], lines[node.lineno - 2]


def test_few_lazy_imports_each_with_a_reason():
    found, unexplained = [], []
    for path in SOURCES:
        for lineno, line, above in _function_level_imports(path):
            found.append(f"{_rel(path)}:{lineno}")
            if "# lazy:" not in line and "# lazy:" not in above:
                unexplained.append(f"{_rel(path)}:{lineno}: {line.strip()}")
    assert len(found) <= MAX_LAZY, f"{len(found)} imports inside functions:\n" + \
        "\n".join(found)
    assert not unexplained, "an import inside a function needs `# lazy: <reason>`:\n" + \
        "\n".join(unexplained)


def test_no_dynamic_module_loading_but_the_benchmark_registry():
    offenders = []
    for path in SOURCES:
        text = path.read_text()
        if _rel(path) == LAZY_REGISTRY:
            continue
        if re.search(r"^def __getattr__\(", text, re.M) or "import_module(" in text:
            offenders.append(_rel(path))
    assert offenders == []


def test_modules_are_small():
    long = {_rel(p): n for p in SOURCES
            if (n := len(p.read_text().splitlines())) > MAX_LINES
            and _rel(p) not in LONG_KERNELS}
    assert long == {}


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_module_docstring_opens_with_one_line_job(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{_rel(path)} has no module docstring"
    first = doc.splitlines()[0].rstrip()
    assert first.endswith((".", ":", "?")) and len(first) <= 100, \
        f"{_rel(path)}: the docstring's first line should name the module's job in one " \
        f"sentence of at most 100 characters: {first!r}"


DIARY = re.compile(
    r"(?i)\bissues?\s*#?\d+"                      # issue references
    r"|(?<![\w&/])#\d{2,3}\b"                       # "#14" (not "owner/repo#123")
    r"|\b20\d\d-\d\d-\d\d\b"                        # dates
    r"|\bnotes/\w"                                  # pointers into notes/
    r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")  # commit hashes
NOT_DIARY = re.compile(r"0x[0-9A-Fa-f]+|sha256|[0-9a-f]{32,}")
TIMING = re.compile(r"(?<![\w.])\d[\d,.]*\s*(?:ms|µs|us|TFLOP/s|GB/s)(?!\w)")


def test_library_keeps_no_diary():
    found = []
    for path in SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = DIARY.search(line)
            if m and not NOT_DIARY.search(line):
                found.append(f"{_rel(path)}:{i}: {m.group(0)!r} in {line.strip()[:80]}")
    assert found == [], "history belongs in notes/ and the results' provenance:\n" + \
        "\n".join(found)


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node, doc
    for body in (n.body for n in ast.walk(tree) if hasattr(n, "body")
                 and isinstance(n.body, list)):
        for a, b in zip(body, body[1:]):  # attribute docstrings
            if isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(b, ast.Expr) \
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                yield b, b.value.value


def test_docstrings_carry_no_measured_timings():
    found = []
    for path in SOURCES:
        for node, doc in _docstrings(ast.parse(path.read_text())):
            for m in TIMING.finditer(doc):
                found.append(f"{_rel(path)}:{getattr(node, 'lineno', 0)}: {m.group(0)!r}")
    assert found == [], "measured timings go stale; they belong in results files:\n" + \
        "\n".join(found)


def test_the_checks_can_fail():
    """Each pattern catches what it is for (a check that cannot fail checks nothing)."""
    for text in ("see issue #14", "(#21)", "since 2026-12-03", "notes/finale.md",
                 "measured at 6a00b6f"):
        assert DIARY.search(text), text
    for text in ("hpcaitech/ColossalAI#6260", "0x7f", "a 4096-wide tile"):
        assert not DIARY.search(text) or NOT_DIARY.search(text), text
    for text in ("took 9.19 ms", "at 550 TFLOP/s", "4248 GB/s", "12 µs"):
        assert TIMING.search(text), text
    assert not TIMING.search("the ms-scale p2p"), "a unit alone is not a timing"
