"""Switch 2's benchmark: fused normalisation, every provider side by side in one process.

Ops `rms_norm`, `layer_norm`, `add_rms_norm` (and `swiglu` in the sweep); providers
eager / torch / compile / triton / liger / apex, in effective GB/s against the copy
ceiling (`norm_measure`). `--group` runs the chunked sweep (`norm_sweep`), `--tune` and
`--write-table` the launch tuner (`norm_tuner`), `--host-parts` our host time by part.

    python -m colossal_lab bench fused_norm          # -> results/<gpu>/fused_norm.json
    python -m colossal_lab bench fused_norm --quick  # tiny shapes, CPU smoke test
    python -m colossal_lab bench fused_norm --group rms_norm --dry-run   # cases, chunks
    python -m colossal_lab bench fused_norm --tune --dtypes bfloat16 float32
    python -m colossal_lab bench fused_norm --write-table  # -> kernels/norm_table.json
"""

from __future__ import annotations

import warnings

import torch

from colossal_lab.benchmarks.harness import Benchmark, Invocation, flag, opt
from colossal_lab.benchmarks.norm_measure import (  # noqa: F401  (the module's names)
    DTYPES,
    EPS,
    HEADLINE,
    HIDDEN,
    MAX_CASE_BYTES,
    MODEL_SIZES,
    ODD_HIDDEN,
    OPS,
    PROVIDERS,
    TOKENS,
    _backward_only,
    _case_bytes,
    _eager_calls,
    _inputs,
    _num,
    _provider_fn,
    _Traffic,
    config_of,
    eager_in_turns,
    format_row,
    host_parts,
    host_rows,
    measure,
    moved_bytes,
    pass_timing,
    providers_here,
    traffic_bytes,
)
from colossal_lab.benchmarks.norm_sweep import (  # noqa: F401
    CHUNK_BUDGET_S,
    GROUPS,
    HOST_CALLS,
    HOST_SHAPES,
    SWEEP_EAGER_AT,
    SWEEP_PROVIDERS,
    chunk_estimate_s,
    dry_run,
    estimate_s,
    plan_chunks,
    redo_rows,
    run_group,
    skip_reason,
    sweep,
    sweep_cases,
    targets,
)
from colossal_lab.benchmarks.norm_tuner import (  # noqa: F401
    TUNE_HIDDEN,
    save_tune,
    table_from_tune,
    tune,
    write_table,
)
from colossal_lab.measure.hardware import measure_copy_gbps

# ---------------------------------------------------------------------------------- run


RUN_HIDDEN, RUN_TOKENS = (1024, 2048, 4096, 8192, 16384), (4096, 16384, 65536)
"""`run`'s grid: every provider, bf16 (the chunked sweep is `norm_sweep`)."""
NORM_OPS = OPS[:3]
"""`run`'s ops: the norms (SwiGLU is in the sweep's "models" group)."""


def run(quick: bool = False, *, ops=NORM_OPS, providers=None, hidden=RUN_HIDDEN,
        tokens=RUN_TOKENS, dtype=torch.bfloat16) -> list[dict]:
    """Every provider on every case, side by side in this process, plus the copy
    ceiling and the eager reference's counted traffic.

    `quick`: tiny shapes, providers eager / torch / triton (a CPU smoke test).
    LayerNorm and the fused add run at the headline token count only (every hidden
    size): the token grid is RMSNorm's, which is what LLaMA runs.
    The headline case (16384 x 4096) runs first, so "compile" specialises its first,
    static graph to it; later shapes reuse dynamo's dynamic-shape recompilation, as a
    user's training run would.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick:
        hidden, tokens = (64, 100), (8,)
        providers = providers or ("eager", "torch", "triton", "separate")
    cases = sorted(((t, h) for h in hidden for t in tokens),
                   key=lambda c: (c != HEADLINE, c[1], c[0]))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dtype and fallback notices
        for op in ops:
            names = [p for p in providers_here(op, device)
                     if providers is None or p in providers]
            for t, h in cases:
                if _case_bytes(op, t, h, dtype.itemsize) > MAX_CASE_BYTES:
                    continue
                if op != "rms_norm" and not quick and t != HEADLINE[0]:
                    continue  # the full token grid for RMSNorm; the others at one size
                for p in names:
                    row = measure(op, p, t, h, dtype, device)
                    rows.append(row)
                    print(format_row(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for op in ops:
            t, h = HEADLINE if not quick else (cases[0])
            traffic = traffic_bytes(op, t, h, dtype)
            fused = moved_bytes(op, t, h, dtype.itemsize)
            rows.append({"kind": "traffic", "op": op, "provider": "eager", "tokens": t,
                         "hidden": h, "dtype": str(dtype).replace("torch.", ""),
                         **traffic, "fused_fwd_bytes": fused[0],
                         "fused_bwd_bytes": fused[1]})
    rows.append({"kind": "ceiling", "copy_gbps": measure_copy_gbps(device=device)})
    print(summary(rows))
    return rows


def summary(rows: list[dict], tokens: int | None = None, hidden: int | None = None
            ) -> str:
    """Compact table at the headline shape (default: 16384 x 4096, else the largest
    measured): GB/s forward, backward, both; ratios against torch and the copy ceiling."""
    ops = [r for r in rows if r.get("kind") == "op"]
    if not ops:
        return "(no measurements)"
    ceiling = next((r["copy_gbps"] for r in rows if r.get("kind") == "ceiling"), None)
    if tokens is None:
        shapes = {(r["tokens"], r["hidden"]) for r in ops}
        tokens, hidden = HEADLINE if HEADLINE in shapes else max(shapes)
    copy = f"copy ceiling {ceiling:.0f} GB/s" if ceiling else "no copy ceiling"
    lines = [f"fused_norm at {tokens} x {hidden} ({ops[0]['dtype']}), effective GB/s; "
             f"{copy}"]
    lines.append(f"  {'op':<13}{'provider':<10}{'fwd':>7}{'bwd':>7}{'f+b':>7}"
                 f"{'f+b/torch':>11}{'f+b/copy':>10}")
    for op in OPS:
        sel = [r for r in ops
               if r["op"] == op and (r["tokens"], r["hidden"]) == (tokens, hidden)]
        torch_row = next((r for r in sel if r["provider"] == "torch"), None)
        for r in sel:
            if r.get("fwd_bwd_gbps") is None:
                lines.append(f"  {op:<13}{r['provider']:<10} failed")
                continue
            vs_torch = (r["fwd_bwd_gbps"] / torch_row["fwd_bwd_gbps"]
                        if torch_row and torch_row.get("fwd_bwd_gbps") else None)
            vs_copy = r["fwd_bwd_gbps"] / ceiling if ceiling else None

            ratio = f"{vs_torch:10.2f}x" if vs_torch is not None else "-".rjust(11)
            share = f"{vs_copy:10.0%}" if vs_copy is not None else "-".rjust(10)
            lines.append(f"  {op:<13}{r['provider']:<10}{_num(r['fwd_gbps'], 7)}"
                         f"{_num(r['bwd_gbps'], 7)}{_num(r['fwd_bwd_gbps'], 7)}"
                         f"{ratio}{share}")
    return "\n".join(lines)


def _host_parts(call: Invocation) -> None:
    """`--host-parts`: our RMSNorm's host time, part by part."""
    rows = [r for d in call.args.dtypes for r in host_parts(dtype=getattr(torch, d))]
    for r in rows:
        print(f"  {r['dtype']:<9}{r['us']:9.2f} us  {r['part']}")
    if not call.args.quick:
        call.save(rows, name=f"{call.file_name}_host", config=config_of(dtype="per row"))


