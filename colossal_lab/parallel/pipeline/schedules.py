"""Pipeline schedules as data: one list of actions per rank.

**The model.** The layers are cut into ``S = p · v`` *virtual stages* (``v`` model chunks
per rank, ``p`` ranks); a batch is cut into ``m`` micro-batches. A `Schedule` gives each
rank the exact order in which it runs its work, and nothing else: timing, memory and
correctness follow from the order (`simulate`, `validate`).

**The schedules** (``p`` ranks, ``m`` micro-batches; F = B = W per stage):

* `gpipe` (Huang et al. 2019): every forward, then every backward. Peak memory m
  micro-batches on every rank.
* `one_f_one_b` (PipeDream-Flush, Narayanan et al. 2021): rank r runs p − 1 − r forwards,
  then alternates one forward, one backward, then drains. Same bubble as GPipe,
  (p − 1)/(m + p − 1) of the step, with at most p − r micro-batches alive on rank r.
* `interleaved_1f1b` (Narayanan et al. 2021, Megatron-LM): v chunks per rank; the bubble
  shrinks by v at the price of v× the p2p traffic and more warm-up memory. Needs
  m % p == 0: micro-batches go through the chunks in groups of p.
* `zb_h1` (Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism"): 1F1B with B
  and W split; W waits so that B can run as soon as the gradient arrives, then fills the
  drain. Bubble (p − 1)(F + B − W) per rank (for W ≤ F; (p − 1)B otherwise): with
  F = B = W a third of 1F1B's, (p − 1)/(3m + p − 1) of the step; memory as 1F1B
  (p micro-batches, see `zb_h1`).
* `zb_v` (same paper, section 6): V placement, 2 chunks per rank, B and W split: the
  last rank needs no drain and W fills the rest; with F = B = W only the ramp is left,
  (p − 1)/(6m + p − 1) of the step. Memory as 1F1B (2p chunk micro-batches = p).

**Bubbles per rank** (uniform stages, no latency, costs per rank's share): 1F1B idles
(p − 1)(F + B + W), ZB-H1 (p − 1)(F + B − W), the paper's closed forms, for any F, B, W
(ZB-H1's with W ≤ F; else (p − 1)B): neither order depends on the costs, and both
forms are lower bounds at 1F1B's memory (`zb_h1` says why). ZB-V has no closed form for
unequal costs; its lower bound is the ramp, (p − 1)F/2 (its last rank waits for p − 1
chunk forwards). Its greedy order lands between the ramp and ZB-H1's bound at 1F1B's
memory, and on the ramp with half as much again (`zb_v`).

ZB-V comes from a greedy list scheduler (`greedy`), as the zero-bubble authors' own
``v_schedule`` (used by ColossalAI) does: it plays the pipeline forward in time with
given costs and, whenever a rank is free, runs a ready F the memory caps allow, else a
ready B, else a pending W. Its order depends on the costs it is built for: a W that
fits a gap at one ratio of F, B, W overruns it at another, so `zb_v` takes the costs
and keeps the shortest of a few variants. The order is then fixed data, and `simulate`
times it under any other costs.

References: Huang et al. 2019, "GPipe", arXiv:1811.06965; Narayanan et al. 2021,
"Efficient large-scale language model training on GPU clusters using Megatron-LM",
arXiv:2104.04473; Qi, Wan, Huang, Lin 2024, "Zero Bubble (Almost) Pipeline Parallelism",
ICLR 2024, arXiv:2401.10241; PyTorch ``torch.distributed.pipelining`` (schedules as
per-rank action lists); ColossalAI ``ZeroBubbleVPipeScheduler``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from colossal_lab.parallel.pipeline.program import (  # noqa: F401  (re-exported)
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
    Played,
    Schedule,
    ScheduleError,
    W,
    _build,
    _check_pm,
    interleaved_placement,
    linear_placement,
    parse_program,
    play,
    producers,
    v_placement,
)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all m forwards, then all m (full) backwards, on every rank."""
    _check_pm("gpipe", p, m)
    programs = [[Action(F, i, r) for i in range(m)] + [Action(B, i, r) for i in range(m)]
                for r in range(p)]
    return _build("gpipe", m, linear_placement(p), programs, False)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r warms up with min(p − 1 − r, m) forwards, then
    alternates F and (full) B, then drains the remaining backwards."""
    _check_pm("1f1b", p, m)
    programs = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        prog = [Action(F, i, r) for i in range(warm)]
        for i in range(m - warm):  # steady state: one forward, one backward
            prog += [Action(F, warm + i, r), Action(B, i, r)]
        prog += [Action(B, i, r) for i in range(m - warm, m)]
        programs.append(prog)
    return _build("1f1b", m, linear_placement(p), programs, False)


def interleaved_1f1b(p: int, m: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: `chunks` model chunks per rank (stage c·p + r is
    chunk c of rank r); full backwards.

    Each rank walks "virtual micro-batches" k = 0 .. m·v − 1: groups of p micro-batches
    through chunk 0, the same p through chunk 1, ..., then the next p; backwards walk the
    chunks in reverse. Rank r warms up with (p − 1 − r)·2 + (v − 1)·p forwards (all of
    them if fewer), then alternates F and B, then drains."""
    _check_pm("interleaved", p, m)
    v = chunks
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise ValueError(f"interleaved: chunks={v!r} must be an integer >= 2 "
                         "(with one chunk per rank use one_f_one_b)")
    if m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        hint = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(f"interleaved 1F1B needs m % p == 0 (micro-batches go through "
                         f"the chunks in groups of p); m={m}, p={p}: choose m = {hint}")

    def unit(k: int, forward: bool) -> tuple[int, int]:  # k -> (micro-batch, chunk)
        group, within = divmod(k, p * v)
        chunk, i = divmod(within, p)
        return group * p + i, (chunk if forward else v - 1 - chunk)

    programs = []
    for r in range(p):
        total = m * v
        warm = min((p - 1 - r) * 2 + (v - 1) * p, total)

        def act(kind, k, forward, r=r):
            mb, c = unit(k, forward)
            return Action(kind, mb, c * p + r)

        prog = [act(F, k, True) for k in range(warm)]
        for i in range(total - warm):
            prog += [act(F, warm + i, True), act(B, i, False)]
        prog += [act(B, k, False) for k in range(total - warm, total)]
        programs.append(prog)
    return _build(f"interleaved-{v}", m, interleaved_placement(p, v), programs, False)


