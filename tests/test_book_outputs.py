"""What the committed notebook outputs may contain, as the rendered book shows them:
no stderr noise, no local paths, no redrawn progress bars, no widget without a static
stand-in, listings without their `show_source(...)` call. (Long lines wrap in the page,
`_static/custom.css`; the browser test checks that nothing scrolls sideways.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
LOCAL_PATH = re.compile(r"(/work/|/opt/|/home/|/root/|/tmp/|site-packages|\.venv/)")
SHOW_SOURCE_ONLY = re.compile(r"^\s*show_source\(.*\)\s*$")
WIDGET = "application/vnd.jupyter.widget-view+json"


def _cells(path: Path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _text(output: dict) -> str:
    if "text" in output:
        return "".join(output["text"])
    return "".join("".join(v) if isinstance(v, list) else str(v)
                   for k, v in output.get("data", {}).items() if k.startswith("text/"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stderr_no_paths_no_carriage_returns(path):
    bad = []
    for i, cell in enumerate(_cells(path)):
        for out in cell.get("outputs", []):
            text = _text(out)
            if out.get("name") == "stderr":
                bad.append(f"cell {i}: stderr {text[:100]!r}")
            if LOCAL_PATH.search(text):
                bad.append(f"cell {i}: local path {LOCAL_PATH.search(text).group(0)!r}")
            if "\r" in text:
                bad.append(f"cell {i}: carriage return (a redrawn bar) {text[:60]!r}")
            if out.get("output_type") == "error":
                bad.append(f"cell {i}: error {out.get('ename')}")
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_listings_hide_their_call(path):
    """A cell that only shows library source shows the listing, not the call."""
    missing = []
    for i, cell in enumerate(_cells(path)):
        lines = [x for x in "".join(cell["source"]).splitlines()
                 if x.strip() and not x.strip().startswith("#")]
        if lines and all(SHOW_SOURCE_ONLY.match(x) for x in lines):
            tags = cell["metadata"].get("tags", [])
            if "remove-input" not in tags:
                missing.append(f"cell {i}: {lines[0].strip()}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_widgets_have_a_static_stand_in(path):
    """A widget renders only in a live kernel: its cell is removed from the book
    (`remove-cell` or `remove-output`), and a static figure stands in for it."""
    bad = []
    for i, cell in enumerate(_cells(path)):
        tags = cell["metadata"].get("tags", [])
        if any(WIDGET in out.get("data", {}) for out in cell.get("outputs", [])) and not (
                {"remove-cell", "remove-output"} & set(tags)):
            bad.append(f"cell {i}")
    assert not bad, f"widget outputs shown in the book: {bad}"
