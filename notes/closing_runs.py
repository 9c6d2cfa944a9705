"""The finale's closing measurements on one GPU, spread over as many device calls as it
takes: each call runs what is not yet measured at this commit, in order, and copies every
file into $OUT as soon as it is written. A working tool for notes/finale.md, not part of
the library.

    COLOSSAL_LAB_GIT_SHA=<HEAD> python notes/closing_runs.py --out $OUT --budget-s 560

Between calls, keep the files it brought back in the working tree WITHOUT committing them
(HEAD must stay the commit they were measured at, or the next call would measure them
again): `python notes/closing_runs.py --copy-back <files_at>` copies `<slug>/*.json` to
results/<slug>/ and `<slug>-partial/*.json` to results/<slug>/partial/ (a partial
`composed` continues with `--resume`). Commit them all once every step is done.

A step is done when results/<slug>/<name>.json records this commit (`provenance.git_sha`).
A step starts only if its estimate fits the time left, except a resumable one, which
starts whenever a few minutes are left and is stopped (its whole process group) before
the budget ends; what it saved in its partial file is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = (  # (results name, bench arguments, estimated seconds, resumable)
    ("composed", ["--pairs", "3"], 600, True),
    ("profile_breakdown", [], 330, False),  # all five setups: chapter 09 reads the naive ones
    ("optimizer", [], 120, False),
    ("step_floor", [], 300, False),
)
MIN_RESUMABLE_S = 150
"""The least time left in which a resumable step is still started (a setup or two)."""
MARGIN_S = 20
"""Stop a running step this long before the budget ends, to copy its files out."""


def recorded_sha(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["provenance"].get("git_sha")
    except (OSError, ValueError, KeyError):
        return None


def copy_out(out: Path, slug: str, name: str) -> None:
    for src, dst in ((ROOT / "results" / slug / f"{name}.json", out / slug),
                     (ROOT / "results" / slug / "partial" / f"{name}.json",
                      out / f"{slug}-partial")):
        if src.exists():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / src.name)


def copy_back(files_at: Path) -> list[Path]:
    """Here, after a call: every `<slug>/*.json` and `<slug>-partial/*.json` under
    `files_at` into results/<slug>/ and results/<slug>/partial/, for the slugs that
    results/ already has (a probe's folder is left alone); the paths written."""
    written = []
    for folder in sorted(p for p in files_at.iterdir() if p.is_dir()):
        slug, partial = (folder.name[:-len("-partial")], True) \
            if folder.name.endswith("-partial") else (folder.name, False)
        if not (ROOT / "results" / slug).is_dir():
            continue
        dst = ROOT / "results" / slug / ("partial" if partial else "")
        for src in sorted(folder.glob("*.json")):
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst / src.name)
            written.append(dst / src.name)
    return written


def run_step(argv: list[str], timeout_s: float) -> int:
    """Run `python -m colossal_lab bench ...` in its own process group; past
    `timeout_s`, stop the whole group (the benchmark's per-setup children too)."""
    proc = subprocess.Popen([sys.executable, "-m", "colossal_lab", "bench", *argv],
                            cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where the files are copied")
    p.add_argument("--copy-back", type=Path, metavar="FILES_AT",
                   help="here, after a call: copy the files it brought back into results/")
    p.add_argument("--budget-s", type=float, default=560, help="seconds this call may use")
    p.add_argument("--slug", default=None, help="results folder (default: this GPU's)")
    p.add_argument("--dry-run", action="store_true", help="say what would run")
    p.add_argument("--steps", nargs="+", choices=[st[0] for st in STEPS],
                   default=[st[0] for st in STEPS],
                   help="which steps this closing needs (default: all, in order)")
    a = p.parse_args()
    if a.copy_back is not None:
        for path in copy_back(a.copy_back):
            print(f"[closing] {path.relative_to(ROOT)}")
        return
    if a.out is None:
        p.error("--out is required (or --copy-back FILES_AT)")
    start = time.monotonic()
    sha = os.environ.get("COLOSSAL_LAB_GIT_SHA")
    if not sha:
        sys.exit("set COLOSSAL_LAB_GIT_SHA to the commit being measured")
    if a.slug is None:
        sys.path.insert(0, str(ROOT))
        from colossal_lab.measure import hardware
        a.slug = hardware.detect().slug
    for name, args, estimate, resumable in (st for st in STEPS if st[0] in a.steps):
        left = a.budget_s - (time.monotonic() - start)
        final = ROOT / "results" / a.slug / f"{name}.json"
        if recorded_sha(final) == sha:
            print(f"[closing] {name}: done at this commit", flush=True)
            continue
        partial = ROOT / "results" / a.slug / "partial" / f"{name}.json"
        resume = resumable and recorded_sha(partial) == sha
        if left < (MIN_RESUMABLE_S if resumable else estimate) + MARGIN_S:
            print(f"[closing] {name}: left for the next call ({left:.0f} s left)",
                  flush=True)
            break
        argv = [name, *args, *(["--resume"] if resume else [])]
        print(f"[closing] {' '.join(argv)} ({left:.0f} s left)", flush=True)
        if a.dry_run:
            continue
        rc = run_step(argv, left - MARGIN_S)
        copy_out(a.out, a.slug, name)
        print(f"[closing] {name}: exit status {rc}", flush=True)
        if rc != 0:
            break  # the next call resumes or retries it


if __name__ == "__main__":
    main()
