"""Check a pipeline schedule before anything runs it.

`validate(schedule)` returns a `Report` or raises `ScheduleError` naming the first
violation it finds, in this order:

1. **Shape.** One program per rank; every action's stage lives on the rank that runs it;
   micro-batch and stage indices in range; no W in a schedule whose B is the full
   backward (``split_backward=False``).
2. **Exactly once.** Every (micro-batch, stage) has one F and one B, and one W when the
   backward is split; nothing missing, nothing twice.
3. **Dependencies** (`check_dependencies`). ``F(mb, s)`` after ``F(mb, s − 1)``; ``B(mb, s)``
   after ``F(mb, s)`` and ``B(mb, s + 1)``; ``W(mb, s)`` after ``B(mb, s)``. Checked by
   playing the programs with unbounded, never-blocking transfers: a rank runs its next
   action as soon as what it needs has run anywhere. If every unfinished rank waits, the
   order contradicts the dependencies: either a rank needs something it runs later
   itself, or the ranks wait on each other in a circle; the error says which.
4. **No deadlock under blocking point-to-point** (`check_p2p`). The programs with their
   transfers written out (`Schedule.lower`, unless the schedule carries its own) are
   played as blocking calls: a RECV returns once the matching SEND is posted, and a
   SEND once the matching RECV is posted (rendezvous, as NCCL does for large messages;
   a program safe under rendezvous is safe under any buffering). Messages between two
   ranks match in the order they are posted, with no tags, as ``torch.distributed``
   send/recv do: a send and a receive that meet but name different tensors are an
   error ("out of order"), since on the wire they would silently swap. With
   ``p2p="blocking"`` (the default, the strictest) every transfer is its own call; with
   ``p2p="batched"`` the transfers between two computations are posted together and
   waited together, as ``dist.batch_isend_irecv`` does (Megatron's
   ``send_forward_recv_backward``). When no rank can move, the error lists the call each
   one blocks in. Every generator's program, lowered with eager receives, passes both.
5. **Memory.** Live activations per rank, walking its program (`activation_profile`): an
   F allocates one micro-batch's activations of its chunk, 1/v of a stage with v chunks
   per rank; a full B frees them; a split B frees all but the part W still needs
   (``w_stash``, default 1: W keeps the whole stash, an upper bound: in a transformer W
   needs the inputs of the linear layers, most of it) and W frees the rest. Units: one
   micro-batch's activations of one rank's share of the model, so 1F1B peaks at p on
   rank 0 and GPipe at m.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from colossal_lab.parallel.pipeline.program import (
    COMMS,
    COMPUTE,
    KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    play,
    producers,
)

P2P_MODES = ("blocking", "batched")


@dataclass(frozen=True)
class Report:
    """What `validate` found about a valid schedule."""

    name: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    split_backward: bool
    peak_activations: tuple[float, ...]
    """Per rank, the most live activations, in micro-batches of one rank's share of the
    model (see `activation_profile`)."""
    messages: int
    """Point-to-point transfers in one step."""
    p2p: str
    """The blocking model the deadlock check used: "blocking" or "batched"."""
    w_stash: float
    """Share of a micro-batch's activations W keeps after B (1: all of it)."""

    def __str__(self) -> str:
        peaks = ", ".join(f"{x:g}" for x in self.peak_activations)
        return (f"{self.name} (p={self.num_ranks}, m={self.num_microbatches}, "
                f"{self.chunks} chunk(s)/rank): valid; {self.messages} p2p messages, "
                f"no deadlock ({self.p2p}); peak activations per rank [{peaks}]")


def _desc(a: Action, schedule: Schedule) -> str:
    what = {F: "F", B: "B" if schedule.split_backward else "B (full backward)", W: "W",
            SEND_F: "SEND_F", RECV_F: "RECV_F", SEND_B: "SEND_B", RECV_B: "RECV_B"}
    return f"{what[a.kind]} of micro-batch {a.mb} at stage {a.stage} ({a})"


# ------------------------------------------------------------------ 1, 2: shape, once


