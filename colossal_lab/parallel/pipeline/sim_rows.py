"""Simulated pipeline rows from recorded per-layer costs, without measuring again.

A GPU measures what a schedule is built from (the forward F, the input-gradient
backward B and the weight-gradient backward W of one decoder layer, the same for the
last stage's head, and the size of what a stage sends its neighbour); everything after
that is arithmetic on those numbers. `simulate_rows` does that arithmetic: from the
"measure" and "p2p" rows a measurement recorded, it returns one "sim" row per
(schedule, p, m, link), and so refreshes a results file's simulated rows on any CPU
whenever the schedules change. It uses nothing but `schedules` and `simulate`.

**The cost model** (`stage_costs`). ``L`` layers are cut into ``S`` virtual stages of
``L / S`` layers; a stage's F, B, W are ``L / S`` times a layer's, and the last stage
also runs the head (final norm, output projection, loss). The embedding is a lookup and
is left out. Schedules that split the backward (ZB-H1, ZB-V) pay the split costs (F with
the weight gradients deferred, B, W); the others pay the undivided forward and the full
backward, each as measured. A transfer costs the p2p row's time for the link and runs
beside the compute.

**The orders.** ZB-V's greedy order depends on the costs it is built for
(`schedules.zb_v`); here it gets the very per-stage costs, head included, and the
latency the timeline is computed with, so that the order timed is the order built for
those costs: an order built for uniform stages and timed with a head on one stage puts
that stage's extra work where the other ranks wait for it. The other orders, ZB-H1's
included (`schedules.zb_h1`), do not depend on the costs.
"""

from __future__ import annotations

from collections.abc import Sequence

from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.simulate import simulate

