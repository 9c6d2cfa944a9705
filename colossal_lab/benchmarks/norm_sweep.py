"""The fused-norm sweep: its cases, a time estimate, chunked commands, the run, targets.

`--group rms_norm` (the hidden-size sweep, bf16 and fp32, -> fused_norm.json) and
`--group models` (LayerNorm, add+RMSNorm, SwiGLU at LLaMA sizes ->
fused_norm_models.json), graph-replay and eager timings in every row and the host
time per call, run in chunks under a per-command time limit (`harness.pack`).
"""

from __future__ import annotations

import gc
import warnings

import torch

from colossal_lab.benchmarks import norm_measure as nm
from colossal_lab.benchmarks.harness import Invocation, pack
from colossal_lab.measure.hardware import measure_copy_gbps

HOST_SHAPES = ((16, 2048), (16, 16384))
"""(tokens, hidden) of the host-time rows: few tokens, so the GPU drains the queue
faster than the host fills it and the loop times the host alone."""
HOST_CALLS = 200
"""fwd+bwd calls per host-time loop."""
GROUPS = {"rms_norm": "fused_norm", "models": "fused_norm_models"}
"""--group: "rms_norm", the hidden-size sweep (HIDDEN + ODD_HIDDEN x TOKENS x DTYPES);
"models": LayerNorm, add+RMSNorm and SwiGLU at MODEL_SIZES x TOKENS x DTYPES. The
value is the results file each saves to by default (`--name`)."""
CHUNK_BUDGET_S = 300.0
"""--dry-run's chunks: estimated GPU seconds per command line, well under a 600 s limit
(the estimate leaves out Triton's JIT and process start-up)."""
SWEEP_PROVIDERS = ("torch", "triton", "triton-native", "liger")
"""Providers of the sweep (those installed): ours against the library kernels. For
RMSNorm, "triton-native" is ours as it ships (the C++ path of `kernels.native`, the
default on CUDA) and "triton" the same kernels launched from Python (the path the C++
one replaces per call; for the other ops "triton" is ours as it ships)."""
SWEEP_EAGER_AT = (16384, "bfloat16")
"""(tokens, dtype) at which the default sweep also times "eager", the unfused reference
Hugging Face runs: one row per hidden size, for chapter 02's fused-against-eager
comparison. Everywhere would cost more GPU time than the rest of the sweep."""
EST_FIXED_S, EST_REPLAYS, EST_START_S = 1.5, 400, 20.0
"""--dry-run's estimate per provider and case: set-up, JIT and captures (s), plus this
many passes over the case's fwd+bwd bytes at 3 TB/s (graph replays and do_bench); and
per command: start-up, the copy ceiling and the host-time rows (s)."""



# ------------------------------------------------------------------ the sweep, in chunks


def sweep_cases(group: str = "rms_norm", *, hidden=None, tokens=None, dtypes=nm.DTYPES,
                ops=None) -> list[tuple[str, int, int, str]]:
    """(op, tokens, hidden, dtype) of a `--group` (see GROUPS), headline case first
    (the compile provider's static graph), then by dtype, hidden, tokens. `hidden`
    and `tokens` replace the group's sizes (for every op: name one with `ops`)."""
    if group == "rms_norm":
        widths = {"rms_norm": sorted(set(nm.HIDDEN) | set(nm.ODD_HIDDEN))}
    elif group == "models":
        h = sorted({m[0] for m in nm.MODEL_SIZES.values()})
        i = sorted({m[1] for m in nm.MODEL_SIZES.values()})
        widths = {"layer_norm": h, "add_rms_norm": h, "swiglu": i}
    else:
        raise ValueError(f"unknown group {group!r}; choose from {GROUPS}")
    cases = [(op, t, h, d) for op, hs in widths.items() for d in dtypes
             for h in (hidden or hs) for t in (tokens or nm.TOKENS)
             if ops is None or op in ops]
    return sorted(cases, key=lambda c: ((c[1], c[2]) != nm.HEADLINE or c[3] != "bfloat16",
                                        c[0], nm.DTYPES.index(c[3]) if c[3] in nm.DTYPES else 9,
                                        c[2], c[1]))


def skip_reason(op: str, tokens: int, hidden: int, dtype: str) -> str | None:
    """Why a case is not run (its memory), or None."""
    nbytes = nm._case_bytes(op, tokens, hidden, getattr(torch, dtype).itemsize)
    if nbytes > nm.MAX_CASE_BYTES:
        return (f"inputs, outputs and gradients need {nbytes / 2**30:.1f} GiB > "
                f"MAX_CASE_BYTES {nm.MAX_CASE_BYTES / 2**30:.0f} GiB")
    return None


