"""What a checkpointed layer hands from its forward to its recompute.

`switches.checkpointing.checkpoint` opens a `Replay` around each checkpointed call;
layers with state (fp8 delayed scaling, `ops.fp8`) ask `current_replay()`. A leaf
module: the checkpointing and the fp8 op both use it, neither imports the other.
"""

from __future__ import annotations

import threading


class Replay:
    """What a checkpointed forward hands to its recompute, for layers that have state.

    A recompute must compute what the original forward computed. Stateless layers do
    (same inputs; `torch.utils.checkpoint` restores the RNG and autocast state). A layer
    that reads and advances state in its forward would not: fp8 delayed scaling takes
    its scale from an amax history that each cast extends, so a recompute would scale
    with a history the original forward already advanced, and advance it again. Such a
    layer asks `current_replay()`: in the original forward it `put`s what it used, in
    the recompute (`recomputing` True) it `take`s that back and leaves its state alone.
    One Replay per checkpointed call, held by that call's contexts: a forward whose
    backward never runs leaves nothing behind."""

    def __init__(self) -> None:
        self.recomputing = False
        self._values: dict[object, list] = {}  # owner -> values, in call order
        self._taken: dict[object, int] = {}

    def put(self, owner, value) -> None:
        self._values.setdefault(owner, []).append(value)

    def take(self, owner):
        i = self._taken.get(owner, 0)
        values = self._values.get(owner, [])
        if i >= len(values):
            raise RuntimeError(f"the recompute called {owner!r} more often than the "
                               "checkpointed forward did: not a deterministic layer")
        self._taken[owner] = i + 1
        return values[i]


_LOCAL = threading.local()  # the recompute runs in the autograd engine's thread


class ReplayPhase:
    """Makes `replay` current in this thread for the original forward or for the
    recompute, inside `inner` (a selective policy's context or None). Re-enterable: a
    graph run backward twice recomputes twice."""

    def __init__(self, replay: Replay, recomputing: bool, inner=None):
        self.replay, self.recomputing, self.inner = replay, recomputing, inner

    def __enter__(self):
        if self.inner is not None:
            self.inner.__enter__()
        self.prev = getattr(_LOCAL, "replay", None)
        self.replay.recomputing = self.recomputing
        self.replay._taken.clear()
        _LOCAL.replay = self.replay
        return self

    def __exit__(self, *exc):
        _LOCAL.replay = self.prev
        return self.inner.__exit__(*exc) if self.inner is not None else False


def current_replay() -> Replay | None:
    """The `Replay` of the checkpointed call running now in this thread (its original
    forward or its recompute), or None outside checkpointed layers."""
    return getattr(_LOCAL, "replay", None)
