"""Pipeline programs: actions, their dependencies, placements and the `Schedule` type.

**Actions** (`Action(kind, mb, stage)`, printed ``"<stage><kind><mb>"`` as in torchtitan,
e.g. ``"5F3"``: forward of micro-batch 3 through virtual stage 5):

* ``F``: forward of micro-batch ``mb`` through virtual stage ``stage``.
* ``B``: backward for the *input* gradient (Qi et al.'s B). In schedules that do not split
  the backward (GPipe, 1F1B, interleaved 1F1B: ``split_backward=False``) ``B`` is the
  **full** backward, weight gradient included, and there is no ``W`` action.
* ``W``: backward for the *weight* gradient of that micro-batch and stage. It needs only
  what that stage's B left behind, so it may wait: zero-bubble schedules move it into
  what would be idle time.
* ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``: point-to-point transfers. A
  generator returns **compute only**: communication follows from the dependencies, and
  `Schedule.lower` writes it out (each SEND right after the compute that made the
  tensor, each RECV where that tensor is sent in the schedule's own timeline, so that
  blocking transfers cannot deadlock; see `Schedule.lower`). ``SEND_F`` at stage ``s``
  sends stage s's output to stage s + 1; ``RECV_F`` at ``s`` receives stage s's input;
  ``SEND_B`` at ``s`` sends the gradient of stage s's input to stage s − 1; ``RECV_B`` at
  ``s`` receives the gradient of stage s's output. Transfers between two stages on the
  same rank (the tip of the V in ZB-V) are not communication and get no action. A
  schedule may also carry its own transfers; `validate` then checks those.

**Dependencies** (the same for every schedule): ``F(mb, s)`` after ``F(mb, s − 1)``;
``B(mb, s)`` after ``F(mb, s)`` and after ``B(mb, s + 1)`` (the last stage computes the
loss in its F); ``W(mb, s)`` after ``B(mb, s)``.

**Placements** (virtual stage → rank): *linear* (GPipe, 1F1B, ZB-H1: stage s on rank s);
*interleaved* (Megatron: stage ``c · p + r`` is chunk c of rank r, so a micro-batch laps
the ranks v times); *V* (ZB-V: rank r holds stage r, chunk 0, and stage 2p − 1 − r,
chunk 1: the forward goes down the ranks and back up, so the last rank runs stages
p − 1 and p back to back and rank 0 holds the first and the last stage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE + COMMS


@dataclass(frozen=True)
class Action:
    """One step of a rank's program."""

    kind: str
    """One of `KINDS`: F, B, W, SEND_F, RECV_F, SEND_B, RECV_B."""
    mb: int
    """Micro-batch index, 0 .. m − 1."""
    stage: int
    """Virtual stage (0 .. p · v − 1) the action belongs to; for a transfer, the stage on
    this rank that sends or receives."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"5F3"`` → ``Action("F", 3, 5)`` (the inverse of `str`)."""
        hit = re.fullmatch(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)", text.strip())
        if not hit:
            raise ValueError(f"cannot parse action {text!r}; write <stage><kind><mb>, "
                             "e.g. '0F3' or '1RECV_B2'")
        return cls(hit[2], int(hit[3]), int(hit[1]))


def parse_program(text: str) -> tuple[Action, ...]:
    """A rank's program from text: ``"0F0 0F1 0B0 0B1"``."""
    return tuple(Action.parse(t) for t in text.split())


def producers(action: Action, num_stages: int) -> list[Action]:
    """The compute actions `action` (a compute action) needs first."""
    kind, mb, s = action.kind, action.mb, action.stage
    if kind == F:
        return [Action(F, mb, s - 1)] if s > 0 else []
    if kind == B:
        return [Action(F, mb, s)] + ([Action(B, mb, s + 1)] if s < num_stages - 1 else [])
    if kind == W:
        return [Action(B, mb, s)]
    raise ValueError(f"{action} is not a compute action")


class ScheduleError(ValueError):
    """A schedule that cannot run as written; the message names the first problem."""


@dataclass(frozen=True)
class Played:
    """What `play` returns."""

    spans: tuple[tuple[tuple[Action, float, float], ...], ...]
    """Per rank, (action, start, end) of the compute actions it got to, in order."""
    pos: tuple[int, ...]
    """Per rank, how many of its compute actions ran (all of them unless stuck)."""
    complete: bool
    """Every action ran; False: the ranks got stuck, the order contradicts the
    dependencies."""


def play(schedule: Schedule, duration=None, comm: float = 0.0) -> Played:
    """Run the compute programs on a clock: each rank in its program's order, each action
    as soon as the rank is free and its inputs exist, inputs from another rank `comm`
    after their producer ends. `duration(action) -> time`; default F = B = W = 1, a full
    backward (``split_backward=False``) 2. Transfers never block here."""
    s = schedule.compute_only()
    if duration is None:
        full = 1.0 if s.split_backward else 2.0
        duration = lambda a: full if a.kind == B else 1.0  # noqa: E731
    progs, S = s.programs, s.num_stages
    pos = [0] * len(progs)
    free = [0.0] * len(progs)
    end: dict[Action, float] = {}
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in progs]
    moved = True
    while moved:
        moved = False
        for r, prog in enumerate(progs):
            while pos[r] < len(prog):
                a = prog[pos[r]]
                deps = producers(a, S)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] + (comm if s.rank_of(d.stage) != r else 0.0)
                                         for d in deps])
                end[a] = free[r] = start + duration(a)
                spans[r].append((a, start, end[a]))
                pos[r] += 1
                moved = True
    complete = all(pos[r] == len(progs[r]) for r in range(len(progs)))
    return Played(tuple(tuple(x) for x in spans), tuple(pos), complete)