def _stage_costs(value, name: str, num_stages: int, scale: float = 1.0) -> list[float]:
    """One cost per virtual stage: a number (times `scale`) for every stage, or a sequence
    with one value per stage, taken as it is."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_stages:
            raise ValueError(f"{name} has {len(value)} entries; give one number, or one "
                             f"per virtual stage ({num_stages})")
        return [float(x) for x in value]
    return [float(value) * scale] * num_stages


def greedy(name: str, m: int, placement: Sequence[int], *, live_cap: Sequence[float],
           inflight_cap: Sequence[float] | None = None, f=1.0, b=1.0, w=1.0,
           comm: float = 0.0, first: str = F, reserve: bool = False,
           patience: float = 0.0) -> Schedule:
    """A split-backward schedule from a greedy list scheduler.

    Plays the pipeline forward in time with per-chunk costs `f`, `b`, `w` (a number, or
    one per virtual stage) and a p2p latency `comm`. Each stage runs its F, its B and its
    W in micro-batch order. Whenever a rank is free it starts, among the actions whose
    inputs have arrived (oldest micro-batch first, then the later stage):

    1. an F, if the rank then holds at most ``live_cap[r]`` micro-batch chunks not yet
       released by their W (with `reserve`, less one per later chunk of the rank, kept
       free so that a micro-batch can always move on to them: without it, costs that
       delay the turn of the V can fill a rank with first-chunk forwards and stall it)
       and at most ``inflight_cap[r]`` not yet through their B (with ``first="B"``, a B
       comes before an F);
    2. else a B: it is on the critical path back to stage 0;
    3. else the oldest pending W: it fills what would be a bubble. W cannot be
       interrupted, and a W started into a gap shorter than itself pushes back the F or
       B that arrives meanwhile and, with it, every rank downstream of that action; a
       gap left empty is lost for good. `patience` sets the trade: a W starts only if
       the gap before the next F or B whose inputs are already on their way is at least
       ``patience`` times the W (0: any gap, 1: only a gap the W fits).

    "Arrived" compares times with a tolerance of 1e-9 of the largest cost: with unequal
    costs the same instant is reached by sums in different orders (F + B against B + F)
    that differ in the last bit, and an input seen a rounding error late hands its slot
    to a W that then holds up the critical path.

    The caps make the rhythm: with ``inflight_cap = p − r`` a rank alternates F and B
    after its warm-up exactly as 1F1B does. Raises `RuntimeError` when the caps leave a
    rank nothing to do and nothing in flight.
    """
    if first not in (F, B):
        raise ValueError(f"first={first!r}; choose 'F' or 'B'")
    placement = tuple(placement)
    p, S = max(placement) + 1, len(placement)
    stages = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    cost = {k: _stage_costs(v, k.lower(), S) for k, v in ((F, f), (B, b), (W, w))}
    if min(min(c) for c in cost.values()) <= 0 or comm < 0:
        raise ValueError(f"costs f={f}, b={b}, w={w} must be > 0 and comm={comm} >= 0")
    eps = 1e-9 * max(max(max(c) for c in cost.values()), comm)
    nxt = {(k, s): 0 for k in COMPUTE for s in range(S)}  # next micro-batch per (kind, stage)
    end: dict[Action, float] = {}
    free = [0.0] * p
    live = [0] * p  # chunks F'd, not yet W'd
    inflight = [0] * p  # chunks F'd, not yet B'd
    programs: list[list[Action]] = [[] for _ in range(p)]

    def arrival(a: Action, rank: int) -> float | None:
        """When every input of `a` is on `rank`; None while a producer has not started."""
        t = 0.0
        for d in producers(a, S):
            e = end.get(d)
            if e is None:
                return None
            t = max(t, e + (comm if placement[d.stage] != rank else 0.0))
        return t

    def candidate(kind: str, s: int) -> Action | None:
        i = nxt[(kind, s)]
        return Action(kind, i, s) if i < m else None

    def f_allowed(r: int, c: int) -> bool:
        # an earlier chunk leaves room for a later one: a rank full of first-chunk
        # forwards could never move a micro-batch on and free anything
        if inflight_cap is not None and inflight[r] >= inflight_cap[r]:
            return False
        return live[r] + (len(stages[r]) - 1 - c) * reserve < live_cap[r]

    def pick(r: int, t: float) -> Action | None:
        oldest = lambda acts: min(acts, key=lambda a: (a.mb, -a.stage))  # noqa: E731
        fs, bs, soon = [], [], float("inf")
        for c, s in enumerate(stages[r]):
            for kind, group in ((F, fs), (B, bs)):
                a = candidate(kind, s)
                if a is None or (kind == F and not f_allowed(r, c)):
                    continue
                at = arrival(a, r)
                if at is not None and at <= t + eps:
                    group.append(a)
                elif at is not None:
                    soon = min(soon, at)
        for group in ((fs, bs) if first == F else (bs, fs)):
            if group:
                return oldest(group)
        ws = [a for s in stages[r] if (a := candidate(W, s)) and arrival(a, r) is not None
              and arrival(a, r) <= t + eps]
        if not ws:
            return None
        a = oldest(ws)
        if t + patience * cost[W][a.stage] > soon + eps:
            return None  # wait for the F or B that is on its way
        return a

    t, total = 0.0, 3 * m * S
    events: list[float] = []  # times something ends or arrives: when to look again
    while len(end) < total:
        for r in range(p):
            if free[r] <= t + eps and (a := pick(r, t)):
                end[a] = free[r] = t + cost[a.kind][a.stage]
                heapq.heappush(events, free[r])
                heapq.heappush(events, free[r] + comm)
                programs[r].append(a)
                nxt[(a.kind, a.stage)] += 1
                live[r] += {F: 1, B: 0, W: -1}[a.kind]
                inflight[r] += {F: 1, B: -1, W: 0}[a.kind]
        if len(end) < total:
            while events and events[0] <= t + eps:
                heapq.heappop(events)
            if not events:
                raise RuntimeError(f"{name}: the greedy scheduler is stuck at t={t} (caps "
                                   f"live={list(live_cap)}, inflight={inflight_cap})")
            t = heapq.heappop(events)
    return _build(name, m, placement, programs, True)


def _shortest(candidates, f: list[float], b: list[float], w: list[float],
              comm: float) -> Schedule:
    """The first of the shortest `candidates` (callables that build a schedule or raise
    `RuntimeError`) under per-stage costs `f`, `b`, `w` and latency `comm`."""
    cost = {F: f, B: b, W: w}
    best = None
    for make_one in candidates:
        try:
            s = make_one()
        except RuntimeError:
            continue
        played = play(s, lambda a: cost[a.kind][a.stage], comm)
        span = max((e for row in played.spans for *_, e in row), default=0.0)
        if best is None or span < best[0] * (1 - 1e-12):
            best = (span, s)
    if best is None:
        raise RuntimeError("no candidate order could be built")
    return best[1]


def zb_h1(p: int, m: int, *, f=1.0, b=1.0, w=1.0, comm: float = 0.0) -> Schedule:
    """Zero Bubble H1: 1F1B's order of F and B (rank r warms up with p − 1 − r
    forwards), each B followed by the W of the micro-batch r earlier, the last r W at
    the end. Rank r then holds 1F1B's p − r micro-batches plus r waiting for their W:
    p on every rank (the paper: "the same number of in-flight micro-batches"), which is
    1F1B's peak on rank 0.

    **Why this order reaches (p − 1)(F + B − W).** The last rank starts (p − 1)F late.
    Holding at most p micro-batches, it must run m − p of its W before its last F, so
    its last B ends no earlier than (p − 1)F + m(F + B) + (m − p)W; the gradient then
    needs (p − 1)B to reach rank 0, whose last W follows. No order at this memory takes
    less than m(F + B + W) + (p − 1)(F + B − W): the closed form is a bound. This order
    meets it: rank 0's forwards, paced by its own B and W, reach the last rank as it
    finishes the previous micro-batch, which leaves its last p − 1 W for the end, and
    every B on the way back finds its rank free. Rank 0 cannot start its first B before
    pF + (p − 1)B either, so when W > F the bubble is (p − 1)B instead, also met.

    Both hold for any F, B, W, so the order does not depend on the costs: `f`, `b`, `w`,
    `comm` are taken, as `zb_v` takes them, and change nothing. A greedy list scheduler
    (`greedy`) loses the bound as soon as W is shorter than F and B: it starts a W in
    whatever gap it finds, and a W that overruns its gap holds back the F or B that
    arrives meanwhile, and with it every rank downstream of that action."""
    _check_pm("zb-h1", p, m)
    programs = []
    for r in range(p):
        warm = min(p - 1 - r, m)

        def back(k: int, r: int = r) -> list[Action]:
            return [Action(B, k, r)] + ([Action(W, k - r, r)] if k >= r else [])

        prog = [Action(F, i, r) for i in range(warm)]
        for i in range(m - warm):
            prog += [Action(F, warm + i, r), *back(i)]
        for k in range(m - warm, m):
            prog += back(k)
        prog += [Action(W, k, r) for k in range(max(m - r, 0), m)]
        programs.append(prog)
    return _build("zb-h1", m, linear_placement(p), programs, True)


PATIENCE = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The `greedy` patience values `zb_v` tries."""


