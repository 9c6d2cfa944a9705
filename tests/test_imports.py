"""The package's import graph has no cycles, and the kernels import nothing above them.

Read with `ast` from the source (every `import`, at module level or inside a function or
an `if TYPE_CHECKING:` block, and the modules a package's `_LAZY` table loads on first
attribute access), so a cycle that Python tolerates because one side imports
lazily still fails here: a lazy import hides a design knot, it does not untie it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "colossal_lab"
LEAVES = {"colossal_lab.fallback"}
"""Modules that import nothing from the package: anything may use them."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name imported from a package
    counts as that submodule when one exists, else as the package)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from package, up level - 1
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                  and any(getattr(t, "id", "") == "_LAZY" for t in node.targets)):
                targets = [v.value for v in node.value.values]  # name -> module, lazily
            for t in targets:
                if t.split(".")[0] == top and (dep := known(t)) and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_kernels_import_nothing_above_them():
    graph = import_graph()
    kernels = {m for m in graph if m.startswith("colossal_lab.kernels")}
    for m in sorted(kernels):
        above = graph[m] - kernels - LEAVES
        assert not above, f"{m} imports {sorted(above)}: kernels sit at the bottom"


def test_leaves_import_nothing_from_the_package():
    graph = import_graph()
    for leaf in LEAVES:
        assert graph[leaf] == set(), (leaf, graph[leaf])


def test_a_cycle_is_found(tmp_path):
    """The checker itself: a lazy import inside a function still closes a cycle."""
    pkg = tmp_path / "colossal_lab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from colossal_lab.sub import b\n")
    (pkg / "a.py").write_text("from colossal_lab.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from colossal_lab import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["colossal_lab.c"] == {"colossal_lab.a"}  # relative imports resolve
    assert cycles(graph) == [["colossal_lab.a", "colossal_lab.sub.b"]]