def _check_shape(s: Schedule) -> None:
    p, S, m = s.num_ranks, s.num_stages, s.num_microbatches
    if p < 1 or S < p or S % p or any(not 0 <= r < p for r in s.placement):
        raise ScheduleError(f"placement {list(s.placement)} does not give each of the "
                            f"{p} ranks the same number of stages")
    counts = Counter(s.placement)
    if len(set(counts.values())) != 1 or len(counts) != p:
        raise ScheduleError(f"placement {list(s.placement)} gives the ranks "
                            f"{[counts[r] for r in range(p)]} stages; each needs {S // p}")
    for r, prog in enumerate(s.programs):
        for a in prog:
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r} in {a}")
            if not 0 <= a.stage < S:
                raise ScheduleError(f"rank {r}: {a} names stage {a.stage}; stages are "
                                    f"0..{S - 1}")
            if not 0 <= a.mb < m:
                raise ScheduleError(f"rank {r}: {a} names micro-batch {a.mb}; there are "
                                    f"{m} (0..{m - 1})")
            if s.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} runs {_desc(a, s)}, but stage {a.stage} "
                                    f"lives on rank {s.rank_of(a.stage)}")
            if a.kind == W and not s.split_backward:
                raise ScheduleError(f"rank {r} runs {_desc(a, s)}, but this schedule "
                                    "folds W into B (split_backward=False)")


def _check_once(s: Schedule) -> None:
    seen = Counter(a for prog in s.programs for a in prog if a.is_compute)
    kinds = COMPUTE if s.split_backward else (F, B)
    for mb in range(s.num_microbatches):
        for st in range(s.num_stages):
            for k in kinds:
                a = Action(k, mb, st)
                if seen[a] == 0:
                    raise ScheduleError(f"missing {_desc(a, s)} on rank {s.rank_of(st)}")
                if seen[a] > 1:
                    raise ScheduleError(f"{_desc(a, s)} appears {seen[a]} times on rank "
                                        f"{s.rank_of(st)}; every action runs once")


# ------------------------------------------------------------------- 3: dependencies


def check_dependencies(schedule: Schedule) -> None:
    """Play the compute programs with never-blocking transfers (`play`); raise
    `ScheduleError` when the order contradicts the dependencies (see the module
    docstring)."""
    s = schedule.compute_only()
    played = play(s)
    if played.complete:
        return
    progs, pos, S = s.programs, played.pos, s.num_stages
    done = {a for row in played.spans for a, *_ in row}

    def missing(a: Action) -> Action:
        return next(d for d in producers(a, S) if d not in done)

    stuck = [r for r in range(len(progs)) if pos[r] < len(progs[r])]
    for r in stuck:  # a rank that needs its own later action is the root cause
        a = progs[r][pos[r]]
        d = missing(a)
        if s.rank_of(d.stage) == r:
            raise ScheduleError(f"rank {r} runs {_desc(a, s)} before {_desc(d, s)}, which "
                                "it needs and which comes later on the same rank")
    r = stuck[0]
    chain, seen = [], set()
    while r not in seen:  # follow who waits for whom until a rank repeats
        seen.add(r)
        a = progs[r][pos[r]]
        d = missing(a)
        q = s.rank_of(d.stage)
        chain.append(f"rank {r} at {a} waits for {d} on rank {q}")
        r = q
    raise ScheduleError("the order contradicts the dependencies, the ranks wait on each "
                        "other: " + "; ".join(chain))


# ---------------------------------------------------------------------- 4: p2p


def _peer_tag(s: Schedule, a: Action) -> tuple[int, tuple]:
    """(peer rank, message tag) of a transfer: the tag names the tensor and is equal on
    the SEND and its RECV."""
    if a.kind == SEND_F:
        return s.rank_of(a.stage + 1), (F, a.mb, a.stage)  # output of F at a.stage
    if a.kind == RECV_F:
        return s.rank_of(a.stage - 1), (F, a.mb, a.stage - 1)
    if a.kind == SEND_B:
        return s.rank_of(a.stage - 1), (B, a.mb, a.stage)  # input grad of a.stage
    return s.rank_of(a.stage + 1), (B, a.mb, a.stage + 1)  # RECV_B


