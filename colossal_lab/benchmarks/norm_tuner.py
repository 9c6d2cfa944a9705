"""The fused norms' launch tuner: time each launch setting, keep the fastest in a table.

`bench fused_norm --tune` times tiles, warps, programs per SM and pipelining depth of
our RMSNorm and LayerNorm kernels per hidden bucket and dtype on the GPU at hand and
saves the rows (`results/<gpu>/fused_norm_tune.json`); `--write-table` keeps the
winners in `kernels/norm_table.json`, which `kernels._norm_common` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from colossal_lab.benchmarks.norm_measure import EPS, config_of, moved_bytes
from colossal_lab.kernels import _norm_common
from colossal_lab.kernels._norm_common import launch_config, next_power_of_2, persistent_programs
from colossal_lab.kernels.rms_norm import rms_norm_backward, rms_norm_forward
from colossal_lab.measure.hardware import measure_copy_gbps
from colossal_lab.measure.results import load_results, merge_rows, save_results
from colossal_lab.measure.timing import gbps, time_fn, time_kernels

TUNE_HIDDEN = (1024, 2048, 4096, 8192, 16384)
"""One hidden size per table bucket (`launch_config` keys by next_power_of_2(H)): the
power of two itself; sizes between two (5120, 13824) get their bucket's entry."""


TUNE_SMALL_TOKENS = 4096
"""At this many tokens or fewer `--tune` times whole launches for the table's
".../small" entries (`_tune_small`), which `launch_config` takes at up to
`_norm_common.SMALL_ROWS` rows; tune at 1024 tokens (the sweep's smallest)."""
MIN_ROWS_CANDIDATES = (1, 2, 4, 8, 16, 32)
TUNE_SMALL_ROWS = (1, 2, 4, 8)
"""Rows per tile `_tune_small` tries (those with rows x next_power_of_2(H) <= 16384)."""
TUNE_SMALL_WARPS = (2, 4, 8)
SMALL_MARGIN = 0.05
"""A ".../small" entry is written only where its launch beat the one that ran without
it (`_tune_small`'s "current" row, same run) by this share: at a few microseconds the
same launch timed twice differs by 2-3% (H200, 1024 x 1024)."""


def tune(tokens=(16384,), hidden=TUNE_HIDDEN, dtypes=(torch.bfloat16,)) -> list[dict]:
    """Time our RMSNorm launchers over their launch parameters (forward: rows per tile
    and warps; backward: also programs per SM, pipelining stages or our register
    prefetch; at <= `TUNE_SMALL_TOKENS` tokens the backward's rows per program) and
    print the best of each next to the default. `--write-table` turns the winners into
    `kernels/norm_table.json`. About 30 s per hidden size, dtype and token count on an
    H200."""
    if not torch.cuda.is_available():
        raise SystemExit("--tune times GPU kernels: it needs a CUDA device")
    device = torch.device("cuda")
    tokens = (tokens,) if isinstance(tokens, int) else tuple(tokens)
    rows = []
    for t in tokens:
        for dtype in dtypes:
            for h in hidden:
                rows += _tune_hidden(t, h, dtype, device)
                torch.cuda.empty_cache()
    rows.append({"kind": "ceiling", "tokens": None, "hidden": None, "dtype": None,
                 "copy_gbps": measure_copy_gbps(device=device)})
    return rows


def _timed(row: dict, nbytes: int, fn, *, graph: bool = False) -> dict:
    """A tuning row with its time and GB/s: eager (do_bench), or with `graph` by
    CUDA-graph replay (`time_kernels`, which says how in `timing`); a launch that cannot
    run (out of registers or shared memory) becomes an `error`."""
    try:
        if graph:
            t, row["timing"] = time_kernels(fn)
        else:
            t = time_fn(fn)
        row.update(ms=t.median_ms, gbps=gbps(nbytes, t.median_ms))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return row


