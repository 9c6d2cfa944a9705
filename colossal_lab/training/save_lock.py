"""One run per save-dir: an advisory lock file naming the holder's host and pid.

Two runs writing checkpoints into one folder would prune and overwrite each other's
steps. `SaveDirLock` takes ``<dir>/.lock`` with ``flock`` (non-blocking) for the whole
run and writes ``host pid`` into it; a second run finds the lock taken and stops with
an error naming the holder. The kernel drops a ``flock`` when its process dies, however
it dies, so a killed run never leaves a stale lock behind (only an unlocked file, which
the next run takes). A clean exit deletes the file; a run that locked a file just
deleted (its inode no longer the path's) tries again. On a filesystem without ``flock``
(some network mounts) the run goes on unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from pathlib import Path

from colossal_lab.training.checkpoint_io import LOCK, CheckpointError


class SaveDirLock:
    """``with SaveDirLock(dir):`` holds `dir`'s lock (created if missing) for the block."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = self.holder() or "another process"
                    raise CheckpointError(
                        f"{self.path.parent} is in use by another run ({holder}): wait "
                        "for it to finish, or choose another --save-dir") from None
                print(f"warning: cannot lock {self.path} ({e.strerror}); make sure no "
                      "other run writes there", file=sys.stderr)
                return
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break  # the file is still the path's: the lock is ours
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder deleted it as we opened it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode())
        self.fd = fd

    def holder(self) -> str | None:
        """"host H pid P" of the run holding the lock, as it wrote it."""
        try:
            return self.path.read_text().strip() or None
        except OSError:
            return None

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before unlocking: nobody locks a ghost
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> SaveDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