def _tag_str(tag: tuple) -> str:
    kind, mb, st = tag
    return (f"activation of micro-batch {mb} from stage {st} to {st + 1}" if kind == F
            else f"gradient of micro-batch {mb} from stage {st} to {st - 1}")


def _check_messages(s: Schedule) -> int:
    """Every tensor that crosses ranks is sent once after it is computed and received
    once before it is used; returns the number of messages."""
    S, last = s.num_stages, s.num_stages - 1
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for r, prog in enumerate(s.programs):
        have: set = set()  # tags computed here or received
        for a in prog:
            if a.kind in COMMS:
                if a.kind in (SEND_F, SEND_B):
                    if (a.kind == SEND_F and a.stage == last) or (
                            a.kind == SEND_B and a.stage == 0):
                        raise ScheduleError(f"rank {r}: {a} sends past the end of the "
                                            "pipeline")
                    peer, tag = _peer_tag(s, a)
                    if peer == r:
                        raise ScheduleError(f"rank {r}: {a} sends to itself (the stages "
                                            "share a rank: no transfer is needed)")
                    if tag not in have:
                        raise ScheduleError(f"rank {r} sends the {_tag_str(tag)} ({a}) "
                                            "before computing it")
                    sends[tag] += 1
                else:
                    if (a.kind == RECV_F and a.stage == 0) or (
                            a.kind == RECV_B and a.stage == last):
                        raise ScheduleError(f"rank {r}: {a} receives from before the "
                                            "start of the pipeline")
                    peer, tag = _peer_tag(s, a)
                    if peer == r:
                        raise ScheduleError(f"rank {r}: {a} receives from itself")
                    recvs[tag] += 1
                    have.add(tag)
                continue
            for d in producers(a, S):
                if s.rank_of(d.stage) != r and d.kind in (F, B) and (d.kind, d.mb,
                                                                     d.stage) not in have:
                    kind = RECV_F if d.kind == F else RECV_B
                    raise ScheduleError(f"rank {r} runs {_desc(a, s)} without receiving "
                                        f"{d} from rank {s.rank_of(d.stage)} first (no "
                                        f"{kind} before it)")
            have.add((a.kind, a.mb, a.stage))
    for tag in sorted(set(sends) | set(recvs)):
        if sends[tag] != 1 or recvs[tag] != 1:
            raise ScheduleError(f"the {_tag_str(tag)} is sent {sends[tag]} and received "
                                f"{recvs[tag]} times; each crossing tensor needs one of each")
    needed = sum(1 for mb in range(s.num_microbatches) for st in range(S - 1)
                 if s.rank_of(st) != s.rank_of(st + 1)) * 2
    if len(sends) != needed:  # a crossing edge with no message at all
        for mb in range(s.num_microbatches):
            for st in range(S - 1):
                if s.rank_of(st) != s.rank_of(st + 1):
                    for tag in ((F, mb, st), (B, mb, st + 1)):
                        if tag not in sends:
                            raise ScheduleError(f"the {_tag_str(tag)} is never sent")
    return len(sends)


