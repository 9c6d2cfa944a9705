"""Checkpoint folders that never lose the last good one: write aside, fsync, rename, then `latest`.

`checkpoint` decides what a checkpoint holds; this module decides how it reaches the
disk, so that a run killed at any instant leaves a checkpoint that resumes:

1. every file goes into a new folder ``<dir>/.partial-step_<N>/``, never into the
   folder `latest` names (each rank writes its shards and its own RNG state there);
2. rank 0 writes ``manifest.json``: the step, the config, and every file's size and
   SHA-256; then fsyncs each file and the folder;
3. it renames the folder to ``step_<N>`` (atomic on one filesystem) and replaces the
   ``latest`` pointer by another atomic rename, then fsyncs ``<dir>``;
4. only then are checkpoints beyond the newest `keep` deleted.

A kill before step 3 leaves a ``.partial-*`` folder that nobody reads (the next save
removes it) and `latest` on the previous checkpoint; a kill between the two renames
leaves `latest` one behind. On resume `find_good` verifies the manifest of the
checkpoint `latest` names, and on a missing file or a checksum that differs (a
truncated or bit-flipped shard) warns and falls back to the newest older checkpoint
that verifies. Tests kill a save at each named phase (`PHASES`) through `fault_hook`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from colossal_lab.errors import UsageError

LATEST = "latest"
MANIFEST = "manifest.json"
PARTIAL = ".partial-"
LOCK = ".lock"

PHASES = ("before_shards", "mid_shard", "before_manifest", "before_latest",
          "after_latest")
"""The named instants of a save, in order, at which `fault_hook` is called: before any
shard is written; with the shards on disk but the save not finished (a test truncates
one there, as a kill during the write would); before the manifest; before the rename
and the move of `latest`; after them, before older checkpoints are pruned."""

fault_hook: Callable[[str, Path], None] | None = None
"""Tests only: called as ``fault_hook(phase, folder)`` at each of `PHASES` (on rank 0;
``mid_shard`` on every rank). Raising there stands for a kill at that instant."""


class CheckpointError(UsageError, RuntimeError):
    """A checkpoint that cannot be resumed or written: missing, incomplete, corrupt,
    made with another run, or a save-dir that cannot take it."""


def phase(name: str, folder: Path) -> None:
    """Mark the save's progress (`PHASES`): a no-op outside the fault tests."""
    if fault_hook is not None:
        fault_hook(name, folder)


# ------------------------------------------------------------------------- the folders


def step_of(path: Path) -> int | None:
    """N for a folder named ``step_N``, else None."""
    name = path.name
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def step_folders(directory: Path) -> list[Path]:
    """The ``step_N`` folders under `directory`, newest (largest N) first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def holds_run(directory: Path) -> bool:
    """Does `directory` hold anything but our lock file (a fresh run refuses it)?"""
    return directory.is_dir() and any(p.name != LOCK for p in directory.iterdir())


def clear(directory: Path) -> None:
    """Delete the checkpoints under `directory` (`--overwrite`), keeping the lock."""
    for p in directory.iterdir():
        if p.name == LOCK:
            continue
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def check_writable(path: Path, what: str) -> None:
    """Create `path` (a folder) if needed and write a probe file in it now, before any
    training, so that a read-only, missing or full location fails in a second."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{socket.gethostname()}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"x")
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be written: "
                              f"{e.strerror or e}") from None


def check_free_space(directory: Path, need_bytes: int) -> None:
    """Refuse a save that the filesystem cannot hold, saying how much it needs."""
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise CheckpointError(f"not enough space in {directory} for a checkpoint: it "
                              f"needs about {need_bytes / 2**20:,.1f} MiB and "
                              f"{free / 2**20:,.1f} MiB are free")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(directory: Path, step: int) -> Path:
    """A fresh, empty ``.partial-step_<step>`` folder (rank 0 only; a left-over one
    from a killed save is removed first)."""
    tmp = directory / f"{PARTIAL}step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