PS, MS = (2, 4, 8), (4, 8, 16, 32)
"""Pipeline ranks and micro-batches simulated by default."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
CHUNKS = 2
"""Model chunks per rank of the interleaved schedule (ZB-V always has 2)."""
LINKS = ("NVLink 4", "400 Gb/s network")
"""Links whose transfer time (the p2p row's ``comm_ms[<link>]``) the rows are timed
with: a pipeline inside one node, and one stage per node."""
SPLIT = ("zb-h1", "zbv")
"""The schedules whose backward is split into B and W."""


def parts(measured: Sequence[dict]) -> tuple[dict, dict, dict]:
    """The layer's and the head's "measure" rows and the "p2p" row of `measured`."""
    def one(what: str, test) -> dict:
        got = [r for r in measured if test(r)]
        if not got:
            raise ValueError(f"no {what} row among the {len(measured)} given; pass the "
                             "rows of a pipeline_sim measurement")
        return got[0]

    layer = one("'measure' layer", lambda r: r.get("kind") == "measure"
                and r.get("part") == "layer")
    head = one("'measure' head", lambda r: r.get("kind") == "measure"
               and r.get("part") == "head")
    return layer, head, one("'p2p'", lambda r: r.get("kind") == "p2p")


def stage_costs(layer: dict, head: dict, num_layers: int, num_stages: int,
                split: bool) -> tuple[list[float], list[float], list[float]]:
    """Per virtual stage (f, b, w) in ms: num_layers / num_stages layers each, the head
    on the last. `split=False`: the undivided forward (plain linears) where measured, b
    the full backward and w 0."""
    per = num_layers // num_stages
    if per * num_stages != num_layers:
        raise ValueError(f"{num_layers} layers do not divide into {num_stages} stages")
    fk = "f" if split or "f_undivided_ms" not in layer else "f_undivided"
    keys = (fk, "b", "w") if split else (fk, "full_bwd", None)
    out: tuple[list[float], list[float], list[float]] = ([], [], [])
    for s in range(num_stages):
        for col, key in zip(out, keys):
            if key is None:
                col.append(0.0)
                continue
            extra = head[f"{key}_ms"] if s == num_stages - 1 else 0.0
            col.append(per * layer[f"{key}_ms"] + extra)
    return out


def link_ms(p2p: dict, link: str) -> float:
    """The p2p row's transfer time on `link`, ms."""
    key = f"comm_ms[{link}]"
    if key not in p2p:
        known = [k[len("comm_ms["):-1] for k in p2p if k.startswith("comm_ms[")]
        raise ValueError(f"no transfer time for link {link!r}; the p2p row has {known}")
    return float(p2p[key])


def simulate_rows(measured: Sequence[dict], *, ps: Sequence[int] = PS,
                  ms: Sequence[int] = MS, schedules: Sequence[str] = SCHEDULES,
                  links: Sequence[str] = LINKS, num_layers: int | None = None,
                  memory: float = 1.0) -> list[dict]:
    """One "sim" row per (schedule, p, m, link) that exists (interleaved needs
    m % p == 0, ZB-V m >= p), from the "measure" (layer, head) and "p2p" rows in
    `measured`; `num_layers` defaults to the layer row's ``layers``; `memory` is ZB-V's
    activation cap in multiples of 1F1B's (`schedules.zb_v`), on its rows as ``memory``.

    Row keys: kind ("sim"), schedule, p, m, chunks, link, comm_ms, layers, step_ms,
    bubble (idle over total time, `simulate.Timeline.bubble`), bubble_over_useful,
    idle_ms (per rank, makespan minus the rank's own work), tokens_per_s,
    peak_activations (micro-batches of a rank's layers), peak_act_gib (from the
    measured act_mib; an upper bound for the split schedules, whose W keeps only part
    of it), speedup_vs_1f1b (1F1B's step over this one, None without a 1F1B row), and
    on ZB-V's rows memory."""
    layer, head, p2p = parts(measured)
    L = num_layers or layer["layers"]
    tokens_mb = layer["micro_batch"] * layer["seq_len"]
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; choose from {list(SCHEDULES)}")
    rows = []
    for link in links:
        comm = link_ms(p2p, link)
        for p in ps:
            for m in ms:
                group = []
                for name in schedules:
                    if (name == "interleaved" and m % p) or (name == "zbv" and m < p):
                        continue
                    S = p * (CHUNKS if name in ("interleaved", "zbv") else 1)
                    split = name in SPLIT
                    fs, bs, ws = stage_costs(layer, head, L, S, split)
                    if name == "zbv":
                        s = sch.zb_v(p, m, f=fs, b=bs, w=ws, comm=comm, memory=memory)
                    else:
                        s = sch.make(name, p, m, CHUNKS)
                    tl = simulate(s, fs, bs, ws, comm)
                    peak = max(tl.peak_activations)
                    share = L // p  # one rank's layers
                    group.append({
                        "kind": "sim", "schedule": name, "p": p, "m": m,
                        "chunks": s.chunks, "link": link, "comm_ms": comm, "layers": L,
                        "step_ms": tl.makespan, "bubble": tl.bubble,
                        "bubble_over_useful": tl.bubble_over_useful,
                        "idle_ms": list(tl.idle),
                        "tokens_per_s": m * tokens_mb / (tl.makespan / 1e3),
                        "peak_activations": peak,
                        "peak_act_gib": None if layer.get("act_mib") is None else
                        peak * share * layer["act_mib"] / 1024,
                        **({"memory": memory} if name == "zbv" else {})})
                base = next((r["step_ms"] for r in group if r["schedule"] == "1f1b"), None)
                for r in group:
                    r["speedup_vs_1f1b"] = base / r["step_ms"] if base else None
                rows += group
    return rows


def refresh(rows: Sequence[dict], **kw) -> list[dict]:
    """`rows` (a results file's) with their "sim" rows replaced by `simulate_rows` of
    their own measurement; `kw` as `simulate_rows` takes them."""
    kept = [r for r in rows if r.get("kind") != "sim"]
    return kept + simulate_rows(kept, **kw)