def _tune(call: Invocation) -> None:
    """`--tune`: the launch-parameter sweep of our kernels, merged into the saved one."""
    a = call.args
    rows = tune(tuple(a.tokens) if a.tokens else (16384,),
                tuple(a.hidden) if a.hidden else TUNE_HIDDEN,
                dtypes=tuple(getattr(torch, d) for d in a.dtypes))
    print(f"saved {save_tune(f'{call.file_name}_tune', rows, call.command)}")


def _execute(call: Invocation) -> None:
    a = call.args
    if a.host_parts:
        _host_parts(call)
    elif a.write_table:
        print(f"wrote {write_table(f'{call.file_name}_tune')}")
    elif a.tune:
        _tune(call)
    elif a.group is not None:
        run_group(call)
    else:
        rows = run(a.quick, ops=tuple(a.ops or NORM_OPS), providers=a.providers,
                   hidden=tuple(a.hidden or RUN_HIDDEN), tokens=tuple(a.tokens or RUN_TOKENS))
        if not a.quick:
            call.save(rows)


def _check(a) -> str | None:
    if a.redo and not (a.resume and a.group) and not (a.host_parts or a.write_table
                                                      or a.tune):
        return "--redo replaces rows of a saved sweep: it goes with --group and --resume"
    if a.group is None and (a.resume or a.dry_run) and not (a.host_parts or a.write_table
                                                            or a.tune):
        return "--resume and --dry-run go with --group (the chunked sweep)"
    return None


BENCH = Benchmark(
    "fused_norm", __doc__, quick_help="tiny shapes (CPU smoke test)",
    options=[
        opt("--tune", action="store_true", help="launch-parameter sweep (GPU)"),
        opt("--write-table", action="store_true",
            help="write kernels/norm_table.json from results/<gpu>/<name>_tune.json"),
        opt("--group", choices=list(GROUPS),
            help="the chunked sweep: graph and eager timings, host time"),
        opt("--ops", nargs="*", choices=OPS), flag("providers", choices=PROVIDERS),
        opt("--hidden", nargs="*", type=int, help=f"default {HIDDEN} + {ODD_HIDDEN}"),
        opt("--tokens", nargs="*", type=int, help=f"default {TOKENS}"),
        opt("--dtypes", nargs="*", choices=DTYPES, default=list(DTYPES)),
        flag("resume", help="keep the cases already in results/<gpu>/<name>.json (same "
             "config), measure and append the rest"),
        flag("redo", help="with --resume: measure the selected cases (--ops, --hidden, "
             "--tokens, --dtypes) again, and the host rows of their ops and dtypes, "
             "replacing the rows kept for them"),
        opt("--host-parts", action="store_true",
            help="host time of our RMSNorm's parts vs F.rms_norm (tiny shape)"),
        flag("dry_run", help="print the cases, a time estimate and chunked commands; "
             "no GPU"),
        flag("name", help="results file name (keep partial runs apart); default "
             f"fused_norm, with --group {GROUPS}")],
    file_name=lambda a: a.name or GROUPS.get(a.group, "fused_norm"),
    config=lambda a: config_of(), check=_check, execute=_execute)
main = BENCH.main

if __name__ == "__main__":
    main()