def estimate_s(case, n_providers: int) -> float:
    """Rough GPU seconds of one case (`EST_FIXED_S`, `EST_REPLAYS`); 0 when skipped."""
    op, t, h, d = case
    if skip_reason(*case):
        return 0.0
    fwd, bwd = nm.moved_bytes(op, t, h, getattr(torch, d).itemsize)
    return n_providers * (EST_FIXED_S + EST_REPLAYS * (fwd + bwd) / 3e12)


def plan_chunks(cases, n_providers: int, budget_s: float = CHUNK_BUDGET_S
                ) -> list[list]:
    """Cases split, in order, into chunks whose estimates (`chunk_estimate_s`) stay
    under `budget_s` (`harness.pack`), each a whole (op, dtype, hidden) so that
    `--hidden`/`--dtypes`/`--ops` can name it."""
    groups = list(_by(cases, lambda c: (c[0], c[3], c[2])).values())
    chunks = pack(groups, lambda gs: chunk_estimate_s([c for g in gs for c in g],
                                                      n_providers), budget_s)
    return [[c for g in chunk for c in g] for chunk in chunks]


def chunk_estimate_s(chunk, n_providers: int) -> float:
    """Estimated seconds of one chunk's command line, each command's start-up included."""
    commands = len({(c[0], c[3]) for c in chunk})
    return commands * EST_START_S + sum(estimate_s(c, n_providers) for c in chunk)


def chunk_command(chunk, group: str, name: str, first: bool = False,
                  extra: str = "") -> str:
    """The command line that runs `chunk` (one op and dtype per command, with the
    chunk's hidden sizes and token counts named); all but the `first` command of a run
    append to the results file (--resume). `extra`: flags every command carries (the
    run's --providers, and --resume/--redo when the run continues a saved sweep)."""
    parts = []
    for (op, d), cs in _by(chunk, lambda c: (c[0], c[3])).items():
        hs = " ".join(str(h) for h in dict.fromkeys(c[2] for c in cs))
        ts = " ".join(str(t) for t in sorted({c[1] for c in cs}))
        resume = "" if first and not parts or "--resume" in extra.split() else \
            " --resume"
        parts.append(f"python -m colossal_lab bench fused_norm --group {group} "
                     f"--ops {op} --dtypes {d} --hidden {hs} --tokens {ts} "
                     f"--name {name}{resume}{extra and ' ' + extra}")
    return " && ".join(parts)


def _by(items, key) -> dict:
    out: dict = {}
    for it in items:
        out.setdefault(key(it), []).append(it)
    return out


def dry_run(cases, providers, group: str, name: str,
            budget_s: float = CHUNK_BUDGET_S, extra: str = "") -> str:
    """The case list, what is skipped and why, the estimated GPU time, and command
    lines that run it in chunks of < `budget_s`: the first starts the results file
    afresh, the others append (--resume; so does a chunk run again after a cut).
    `extra`: flags every command carries (`chunk_command`); with --resume in it, the
    first command continues the saved file too."""
    n = len(providers)
    lines = [f"fused_norm --group {group}: {len(cases)} cases x {n} providers "
             f"({', '.join(providers)})"]
    for c in cases:
        why = skip_reason(*c)
        lines.append(f"  {c[0]:<13}{c[1]:>6} x {c[2]:<6}{c[3]:<9}"
                     + (f" skipped: {why}" if why else f" ~{estimate_s(c, n):.0f} s"))
    total = sum(estimate_s(c, n) for c in cases)
    chunks = plan_chunks(cases, n, budget_s)
    lines.append(f"estimate {total:.0f} s of GPU time (rough: {EST_FIXED_S} s per "
                 f"provider-case + {EST_REPLAYS} passes at 3 TB/s); {len(chunks)} "
                 f"chunks of < {budget_s:.0f} s:")
    lines += [f"  [{chunk_estimate_s(ch, n):.0f} s] "
              f"{chunk_command(ch, group, name, first=i == 0, extra=extra)}"
              for i, ch in enumerate(chunks)]
    return "\n".join(lines)


def case_key(r: dict) -> tuple:
    return (r.get("kind"), r.get("op"), r.get("provider"), r.get("tokens"),
            r.get("hidden"), r.get("dtype"))