# -------------------------------------------------------------------------- placements


def linear_placement(p: int) -> tuple[int, ...]:
    """Stage s on rank s (one chunk per rank)."""
    return tuple(range(p))


def interleaved_placement(p: int, chunks: int) -> tuple[int, ...]:
    """Megatron's: stage ``c · p + r`` is chunk c of rank r."""
    return tuple(s % p for s in range(p * chunks))


def v_placement(p: int) -> tuple[int, ...]:
    """ZB-V's: rank r holds stage r (chunk 0) and stage 2p − 1 − r (chunk 1)."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Schedule:
    """Per-rank programs plus what is needed to read them."""

    name: str
    """Which generator made it ("1f1b", "zbv", ...)."""
    num_microbatches: int
    """m: micro-batches per step."""
    placement: tuple[int, ...]
    """Rank of each virtual stage; its length is the number of virtual stages."""
    programs: tuple[tuple[Action, ...], ...]
    """One program per rank, in execution order."""
    split_backward: bool
    """True: B is the input gradient and each (micro-batch, stage) also has a W. False:
    B is the whole backward (weight gradient folded in) and there is no W."""

    @property
    def num_ranks(self) -> int:
        return len(self.programs)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def chunks(self) -> int:
        """Model chunks (virtual stages) per rank."""
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def chunk_of(self, stage: int) -> int:
        """Index of `stage` among its rank's stages (0 = the first in model order)."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    @property
    def has_comms(self) -> bool:
        return any(not a.is_compute for prog in self.programs for a in prog)

    def compute_only(self) -> Schedule:
        """The same schedule without its transfer actions."""
        return replace(self, programs=tuple(tuple(a for a in prog if a.is_compute)
                                            for prog in self.programs))

    def lower(self, recv: str = "eager") -> Schedule:
        """Write the transfers out. Each SEND goes right after the compute that made the
        tensor. Each RECV goes, with ``recv="eager"`` (the default), where the tensor is
        sent in this schedule's own timeline at F = B = W = 1 (`play`): after every
        compute of the receiver that started earlier; with ``recv="late"``, right before
        the compute that uses it. Transfers at one point of a program are ordered by send
        time, ties by the tensor's name, so every rank meets its messages in one global
        order.

        That global order is what blocking point-to-point needs: no rank can block on a
        peer that first waits for something later, so eager programs run even with every
        transfer a separate blocking call (`validate` checks it). Late receives deadlock
        1F1B under blocking calls as soon as p = 2, m = 2 (rank 0 sends F1 while rank 1
        sends back the gradient of micro-batch 0), deadlock interleaved 1F1B (p = 2,
        m = 4) even when the transfers between two computes are batched, and cross the
        messages of the two directions on ZB-V's links (rank r sends rank r + 1 both
        chunk 0's activations and chunk 1's gradients). Stages on the same rank exchange
        nothing."""
        if recv not in ("eager", "late"):
            raise ValueError(f"recv={recv!r}; choose 'eager' or 'late'")
        s = self.compute_only()
        last = s.num_stages - 1
        played = play(s)
        if recv == "eager" and not played.complete:
            raise ScheduleError(f"{s.name}: cannot place eager receives, the compute order "
                                "contradicts the dependencies (validate() says where)")
        end = {a: e for row in played.spans for a, _, e in row}
        programs = []
        for rank, prog in enumerate(s.programs):
            starts = [st for _, st, _ in played.spans[rank]] if recv == "eager" else []
            at: list[list[tuple]] = [[] for _ in range(len(prog) + 1)]  # point i: before i
            for i, a in enumerate(prog):
                st, mb = a.stage, a.mb
                for d in producers(a, s.num_stages):
                    if s.rank_of(d.stage) == rank:
                        continue
                    op = Action(RECV_F if a.kind == F else RECV_B, mb, st)
                    tag = (d.kind, mb, d.stage)  # the tensor: equal on SEND and RECV
                    if recv == "late":
                        at[i].append((float("inf"), tag, op))
                    else:  # after every compute that starts before the send
                        t = end[d]
                        point = min(i, sum(1 for x in starts if x < t))
                        at[point].append((t, tag, op))
                nxt = st + 1 if a.kind == F else st - 1
                if a.kind != W and 0 <= nxt <= last and s.rank_of(nxt) != rank:
                    op = Action(SEND_F if a.kind == F else SEND_B, mb, st)
                    at[i + 1].append((end.get(a, 0.0), (a.kind, mb, st), op))
            out: list[Action] = []
            for i in range(len(prog) + 1):  # by send time, ties by tensor: one global order
                out += [op for *_, op in sorted(at[i], key=lambda x: (x[0], x[1]))]
                if i < len(prog):
                    out.append(prog[i])
            programs.append(tuple(out))
        return replace(self, programs=tuple(programs))

    def format(self, comms: bool = False) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 ...`` (transfers left out unless
        `comms`)."""
        progs = self.programs if comms else self.compute_only().programs
        return "\n".join(f"rank {r}: " + " ".join(map(str, prog))
                         for r, prog in enumerate(progs))

    def __str__(self) -> str:
        return (f"{self.name}: p={self.num_ranks}, m={self.num_microbatches}, "
                f"{self.chunks} chunk(s) per rank\n{self.format()}")


def _check_pm(name: str, p: int, m: int) -> None:
    for what, v in (("p (pipeline ranks)", p), ("m (micro-batches)", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {what} = {v!r} must be a positive integer")


def _build(name, m, placement, programs, split_backward) -> Schedule:
    return Schedule(name, m, tuple(placement), tuple(tuple(p) for p in programs),
                    split_backward)


# --------------------------------------------------------------------------- generators
