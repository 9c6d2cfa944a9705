"""Prepare an offline wheelhouse for a GPU node that cannot reach the internet.

Real clusters are often offline. On a connected machine, `python -m colossal_lab
wheelhouse` downloads binary wheels for the *node's* Python and platform (not this
machine's) of what the book needs beyond a CUDA PyTorch image: the Jupyter kernel stack
to execute notebooks, Liger-Kernel (a provider in the benchmarks),
HolisticTraceAnalysis with what it imports (chapter 09's trace analysis) and torchao
(chapter 10's float8 peer, `hf-torchao-fp8`). Copy the folder over, then on the node
install into the Python that holds its CUDA torch; pip resolves against what is
installed and adds only what is missing:

    python -m pip install --no-index --find-links .whl \
        nbclient nbformat ipykernel ipywidgets pandas plotly pyyaml psutil liger-kernel
    python -m pip install --no-index --find-links .whl --no-deps HolisticTraceAnalysis \
        torchao==0.17.0

(HolisticTraceAnalysis declares jupyterlab and pytest as dependencies; it imports
neither, so it goes in without them. torchao is pinned to the release of torch 2.11's
cycle (March 2026), the reference node's torch: its compiled extensions are built for
one torch and 0.17.0 loads them only on torch >= 2.11; float8 training itself is
Python over `torch._scaled_mm`.)

torch, triton and the CUDA libraries are never downloaded: the node's image has them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from colossal_lab.errors import UsageError

# Executing notebooks (nbclient + a kernel), with their whole dependency trees.
NOTEBOOK_PACKAGES = ["nbclient", "nbformat", "ipykernel", "ipywidgets"]
# What HolisticTraceAnalysis imports (chapter 09, `colossal_lab.measure.profile`), with their deps.
ANALYSIS_PACKAGES = ["pandas", "plotly", "pyyaml", "psutil"]
# torchao for the node's torch 2.11 (0.17.0: its release cycle; see the docstring).
TORCHAO = "torchao==0.17.0"
# Pulled without dependencies: their own needs (torch, triton, transformers) are on the node.
NO_DEPS_PACKAGES = ["liger-kernel", "HolisticTraceAnalysis", TORCHAO]
# Never worth carrying: the node's image has them, and several are gigabytes. Matched
# against a wheel's distribution name, not a prefix of its file name: "torch" must not
# take "torchao" with it.
SKIP_NAMES = frozenset({"torch", "triton", "numpy", "setuptools", "pip", "wheel"})
SKIP_PREFIXES = ("nvidia_",)  # nvidia-cublas-cu12, nvidia-cudnn-cu12, ...
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def _pip_download(dest: Path, python: str, packages: list[str], no_deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    if no_deps:
        cmd.append("--no-deps")
    if subprocess.run(cmd + packages).returncode:  # pip has said why, above
        raise UsageError(f"pip download failed for {' '.join(packages)} (is the index "
                         f"reachable, and do wheels exist for Python {python}?)")


def skipped(wheel_name: str) -> bool:
    """Whether a wheel file is one the node's image already has (`SKIP_NAMES`, the
    CUDA libraries): its distribution name is what precedes the first "-"."""
    dist = wheel_name.split("-", 1)[0].lower()
    return dist in SKIP_NAMES or dist.startswith(SKIP_PREFIXES)


def build(dest: str | Path = ".whl", python: str = "3.12", extra: list[str] | None = None
          ) -> list[Path]:
    """Download the wheels into `dest`; returns the wheels kept."""
    dest = Path(dest)
    if not re.fullmatch(r"3\.\d+", python):
        raise UsageError(f"--python {python!r}: give the node's version as 3.N (e.g. 3.12)")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--dest {dest} cannot be created: {e.strerror or e}") from None
    if not os.access(dest, os.W_OK):
        raise UsageError(f"--dest {dest} cannot be written")
    _pip_download(dest, python, NOTEBOOK_PACKAGES + ANALYSIS_PACKAGES, no_deps=False)
    _pip_download(dest, python, NO_DEPS_PACKAGES + list(extra or []), no_deps=True)
    kept = []
    for whl in sorted(dest.glob("*.whl")):
        if skipped(whl.name):
            whl.unlink()
        else:
            kept.append(whl)
    return kept


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Download wheels for an offline GPU node.")
    p.add_argument("--dest", default=".whl", help="folder for the wheels (default .whl)")
    p.add_argument("--python", default="3.12", help="the node's Python version")
    p.add_argument("--extra", nargs="*", default=[], help="more packages, without deps")
    a = p.parse_args(argv)
    kept = build(a.dest, a.python, a.extra)
    size = sum(w.stat().st_size for w in kept) / 2**20
    print(f"{len(kept)} wheels, {size:.1f} MiB in {a.dest}")
    wanted = " ".join(NOTEBOOK_PACKAGES + ANALYSIS_PACKAGES + NO_DEPS_PACKAGES[:1])
    bare = " ".join(NO_DEPS_PACKAGES[1:] + list(a.extra))
    print(f"on the node: python -m pip install --no-index --find-links {a.dest} {wanted}")
    print(f"        and: python -m pip install --no-index --find-links {a.dest} --no-deps "
          f"{bare}")


if __name__ == "__main__":
    main()