def sweep(cases, providers=None, *, host: bool = True, on_row=None,
          done: set | None = None, host_shapes=None, host_calls: int | None = None
          ) -> list[dict]:
    """Every provider on every case, graph replay and eager side by side, each row
    with the copy ceiling measured once in this process; then, with `host`, the host
    time of every provider at `host_shapes` (default `HOST_SHAPES`, `HOST_CALLS` calls)
    for each op and dtype. `done` (case keys) is skipped; `on_row(rows)` gets the rows
    so far after each case (save them)."""
    host_shapes = host_shapes or HOST_SHAPES
    host_calls = host_calls or HOST_CALLS
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    done = done or set()
    copy = measure_copy_gbps(device=device)
    rows = [{"kind": "ceiling", "copy_gbps": copy}]  # also in every row: its run's

    def names(op, tokens=None, dtype=None):
        want = providers or SWEEP_PROVIDERS
        if op == "swiglu":
            return [p for p in ("torch", "compile", "triton") if p in want]
        if providers is None and (tokens, dtype) == SWEEP_EAGER_AT:
            want = ("eager", *want)
        return [p for p in nm.providers_here(op, device) if p in want]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for op, t, h, d in cases:
            dtype = getattr(torch, d)
            new = []
            free_gib = (torch.cuda.mem_get_info()[0] / 2**30 if device.type == "cuda"
                        else None)  # before the case: a leak shows as a falling column
            for p in names(op, t, d):
                if ("op", op, p, t, h, d) in done:
                    continue
                why = skip_reason(op, t, h, d)
                if why:
                    new.append({"kind": "op", "op": op, "provider": p, "tokens": t,
                                "hidden": h, "dtype": d, "skipped": why})
                    continue
                row = nm.measure(op, p, t, h, dtype, device)
                row.update(copy_gbps=copy, gpu_free_gib=free_gib)
                new.append(row)
            nm.eager_in_turns(op, new, t, h, dtype, device)
            for row in new:
                if "skipped" not in row:
                    print(nm.format_row(row), flush=True)
            rows += new
            if new and on_row is not None:
                on_row(rows)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        if host:
            for op, d in dict.fromkeys((c[0], c[3]) for c in cases):
                for t, h in host_shapes:
                    todo = [p for p in names(op) if ("host", op, p, t, h, d) not in done]
                    if not todo:
                        continue
                    new = nm.host_rows(op, todo, t, h, getattr(torch, d), device,
                                    calls=host_calls, repeats=5 if host_calls > 20 else 1)
                    for row in new:
                        print(f"  host {op:<13}{row['provider']:<14}{t:>6} x {h:<6}{d:<9}"
                              f"{row.get('host_us', float('nan')):8.1f} us", flush=True)
                    rows += new
                    if on_row is not None:  # saved shape by shape: a cut run keeps them
                        on_row(rows)
    return rows


# ------------------------------------------------------------------------ the targets


def targets(rows: list[dict], *, op: str = "rms_norm", min_eager_tokens: int = 16384,
            copy_share: float = 0.85, host_gap_us: float = 20.0, ours: str = "triton"
            ) -> list[dict]:
    """The targets, evaluated on sweep rows: one dict per check with `check`,
    `ok` (None when no row can tell), `worst` and where (`at`), and `failing`.

    `ours` is the provider held to them ("triton", the Python path; "triton-native",
    the C++ path RMSNorm ships with by default).

    1. graph replay: ours >= 1.0 x torch in fwd+bwd at every point;
    2. eager (do_bench) >= 1.0 x torch at every point with >= `min_eager_tokens`;
    3. ours >= `copy_share` of the copy bandwidth at 16384 x 4096 bf16, fwd+bwd;
    4. one eager fwd+bwd's host time within `host_gap_us` of torch's, at every host row.

    A point of check 1 where ours' or torch's fwd+bwd was not timed by graph replay
    (a capture failed and events timed it instead, `pass_timing`) fails the check
    ("not_graph_replay" in `failing`)."""
    ops = [r for r in rows if r.get("kind") == "op" and r.get("op") == op]
    pairs = {}
    for r in ops:
        pairs.setdefault((r["tokens"], r["hidden"], r["dtype"]), {})[r["provider"]] = r

    def ratio_check(name, field, keep, graph=False):
        worst, at, failing, n = None, None, [], 0
        for k, prov in sorted(pairs.items()):
            mine, ref = prov.get(ours, {}), prov.get("torch", {})
            if not keep(k, mine) or not mine.get(field) or not ref.get(field):
                continue
            n += 1
            other = {p: nm.pass_timing(r, field) for p, r in ((ours, mine), ("torch", ref))
                     if nm.pass_timing(r, field) != "cuda_graph"}
            if graph and other:  # a timing that fell back is a failed check, not a pass
                failing.append({"at": k, "not_graph_replay": other})
                continue
            x = ref[field] / mine[field]  # time ratio: > 1 means ours is faster
            if worst is None or x < worst:
                worst, at = x, k
            if x < 1.0:
                failing.append({"at": k, "ratio": round(x, 3)})
        return {"check": name, "ok": (not failing) if n else None, "points": n,
                "worst": worst, "at": at, "failing": failing}

    out = [ratio_check("graph replay fwd+bwd >= 1.0x torch at every point", "fwd_bwd_ms",
                       lambda k, r: True, graph=True),
           ratio_check(f"eager fwd+bwd >= 1.0x torch at >= {min_eager_tokens} tokens",
                       "eager_fwd_bwd_ms", lambda k, r: k[0] >= min_eager_tokens)]
    head = pairs.get((*nm.HEADLINE, "bfloat16"), {}).get(ours, {})
    share = (head["fwd_bwd_gbps"] / head["copy_gbps"]
             if head.get("fwd_bwd_gbps") and head.get("copy_gbps") else None)
    low = share is not None and share < copy_share
    out.append({"check": f">= {copy_share:.0%} of copy at {nm.HEADLINE[0]} x {nm.HEADLINE[1]} "
                         "bf16 fwd+bwd", "ok": None if share is None else not low,
                "points": int(share is not None), "worst": share,
                "at": (*nm.HEADLINE, "bfloat16"),
                "failing": [{"share": round(share, 3)}] if low else []})
    hosts = {}
    for r in rows:
        if r.get("kind") == "host" and r.get("op") == op and "host_us" in r:
            key = (r["tokens"], r["hidden"], r["dtype"])
            hosts.setdefault(key, {})[r["provider"]] = r
    gaps = [(k, v[ours]["host_us"] - v["torch"]["host_us"]) for k, v in
            sorted(hosts.items()) if ours in v and "torch" in v]
    worst_gap = max(gaps, key=lambda g: g[1], default=None)
    out.append({"check": f"eager fwd+bwd host time <= torch's + {host_gap_us:.0f} us",
                "ok": all(g <= host_gap_us for _, g in gaps) if gaps else None,
                "points": len(gaps), "worst": worst_gap[1] if worst_gap else None,
                "at": worst_gap[0] if worst_gap else None,
                "failing": [{"at": k, "gap_us": round(g, 1)} for k, g in gaps
                            if g > host_gap_us]})
    return out


