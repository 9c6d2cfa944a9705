"""Recorded measurements with provenance: one JSON file per experiment and GPU.

Format (kept stable; the book, the CLI and users' scripts read it)::

    results/<gpu-slug>/<name>.json
    {"name": ..., "provenance": {gpu, gpu_count, driver, cuda, torch, triton, python,
                                 git_sha, git_dirty, date, command, host_cpu},
     "config": {...},        # the experiment's fixed parameters
     "rows": [{...}, ...]}   # flat records: parameters, provider/setup, metrics whose
                              # names carry their unit (_ms, _tflops, _gbps, mfu, ...)

MFU values are fractions (0.46, not 46). A notebook either measures live (on a GPU) and
saves, or loads the file recorded on the reference GPU and says so in a banner.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colossal_lab.measure import hardware
from colossal_lab.measure.timing import CAPTURE_FAILED

REPO_ROOT = Path(__file__).resolve().parents[2]  # colossal_lab/measure/results.py
REFERENCE_GPU = "h200"
"""The GPU whose recorded results the book shows when run without one."""
BANNER_PREFIX = "Numbers from "
"""How every `Results.banner` starts (the notebook freshness check finds them by it)."""
BANNER_WIDTH = 90
announce: Callable[[Results], None] | None = None
"""How `measure_or_load` says where its numbers come from: None prints the banner (a
script, the CLI); the book's notebooks set it (`book.notebook.show_caption`) to show one
caption line linked to the Measurements appendix instead."""


def results_dir() -> Path:
    """`results/` at the repository root (override with $COLOSSAL_LAB_RESULTS)."""
    return Path(os.environ.get("COLOSSAL_LAB_RESULTS", REPO_ROOT / "results"))


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def provenance(command: str | None = None) -> dict:
    """Where, when and with what a measurement was made."""
    dev = hardware.detect()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # a copy of the tree without .git (a remote GPU node) passes the commit explicitly
    # ... and wins over the node's .git, which may be a stale copy
    env_sha = os.environ.get("COLOSSAL_LAB_GIT_SHA")
    sha = env_sha or _git("rev-parse", "HEAD")
    dirty = None if env_sha else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "gpu": dev.name,
        "gpu_count": dev.count,
        "driver": _driver_version() if dev.kind == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_sha": sha or "unknown",
        "git_dirty": bool(dirty) if dirty is not None else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join(shlex.quote(a) for a in sys.argv),
        "host_cpu": platform.processor() or platform.machine(),
    }


@dataclass
class Results:
    """A loaded (or just measured) results file."""

    name: str
    provenance: dict
    rows: list[dict]
    config: dict = field(default_factory=dict)
    path: Path | None = None
    live: bool = False

    def banner(self) -> str:
        """Where the numbers come from, in two lines of at most `BANNER_WIDTH` chars:
        the results file (relative to the repository), recorded or measured live and
        the commit; then GPU, date and command. `integrity.check_notebook` finds banners
        in notebook outputs by `BANNER_PREFIX` and checks the commit against the file."""
        p = self.provenance
        how = "measured live" if self.live else "recorded"
        sha = str(p.get("git_sha") or "?")[:10]
        date = str(p.get("date") or "?")[:16].replace("T", " ")
        gpus = f"{p.get('gpu_count', 1)} x {p.get('gpu')}"
        line2 = f"  {gpus}, {date}, by `{p.get('command')}`"
        if len(line2) > BANNER_WIDTH:
            line2 = line2[:BANNER_WIDTH - 2] + "…`"
        return f"{BANNER_PREFIX}{self._file_label()} ({how}, commit {sha})\n{line2}"

    def _file_label(self) -> str:
        """The results file, relative to the repository when inside it."""
        if self.path is None:
            return f"{self.name} (not saved)"
        try:
            return Path(self.path).resolve().relative_to(REPO_ROOT).as_posix()
        except ValueError:
            return str(self.path)

    def where(self, **match) -> list[dict]:
        """Rows whose fields equal every `key=value` given."""
        return [r for r in self.rows if all(r.get(k) == v for k, v in match.items())]

    def one(self, **match) -> dict:
        rows = self.where(**match)
        if len(rows) != 1:
            raise LookupError(f"{len(rows)} rows of {self.name} match {match}")
        return rows[0]


def save_results(name: str, rows: list[dict], *, config: dict | None = None,
                 command: str | None = None, gpu: str | None = None) -> Path:
    """Write `results/<gpu-slug>/<name>.json` with provenance; returns the path."""
    slug = gpu or hardware.detect().slug
    path = results_dir() / slug / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "provenance": provenance(command), "config": config or {},
           "rows": rows}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    tmp.replace(path)  # atomic: an interrupted run never leaves half a file
    partial_path(name, slug).unlink(missing_ok=True)
    return path


_EXC = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|AssertionError)\b")


def error_line(error: str) -> str:
    """What a row's `error` says first: the exception (``ImportError: ...``) where the
    text is a traceback's last lines joined by " | " (a child process's output), then
    the rest in brackets; any other text unchanged. A cell or a bar that shows a few
    dozen characters then shows why, not ``File "...", line 158``."""
    parts = [p.strip() for p in str(error).split(" | ") if p.strip()]
    hits = [i for i, p in enumerate(parts) if _EXC.match(p)]
    if not hits or hits[-1] == 0:
        return str(error)
    i = hits[-1]
    rest = parts[:i] + parts[i + 1:]
    return parts[i] + (f" [{' | '.join(rest)}]" if rest else "")


def exception_tail(output: str, keep: int = 3) -> str:
    """The part of a failed child process's output that says why, joined by " | ": the
    last exception line of its traceback (``Name: message`` at the start of a line), the
    frame line above it and up to `keep - 1` message lines after it, so that a message
    spread over several lines (torch's CheckpointError) keeps its first line; the last
    `keep` lines where no exception line is found."""
    lines = [line.rstrip() for line in output.strip().splitlines() if line.strip()]
    hits = [i for i, line in enumerate(lines) if not line[:1].isspace() and _EXC.match(line)]
    if not hits:
        return " | ".join(line.strip() for line in lines[-keep:])
    i = hits[-1]
    return " | ".join(line.strip() for line in lines[max(0, i - 1):i + keep])


def partial_path(name: str, gpu: str | None = None) -> Path:
    """Where a benchmark keeps the rows of a run still going (`save_partial`)."""
    return results_dir() / (gpu or hardware.detect().slug) / "partial" / f"{name}.json"


def save_partial(name: str, rows: list[dict], **kw) -> Path:
    """The rows a running benchmark has so far, with provenance, in
    `results/<gpu>/partial/<name>.json`: a run cut short (a time limit, a crash in a
    later setup) keeps what it measured. `save_results` removes it when the run ends.
    Nothing loads these files: a partial run is evidence, not a result."""
    path = partial_path(name, kw.get("gpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "partial": True, "provenance": provenance(kw.get("command")),
           "config": kw.get("config") or {}, "rows": rows}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def load_partial(name: str, gpu: str | None = None) -> dict | None:
    """The rows an interrupted run of `name` saved (`save_partial`), or None."""
    path = partial_path(name, gpu)
    return json.loads(path.read_text()) if path.exists() else None


def fell_back(row: dict) -> bool:
    """Whether `row` was timed by a fallback (its `timing` says the CUDA-graph capture
    failed and events timed it instead): a failed measurement, to be taken again."""
    return CAPTURE_FAILED in str(row.get("timing", ""))


def resumed_rows(name: str, recorded, config: dict, error, *, what: str = "saved run",
                 carry: tuple[str, ...] = (), grown: tuple[str, ...] = (),
                 may_change: tuple[str, ...] = (),
                 retry: Callable[[dict], bool] | None = None) -> tuple[list[dict], dict]:
    """(rows kept, config) for an invocation that continues `recorded` (`--resume`):
    a results document (as `save_partial` writes it), a `Results`, or None.

    The rows kept are the finished ones, each with `measured_at` (its commit); a row
    with an `error`, or whose timing fell back (`fell_back`), runs again, and with
    `retry` only the failed rows it accepts do. The config is `config` with
    `resumed_from` (every earlier invocation's provenance) and the `carry` entries taken
    over from `recorded`. `error` (argparse's) refuses a missing `what` of `name` or
    another configuration, except list entries in `grown` that gained items (providers
    added to a sweep) and entries in `may_change`, whose old value `resumed_from` keeps
    under "config_then"."""
    if recorded is None:
        error(f"--resume: no {what} of {name} is saved to continue from")
    if isinstance(recorded, Results):
        recorded = {"config": recorded.config, "provenance": recorded.provenance,
                    "rows": recorded.rows}
    skip = ("resumed_from", *carry)
    old = {k: v for k, v in recorded["config"].items() if k not in skip}
    want = json.loads(json.dumps({k: v for k, v in config.items() if k not in skip},
                                 default=_json_default))  # tuples read back as lists
    then = {k: old[k] for k in may_change if k in old and old[k] != want.get(k)}
    for k in may_change:
        old.pop(k, None)
        want.pop(k, None)
    for k in grown:
        if isinstance(old.get(k), list) and isinstance(want.get(k), list) \
                and set(map(str, old[k])) <= set(map(str, want[k])):
            old[k] = want[k]
    if old != want:
        diff = sorted(k for k in set(old) | set(want) if old.get(k) != want.get(k))
        error(f"--resume: the {what} of {name} measured another configuration (differs "
              f"in {', '.join(diff)}): {old}, not {want}")
    prov = recorded["provenance"]
    kept = [dict(r, measured_at=r.get("measured_at") or prov.get("git_sha"))
            for r in recorded["rows"] if ("error" not in r and not fell_back(r))
            or retry is not None and not retry(r)]
    earlier = recorded["config"].get("resumed_from", [])
    carried = {k: recorded["config"][k] for k in carry if k in recorded["config"]}
    prov = {**prov, "config_then": then} if then else prov
    return kept, {**config, **carried, "resumed_from": [*earlier, prov]}


def merge_rows(name: str, rows: list[dict], key: str | tuple[str, ...], *,
               gpu: str | None = None) -> list[dict]:
    """`rows` merged into the rows recorded in `results/<gpu>/<name>.json`: a recorded
    row whose `key` value (a field, or a tuple of fields) is one of `rows`' is
    replaced, every other recorded row kept, in recorded order, then `rows`.

    For a benchmark run once per setting into one file (`bench collectives --link
    host`, then ``--link sockets``): each invocation replaces its own setting's rows
    and keeps the others'. The file's provenance is the latest invocation's; each
    merged row keeps the fields that say which setting it measured."""
    keys = (key,) if isinstance(key, str) else tuple(key)
    for i, r in enumerate(rows):
        missing = [k for k in keys if k not in r]
        if missing:
            raise KeyError(f"row {i} of {name} has no {missing}: merge_rows keys by {keys}")
    path = results_dir() / (gpu or hardware.detect().slug) / f"{name}.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    new_keys = {tuple(r[k] for k in keys) for r in rows}
    kept = [r for r in old if tuple(r.get(k) for k in keys) not in new_keys]
    return kept + list(rows)


def _json_default(obj):
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in a results file")


def run_slug(world: int | None = None) -> str:
    """The results folder of a run on `world` GPUs (default: the torch.distributed world,
    1 without one): this GPU's slug on one, ``<slug>x<world>`` on several ("h200x2"), so
    a multi-GPU run never mixes with the single-GPU files."""
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
            else 1
    slug = hardware.detect().slug
    return slug if world <= 1 else f"{slug}x{world}"


def _multi_gpu_slugs(slug: str) -> list[str]:
    """The multi-GPU folders of `slug` that exist ("h200x2", "h200x4"), fewest GPUs first."""
    found = [p.name for p in results_dir().glob(f"{slug}x*")
             if p.is_dir() and p.name[len(slug) + 1:].isdigit()]
    return sorted(found, key=lambda n: int(n[len(slug) + 1:]))


def load_results(name: str, gpu: str | None = None) -> Results:
    """Load `results/<gpu>/<name>.json`; `gpu=None` prefers this machine's GPU, then the
    reference GPU, then their multi-GPU folders (`run_slug`), fewest GPUs first: a
    multi-GPU benchmark's file is found by its name alone."""
    here = hardware.detect().slug
    candidates = [gpu] if gpu else [here, REFERENCE_GPU, *_multi_gpu_slugs(here),
                                    *_multi_gpu_slugs(REFERENCE_GPU)]
    for slug in dict.fromkeys(candidates):
        path = results_dir() / slug / f"{name}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            return Results(doc["name"], doc["provenance"], doc["rows"],
                           doc.get("config", {}), path)
    raise FileNotFoundError(
        f"no recorded results {name!r} for {candidates} under {results_dir()}; "
        f"run the benchmark on a GPU first (python -m colossal_lab bench {name})")


def load_multi_gpu(name: str) -> list[Results]:
    """Every multi-GPU run of `name` on record: ``results/<slug>x<n>/<name>.json`` for
    this machine's GPU and the reference GPU, fewest GPUs first (two GPUs, then four),
    one per folder; [] when none. A chapter shows each, where `load_results` returns
    only the first."""
    here = hardware.detect().slug
    out = []
    for slug in dict.fromkeys([*_multi_gpu_slugs(here), *_multi_gpu_slugs(REFERENCE_GPU)]):
        path = results_dir() / slug / f"{name}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            out.append(Results(doc["name"], doc["provenance"], doc["rows"],
                               doc.get("config", {}), path))
    return out


def measure_or_load(name: str, measure: Callable[[], list[dict]], *,
                    config: dict | None = None, command: str | None = None) -> Results:
    """On a GPU: run `measure()`, save, and return it (with $COLOSSAL_LAB_REUSE=1, load
    this GPU's recorded file instead when there is one; with $COLOSSAL_LAB_REUSE=only,
    never measure: a notebook re-executed after its benchmarks ran, which must not start
    a long one it lacks). Without a GPU: load the reference GPU's recorded file.
    Either way print where the numbers come from."""
    reuse = os.environ.get("COLOSSAL_LAB_REUSE", "")
    if reuse not in ("", "0", "1", "only"):
        raise ValueError(f"COLOSSAL_LAB_REUSE={reuse!r}: use 1 (reuse what is recorded "
                         "here) or only (never measure)")
    here = hardware.detect().slug
    recorded_here = (results_dir() / here / f"{name}.json").exists()
    if torch.cuda.is_available() and reuse != "only" and not (reuse == "1" and recorded_here):
        rows = measure()
        path = save_results(name, rows, config=config, command=command)
        res = load_results(name, gpu=path.parent.name)
        res.live = True
    else:
        res = load_results(name)
    if announce is None:
        print(res.banner())
    else:
        announce(res)
    return res