def _tune_hidden(tokens: int, h: int, dtype, device) -> list[dict]:

    x = torch.randn(tokens, h, device=device).to(dtype)
    w = torch.randn(h, device=device).to(dtype)
    dy = torch.randn_like(x)
    _, rstd = rms_norm_forward(x, w, EPS)
    fwd_bytes, bwd_bytes = moved_bytes("rms_norm", tokens, h, dtype.itemsize)
    default = launch_config(h, dtype)
    base = {"kind": "tune", "tokens": tokens, "hidden": h,
            "dtype": str(dtype).replace("torch.", "")}

    rows = []
    if tokens <= TUNE_SMALL_TOKENS:
        return _tune_small(x, w, dy, rstd, base, fwd_bytes, bwd_bytes, device)
    candidates = sorted({1, max(1, default.rows // 2), default.rows, 2 * default.rows})
    for r in candidates:
        for nw in (4, 8, 16, 32):
            if r * default.block > 32768:
                continue
            cfg = launch_config(h, rows=r, num_warps=nw)
            rows.append(_timed({**base, "pass": "fwd", "rows": r, "num_warps": nw},
                               fwd_bytes,
                               lambda c=cfg: rms_norm_forward(x, w, EPS, config=c)))
            if nw == 32:
                continue
            for pps in (1, 2, 4):
                for stages, pf in ((1, False), (2, False), (1, True)):
                    row = {**base, "pass": "bwd", "rows": r, "num_warps": nw,
                           "programs_per_sm": pps, "num_stages": stages, "prefetch": pf}
                    rows.append(_timed(row, bwd_bytes, lambda c=cfg, p=pps, s=stages, f=pf:
                                      rms_norm_backward(dy, x, w, rstd, config=c,
                                                        programs_per_sm=p, num_stages=s,
                                                        prefetch=f)))
    _print_best(rows, base, default, ("fwd", "bwd"))
    return rows


def _small_candidates(n_rows: int, h: int, device) -> tuple[list, list]:
    """The launches `_tune_small` times: forward (rows, warps); backward (rows, warps,
    programs per SM, fewest rows per program), one per distinct grid."""

    block = next_power_of_2(h)
    tiles = [r for r in TUNE_SMALL_ROWS if r * block <= 16384]
    fwd = [(r, nw) for r in tiles for nw in TUNE_SMALL_WARPS]
    bwd, grids = [], set()
    for r in tiles:
        for nw in TUNE_SMALL_WARPS:
            for pps in (1, 2, 4):
                for m in MIN_ROWS_CANDIDATES:
                    programs = persistent_programs(n_rows, r, nw, device, pps, m)
                    if (r, nw, programs) not in grids:
                        grids.add((r, nw, programs))
                        bwd.append((r, nw, pps, m, programs))
    return fwd, bwd


def _tune_small(x, w, dy, rstd, base, fwd_bytes, bwd_bytes, device) -> list[dict]:
    """`--tune` at `TUNE_SMALL_TOKENS` tokens or fewer: whole launches (tile, warps and,
    for the backward, the grid), each timed by CUDA-graph replay with L2 flushed, as
    the sweep times the ops: a call here lasts a few microseconds, so eager timing
    would time the launches. The winners become the table's ".../small" entries
    (`_norm_common.SMALL_ROWS`). The launch that runs without them is timed too
    (`current`)."""

    base = {**base, "kind": "tune-small"}  # its own kind: a save keeps the "tune" rows
    h, dtype = base["hidden"], x.dtype

    rows = []
    for pas in ("fwd", "bwd"):  # what runs without tuning, for the printout
        cfg = launch_config(h, dtype, backward=pas == "bwd", small=True)
        row = {**base, "pass": pas, "rows": cfg.rows, "num_warps": cfg.num_warps,
               "current": cfg.source}
        if pas == "bwd":
            row.update(programs_per_sm=cfg.programs_per_sm,
                       min_rows_per_program=cfg.min_rows_per_program,
                       num_stages=cfg.num_stages, prefetch=cfg.prefetch,
                       programs=persistent_programs(x.shape[0], cfg.rows, cfg.num_warps,
                                                    device, cfg.programs_per_sm,
                                                    cfg.min_rows_per_program))
        rows.append(_timed(row, fwd_bytes if pas == "fwd" else bwd_bytes,
                           (lambda c=cfg: rms_norm_forward(x, w, EPS, config=c))
                           if pas == "fwd" else
                           (lambda: rms_norm_backward(dy, x, w, rstd)), graph=True))
    fwd, bwd = _small_candidates(x.shape[0], h, device)
    for r, nw in fwd:
        cfg = launch_config(h, rows=r, num_warps=nw)
        rows.append(_timed({**base, "pass": "fwd", "rows": r, "num_warps": nw}, fwd_bytes,
                           lambda c=cfg: rms_norm_forward(x, w, EPS, config=c), graph=True))
    for r, nw, pps, m, programs in bwd:
        cfg = launch_config(h, rows=r, num_warps=nw)
        row = {**base, "pass": "bwd", "rows": r, "num_warps": nw, "programs_per_sm": pps,
               "min_rows_per_program": m, "num_stages": 1, "prefetch": False,
               "programs": programs}
        rows.append(_timed(row, bwd_bytes, lambda c=cfg, p=pps, mr=m: rms_norm_backward(
            dy, x, w, rstd, config=c, programs_per_sm=p, num_stages=1, min_rows=mr,
            prefetch=False), graph=True))
    for pas in ("fwd", "bwd"):
        cur = next(r for r in rows if r["pass"] == pas and "current" in r)
        ok = [r for r in rows if r["pass"] == pas and "current" not in r and "ms" in r]
        best = min(ok, key=lambda r: r["ms"], default=None)
        if best is not None and "ms" in cur:
            print(f"  {base['tokens']} x {h:<6} {base['dtype']} {pas} (small): current "
                  f"{cur['ms'] * 1e3:.2f} us ({cur['current']}); best "
                  f"{best['ms'] * 1e3:.2f} us {_launch_of(best)}", flush=True)
    return rows


def _launch_of(row: dict) -> dict:
    keys = ("rows", "num_warps", "programs_per_sm", "min_rows_per_program", "programs")
    return {k: row[k] for k in keys if k in row}


def _print_best(rows, base, default, passes) -> None:
    for pas in passes:
        ok = [r for r in rows if r["pass"] == pas and "gbps" in r]
        best = max(ok, key=lambda r: r["gbps"], default=None)
        print(f"  {base['tokens']} x {base['hidden']:<6} {base['dtype']} {pas}: default "
              f"{default}; best {best}", flush=True)


def save_tune(name: str, rows: list[dict], command: str) -> Path:
    """Save tuning rows into `results/<gpu>/<name>.json`, replacing the (hidden, dtype)
    an earlier invocation measured and keeping the others: --tune runs in chunks."""

    merged = merge_rows(name, rows, ("kind", "tokens", "hidden", "dtype"))
    return save_results(name, merged, config=config_of(dtype="per row"), command=command)


def table_from_tune(rows: list[dict]) -> dict[str, dict[str, int]]:
    """The fastest launch per (bucket, dtype, pass) of tuning rows, keyed as
    `_norm_common.table_entry` looks it up: "<next_power_of_2(H)>/<dtype>/<pass>".
    Tile, warps, programs per SM and stages come from the largest token count tuned;
    a backward's `min_rows_per_program` from the smallest one tuned for it (rows that
    vary it alone, from before `_tune_small`). Whole launches tuned at few tokens
    (`_tune_small`'s rows) give "<bucket>/<dtype>/<pass>/small", the fastest at the
    smallest token count tuned, where it beats the "current" launch by `SMALL_MARGIN`;
    where it does not and the current launch was itself a small entry, that one stays
    (so a second tune does not drop an entry its own winner could not clearly beat)."""

    def key(r):
        return f"{next_power_of_2(r['hidden'])}/{r.get('dtype', 'bfloat16')}/{r['pass']}"

    tuned = [r for r in rows if r.get("kind") in ("tune", "tune-small") and r.get("gbps")
             and "current" not in r]
    current = {(key(r), r["tokens"]): r for r in rows
               if r.get("kind") == "tune-small" and "current" in r and r.get("ms")}
    best: dict[str, dict] = {}
    small: dict[str, dict] = {}
    few: dict[str, dict] = {}  # whole launches tuned at few tokens: ".../small"
    for r in tuned:
        k = key(r)
        if r["kind"] == "tune-small":
            cur = few.get(k)
            if cur is None or (r["tokens"], -r["gbps"]) < (cur["tokens"], -cur["gbps"]):
                few[k] = r
            continue
        if "min_rows_per_program" in r:
            cur = small.get(k)
            if cur is None or (r["tokens"], -r["gbps"]) < (cur["tokens"], -cur["gbps"]):
                small[k] = r
            continue
        cur = best.get(k)
        if cur is None or (r.get("tokens", 0), r["gbps"]) > (cur.get("tokens", 0),
                                                             cur["gbps"]):
            best[k] = r
    fields = {"fwd": ("rows", "num_warps"),
              "bwd": ("rows", "num_warps", "programs_per_sm", "num_stages", "prefetch")}
    table = {k: {f: r[f] for f in fields[r["pass"]] if f in r} for k, r in best.items()}
    for k, r in small.items():
        table.setdefault(k, {})["min_rows_per_program"] = r["min_rows_per_program"]
    fields["bwd"] += ("min_rows_per_program",)
    for k, r in few.items():
        cur = current.get((k, r["tokens"]))
        if cur is None or r["ms"] <= cur["ms"] * (1 - SMALL_MARGIN):
            win = r  # a clear win over the launch that ran
        elif str(cur["current"]).endswith("/small"):
            win = cur  # the small entry that ran stays unless clearly beaten
        else:
            continue
        table[f"{k}/small"] = {f: win[f] for f in fields[r["pass"]]
                               if win.get(f) is not None}
    return dict(sorted(table.items()))


def write_table(tune_name: str = "fused_norm_tune", path: Path | None = None) -> Path:
    """Rewrite `colossal_lab/kernels/norm_table.json` (or `path`) with the tuned entries
    of the GPU whose `results/<gpu>/<tune_name>.json` is found (this GPU's, else the
    reference's), keeping other GPUs' entries."""
    res = load_results(tune_name)
    gpu = res.provenance["gpu"]  # torch's device name: what `launch_config` looks up
    path = path or _norm_common.TABLE_PATH
    tables = {**_norm_common.load_tables(_norm_common.TABLE_PATH),
              gpu: table_from_tune(res.rows)}
    doc = {"source": f"from {res._file_label()}, commit "
                     f"{str(res.provenance.get('git_sha'))[:10]}",
           "tables": tables}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path