def check_p2p(schedule: Schedule, p2p: str = "blocking") -> int:
    """Play the programs with blocking point-to-point transfers (see the module
    docstring); raise `ScheduleError` on a deadlock or mismatched messages; return the
    number of messages."""
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p={p2p!r}; choose one of {P2P_MODES}")
    s = schedule if schedule.has_comms else schedule.lower()
    messages = _check_messages(s)
    progs, p = s.programs, s.num_ranks
    pos = [0] * p
    posted: list[list[tuple] | None] = [None] * p  # current call: [(op, channel, index)]
    sent: dict[tuple[int, int], list] = {}  # (src, dst) -> tags in posting order
    recvd: dict[tuple[int, int], list] = {}

    def call(r: int) -> list[Action]:  # the transfers of rank r's next blocking call
        prog, i = progs[r], pos[r]
        if p2p == "blocking":
            return [prog[i]]
        j = i
        while j < len(prog) and prog[j].kind in COMMS:
            j += 1
        return list(prog[i:j])

    def matched(op, ch, k, tag) -> bool:
        other = (recvd if op.kind in (SEND_F, SEND_B) else sent).get(ch, [])
        if len(other) <= k:
            return False
        if other[k] != tag:
            src, dst = ch
            snd, rcv = (tag, other[k]) if op.kind in (SEND_F, SEND_B) else (other[k], tag)
            raise ScheduleError(f"messages out of order from rank {src} to rank {dst}: "
                                f"message {k} sent is the {_tag_str(snd)}, but the receive "
                                f"it meets expects the {_tag_str(rcv)}")
        return True

    while True:
        moved = False
        for r in range(p):
            prog = progs[r]
            while pos[r] < len(prog):
                if prog[pos[r]].is_compute:  # its inputs were received by earlier calls
                    pos[r] += 1
                    moved = True
                    continue
                if posted[r] is None:
                    ops = call(r)
                    posted[r] = []
                    for op in ops:
                        peer, tag = _peer_tag(s, op)
                        is_send = op.kind in (SEND_F, SEND_B)
                        ch = (r, peer) if is_send else (peer, r)
                        book = sent if is_send else recvd
                        book.setdefault(ch, []).append(tag)
                        posted[r].append((op, ch, len(book[ch]) - 1, tag))
                    moved = True
                if all(matched(*x) for x in posted[r]):
                    pos[r] += len(posted[r])
                    posted[r] = None
                    moved = True
                    continue
                break
        if all(pos[r] == len(progs[r]) for r in range(p)):
            return messages
        if not moved:
            waits = []
            for r in range(p):
                if pos[r] < len(progs[r]):
                    ops = " + ".join(f"{op} ({'to' if op.kind.startswith('SEND') else 'from'}"
                                     f" rank {_peer_tag(s, op)[0]})" for op, *_ in posted[r])
                    waits.append(f"rank {r} blocks in {ops}")
            raise ScheduleError(f"deadlock under {p2p} point-to-point: " + "; ".join(waits))


# ------------------------------------------------------------------------ 5: memory


def activation_profile(schedule: Schedule, w_stash: float = 1.0) -> list[list[float]]:
    """Per rank, the live activations after each of its compute actions, in micro-batches
    of one rank's share of the model: F adds 1/v (v chunks per rank); a full B frees its
    1/v; a split B frees (1 − w_stash)/v and its W the remaining w_stash/v."""
    if not 0 <= w_stash <= 1:
        raise ValueError(f"w_stash={w_stash} must be in [0, 1]: the share of a "
                         "micro-batch's activations W still needs after B")
    unit = 1.0 / schedule.chunks
    delta = {F: unit, B: -unit * ((1 - w_stash) if schedule.split_backward else 1.0),
             W: -unit * w_stash}
    out = []
    for prog in schedule.compute_only().programs:
        live, trace = 0.0, []
        for a in prog:
            live += delta[a.kind]
            trace.append(live)
        out.append(trace)
    return out


def peak_activations(schedule: Schedule, w_stash: float = 1.0) -> tuple[float, ...]:
    """Per rank, the largest value of `activation_profile` (rounded to 1e-9)."""
    return tuple(round(max(t, default=0.0), 9) for t in activation_profile(schedule, w_stash))


# ------------------------------------------------------------------------- validate


def validate(schedule: Schedule, *, p2p: str = "blocking", w_stash: float = 1.0) -> Report:
    """Every check of the module docstring, in order; the first violation raises
    `ScheduleError`."""
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p={p2p!r}; choose one of {P2P_MODES}")
    _check_shape(schedule)
    _check_once(schedule)
    check_dependencies(schedule)
    messages = check_p2p(schedule, p2p)
    return Report(schedule.name, schedule.num_ranks, schedule.num_microbatches,
                  schedule.chunks, schedule.split_backward,
                  peak_activations(schedule, w_stash), messages, p2p, w_stash)