def run_group(call: Invocation) -> None:
    """`--group`: the sweep, resumable, in chunks."""
    a, name = call.args, call.file_name
    if a.quick:  # CPU smoke test of the whole path: tiny shapes, nothing saved
        cases = sweep_cases(a.group, hidden=None, tokens=(8,), dtypes=a.dtypes,
                            ops=a.ops)
        cases = [(op, t, 100 if op != "swiglu" else 70, d) for op, t, h, d in cases
                 if h == min(c[2] for c in cases if c[0] == op)]
    else:
        cases = sweep_cases(a.group, hidden=a.hidden, tokens=a.tokens, dtypes=a.dtypes,
                            ops=a.ops)
    providers = a.providers  # None: the sweep's own (with "eager" at SWEEP_EAGER_AT)
    if a.dry_run:
        extra = [*(["--providers", *providers] if providers else []),
                 *(["--resume"] if a.resume else []), *(["--redo"] if a.redo else [])]
        print(dry_run(cases, providers or list(SWEEP_PROVIDERS), a.group, name,
                      extra=" ".join(extra)))
        return
    if a.quick:
        rows = sweep(cases, providers, host_shapes=((4, 64),), host_calls=3)
        for t in targets(rows):
            print(f"  {t['check']}: {t['ok']} (worst {t['worst']})")
        return
    config, kept = nm.config_of(group=a.group), []
    if a.resume:
        kept, config = call.resume(config, missing_ok=True,
                                   may_change=("eager_timing", "host_timing"),
                                   retry=measured_by(cases))
        if a.redo:
            kept = redo_rows(kept, cases)
        print(f"[fused_norm] resuming: {len(kept)} rows kept", flush=True)

    def save(rows):
        call.save(kept + rows, config=config, quiet=True)

    rows = sweep(cases, providers, on_row=save, done={case_key(r) for r in kept})
    save(rows)
    both = any(r.get("provider") == "triton-native" for r in kept + rows)
    for ours in ("triton", "triton-native") if both else ("triton",):
        for t in targets(kept + rows, ours=ours):
            print(f"  {ours}: {t['check']}: {t['ok']} (worst {t['worst']} at {t['at']})")
    print(f"saved {len(kept + rows)} rows")


def measured_by(cases):
    """Whether a run of `cases` measures a row: an op row of one of its cases, a host
    row of one of its (op, dtype) pairs (what `--redo` replaces, and the failed rows a
    resume may drop)."""
    points = {(op, t, h, d) for op, t, h, d in cases}
    pairs = {(op, d) for op, _, _, d in cases}

    def measures(r: dict) -> bool:
        if r.get("kind") == "op":
            return (r.get("op"), r.get("tokens"), r.get("hidden"), r.get("dtype")) in points
        return r.get("kind") == "host" and (r.get("op"), r.get("dtype")) in pairs

    return measures


def redo_rows(kept: list[dict], cases) -> list[dict]:
    """`kept` without the rows `--redo` measures again (`measured_by`)."""
    again = measured_by(cases)
    return [r for r in kept if not again(r)]