def zb_v(p: int, m: int, *, f=1.0, b=1.0, w=1.0, comm: float = 0.0,
         memory: float = 1.0) -> Schedule:
    """ZB-V: V placement (rank r holds chunk 0 = stage r and chunk 1 = stage 2p − 1 − r),
    B and W split, at most ``round(2p · memory)`` micro-batch chunks alive per rank
    (`memory` = 1: 2p chunks = p micro-batches of a 1F1B stage, 1F1B's peak). The greedy
    scheduler runs with forwards first and with backwards first, without and with a
    reserved slot per rank, and with each patience of `PATIENCE` for its W (`greedy`);
    the shortest order under the given costs is kept.

    **Bound.** The last rank cannot start before p − 1 chunk forwards have run, so with
    uniform stages every rank idles at least (p − 1)F/2 (the ramp). With F = B = W that
    is (p − 1)/(6m + p − 1) of the step, and the order reaches it for every m ≥ p at
    p ≤ 6, and at p = 7, 8 for every m ≥ p except (7, 9), (7, 10) and (8, 10), which stay
    1.4 to 2.6 points above (checked up to m = 4p + 1). With W shorter than F and B the
    memory cap is what stands between the order and the ramp: at 1F1B's memory the order
    idles more than the ramp, increasingly so as m grows at p = 8 (the V's two chunks
    cannot both be kept fed while W, the only work that frees memory, is the shortest),
    yet well below ZB-H1's (p − 1)(F + B − W); with `memory` = 1.5 it reaches the ramp.
    That is the zero-bubble paper's trade of memory for bubble (its ZB-2p).

    `f`, `b`, `w`, `comm` are the costs the greedy order is built for, in `simulate`'s
    units: one micro-batch through one rank's share of the model, so a chunk takes half
    (ColossalAI builds its ZB-V order the same way, from measured costs); or one per
    virtual stage, taken as they are."""
    _check_pm("zbv", p, m)
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or \
            not 1.0 <= memory < float("inf"):
        raise ValueError(f"zbv: memory={memory!r} must be a finite number >= 1.0 (a "
                         "multiple of 1F1B's activation memory; 1.0 is 1F1B's)")
    S = 2 * p
    cap = round(2 * p * memory)  # micro-batch chunks alive per rank
    fc, bc, wc = (_stage_costs(x, k, S, 0.5) for x, k in ((f, "f"), (b, "b"), (w, "w")))
    candidates = [lambda first=first, reserve=reserve, pat=pat: greedy(
        "zbv", m, v_placement(p), live_cap=[cap] * p, f=fc, b=bc, w=wc, comm=comm,
        first=first, reserve=reserve, patience=pat)
        for pat in PATIENCE for reserve in (False, True) for first in (F, B)]
    return _shortest(candidates, fc, bc, wc, comm)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b,
             "zb-h1": zb_h1, "zbv": zb_v}
"""Generators by name ("1f1b", "interleaved" and "zbv" are ColossalAI's pp_style)."""


def make(name: str, p: int, m: int, chunks: int = 2, *, costs: dict | None = None,
         memory: float = 1.0) -> Schedule:
    """`SCHEDULES[name](p, m)` (``chunks`` for the interleaved schedule). `costs`:
    ``dict(f=, b=, w=, comm=)`` that ZB-V's greedy order is built for (`zb_v`'s units);
    the other schedules' orders do not depend on costs and ignore it. `memory`: ZB-V's
    activation cap in multiples of 1F1B's; the others have none to raise."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}")
    if memory != 1.0 and name != "zbv":
        raise ValueError(f"memory={memory!r} is ZB-V's activation cap; schedule "
                         f"{name!r} has none to raise: use 'zbv' or memory=1.0")
    if name == "interleaved":
        return interleaved_1f1b(p, m, chunks)
    if name == "zbv":
        return zb_v(p, m, **dict(costs or {}), memory=memory)
    return SCHEDULES[name](p, m)
