"""The probes under notes/ are scripts a later session runs on the GPU, where a script
that does not compile costs a device call. Each one must compile (Python's own compiler,
which catches what a linter's parser does not, e.g. a name used before its `global`
statement) and answer `--help` without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NOTES = Path(__file__).resolve().parent.parent / "notes"
PROBES = sorted(NOTES.glob("*.py"))


def test_there_are_probes():
    assert len(PROBES) >= 5, PROBES


@pytest.mark.parametrize("path", PROBES, ids=lambda p: p.name)
def test_probe_compiles(path):
    compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize("path", [p for p in PROBES if "argparse" in p.read_text()],
                         ids=lambda p: p.name)
def test_probe_help_runs_without_a_gpu(path):
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=NOTES.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