# ---------------------------------------------------------------------- the manifest


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def commit(directory: Path, tmp: Path, step: int, config: dict, keep: int) -> Path:
    """Seal `tmp` and make it the newest checkpoint (rank 0, every rank's files
    written): manifest, fsync, rename to ``step_<step>``, move `latest`, prune."""
    phase("before_manifest", tmp)
    files = {}
    for p in _files(tmp):
        _fsync(p)
        files[p.relative_to(tmp).as_posix()] = {"bytes": p.stat().st_size,
                                                "sha256": sha256(p)}
    manifest = {"step": step, "config": config, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    phase("before_latest", tmp)
    final = directory / f"step_{step}"
    if final.exists():  # a stale or corrupt folder of that step: set aside, then gone
        aside = directory / f"{PARTIAL}old-step_{step}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
    pointer = directory / (LATEST + ".tmp")
    pointer.write_text(final.name)
    _fsync(pointer)
    os.replace(pointer, directory / LATEST)  # atomic: the old one stays until this lands
    _fsync(directory)
    phase("after_latest", final)
    prune(directory, keep)
    return final


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names) and
    any folder a killed save left behind."""
    latest = _latest_name(directory)
    for p in step_folders(directory)[keep:]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)
    for p in directory.glob(PARTIAL + "*"):
        shutil.rmtree(p, ignore_errors=True)


def _latest_name(directory: Path) -> str | None:
    pointer = directory / LATEST
    if pointer.is_dir():
        raise CheckpointError(f"{pointer} is a folder; it should be a file naming the "
                              "newest step_N folder (remove it to resume from the newest)")
    try:
        return pointer.read_text().strip() if pointer.exists() else None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer} cannot be read: {e}") from None


def set_aside_newer(directory: Path, good: Path) -> None:
    """Rename the checkpoints newer than `good` (the one a resume fell back to: they
    failed to verify) to ``corrupt-step_N``: kept for a look, never resumed or counted
    by `prune`, and their step numbers free for the run that continues."""
    for p in step_folders(directory):
        if step_of(p) > step_of(good):
            aside = directory / f"corrupt-{p.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(p, aside)


def verify(folder: Path, required: tuple[str, ...]) -> str | None:
    """Why `folder` cannot be resumed (a file missing, a size or checksum that differs
    from its manifest), or None when it is whole."""
    if not folder.is_dir():
        return "the folder is missing"
    manifest = folder / MANIFEST
    if not manifest.exists():  # a checkpoint older than manifests: the parts, at least
        missing = [p for p in required if not (folder / p).exists()]
        return f"incomplete: {missing[0]} is missing" if missing else None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"corrupt: {MANIFEST} cannot be read ({e})"
    for name in required:
        if name not in files and not (folder / name).exists():
            return f"incomplete: {name} is missing"
    for name, want in files.items():
        p = folder / name
        if not p.exists():
            return f"incomplete: {name} is missing"
        if p.stat().st_size != want["bytes"]:
            return (f"corrupt: {name} has {p.stat().st_size} bytes, the manifest says "
                    f"{want['bytes']}")
        if sha256(p) != want["sha256"]:
            return f"corrupt: {name} fails its checksum"
    return None


def find_good(directory: Path, required: tuple[str, ...]) -> Path:
    """The checkpoint to resume from: the one `latest` names if it verifies, else the
    newest older one that does (with a warning naming what was wrong), else an error."""
    latest = _latest_name(directory)
    if latest is None:
        raise CheckpointError(f"no checkpoint to resume in {directory} ({LATEST} is "
                              "missing): train with --save-dir first")
    first = directory / latest
    if step_of(first) is None and first.parent == directory and "/" not in latest:
        raise CheckpointError(f"{directory / LATEST} names {latest!r}, not a step_N folder")
    why = verify(first, required)
    if why is None:
        return first
    for older in step_folders(directory):
        if older.name == latest or step_of(older) > (step_of(first) or 0):
            continue
        if verify(older, required) is None:
            print(f"warning: checkpoint {first} is {why}; resuming from {older} instead",
                  file=sys.stderr)
            return older
    raise CheckpointError(f"checkpoint {first} is {why}, and no older checkpoint in "
                          f"{directory} verifies")
