"""Stop at the next step boundary on SIGTERM or SIGINT, so the run can save first.

Cluster schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill a job;
a user presses Ctrl-C. Either way the step in flight should finish, a checkpoint be
written and the process exit cleanly, rather than die mid-save. `StopRequest` records
the signal; the training loop asks `requested` between steps. A second SIGINT
interrupts at once (Python's default), for a run that will not stop.
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """``with StopRequest() as stop:`` ... ``if stop.requested:`` save and leave. Outside
    the main thread (where Python cannot install handlers) it never requests."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signum = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
