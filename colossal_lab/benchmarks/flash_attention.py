"""Switch 1's micro-benchmark: every attention backend side by side, in one process."""

from __future__ import annotations

import contextlib
import os
import shlex
import time
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from colossal_lab.benchmarks.flash_attention_cases import (  # noqa: F401  (the module's)
    CANONICAL,
    CANONICAL_EXTRAS,
    CAUSAL_CHOICES,
    FLEX_COMPILE,
    FWD_BWD_FACTOR,
    GRAPH_MS,
    HEAD_DIMS,
    HIDDEN,
    HOPPER_VARIANTS,
    LAYOUTS,
    MEM_PROVIDERS,
    MEM_SEQ_LENS,
    NAIVE_LIMIT_GIB,
    OUR_VARIANTS,
    PROVIDERS,
    QUICK_PROVIDERS,
    SEQ_LENS,
    SWEEP_PROVIDERS,
    TIMINGS,
    TOKENS,
    Case,
    _static_skip,
    attention_flops,
    calibration,
    chunk_argv,
    config_of,
    dry_run,
    estimate_s,
    measured_keys,
    merged,
    naive_gib,
    pending,
    plan_chunks,
    provider_s,
    redone,
    row_key,
    sweep_cases,
)
from colossal_lab.benchmarks.flash_attention_report import summary, targets, targets_summary  # noqa: F401
from colossal_lab.benchmarks.harness import Benchmark, Invocation, flag, opt
from colossal_lab.fallback import STRICT_ENV
from colossal_lab.kernels.flash_attention import (
    flash_attention,
    kernel_plan,
    tuned_configs,
)
from colossal_lab.measure.timing import (
    Timing,
    in_turns,
    peak_memory_gib,
    reset_peak_memory,
    tflops,
    time_fn,
    time_kernels,
)
from colossal_lab.ops.attention import BACKENDS, _why_not, attention, attention_ref

NAME = "flash_attention"

# ------------------------------------------------------------------------ measuring


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401  # lazy: optional package
    except ImportError:
        return False
    return True


_FLEX_COMPILED: dict = {}
"""The dynamic-shape compile of `flex_attention` in use and the (D, causal, group,
dtype, device) it serves: the sweep's cases run in that order, so one compile serves
every sequence length (and batch) of a series."""


def _flex_fn(q, k, v, causal: bool, static: bool = False) -> Callable[[], torch.Tensor]:
    """FlexAttention on these tensors. "flex" (`static` False) compiles once per (head
    dim, causal, group, dtype) with dynamic shapes (`FLEX_COMPILE`); "flex-static"
    compiles for this one shape, as a single-shape user would."""

    series = (q.shape[-1], causal, q.shape[1] // k.shape[1], q.dtype, q.device)
    if static:
        torch.compiler.reset()  # one static compile; no recompile limit to hit
        _FLEX_COMPILED.clear()
        compiled = torch.compile(flex_attention, dynamic=False)
    else:
        if _FLEX_COMPILED.get("series") != series:
            torch.compiler.reset()  # a new series: its own compile, no stale entries
            _FLEX_COMPILED.update(series=series,
                                  fn=torch.compile(flex_attention, dynamic=True))
        compiled = _FLEX_COMPILED["fn"]
    s = q.shape[-2]
    block_mask = None
    if causal:
        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(causal_mask, None, None, s, s, device=q.device)
    # grouped-query: Flex reads each key/value head for its Hq/Hkv query heads itself
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return lambda: compiled(q, k, v, block_mask=block_mask, **extra)


def make_fn(provider: str, q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    """A zero-argument forward for `provider` on these tensors. Grouped-query inputs
    (k, v with Hkv < Hq heads) go in as they are: our kernels take them natively, SDPA
    (flash, efficient, cuDNN) gets `enable_gqa=True` (`switches.attention._sdpa`), Flex
    `enable_gqa=True`; nothing copies k or v up to Hq heads except naive."""
    if provider in ("flex", "flex-static"):
        return _flex_fn(q, k, v, causal, static=provider == "flex-static")
    if provider in OUR_VARIANTS:

        return lambda: flash_attention(q, k, v, causal, **OUR_VARIANTS[provider])

    return lambda: attention(q, k, v, causal, backend=provider)


def _skip_reason(provider: str, case: Case, device: torch.device,
                 dtype: torch.dtype) -> str | None:
    """Why `provider` cannot run `case` here (None: try it). What the attention switch
    would fall back from (`switches.attention._why_not`) is a skip, never a run of
    another backend under this provider's name."""
    why = _static_skip(provider, case)
    if why:
        return why
    if provider == "flash_attn" and not _flash_attn_installed():
        return "not installed"
    if provider in ("flex", "flex-static") and device.type != "cuda":
        return "needs CUDA"

    if provider in HOPPER_VARIANTS and (
            device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9):
        return "needs a Hopper GPU"
    name = "triton" if provider in OUR_VARIANTS else provider
    if name in BACKENDS:
        return _why_not(name, device, dtype, case.head_dim)
    return None


@contextlib.contextmanager
def _strict():
    """Strict mode (`fallback.STRICT_ENV`) while timing: a backend that cannot run
    raises instead of quietly handing over to SDPA."""

    old = os.environ.get(STRICT_ENV)
    os.environ[STRICT_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(STRICT_ENV, None)
        else:
            os.environ[STRICT_ENV] = old


def _why_failed(e: Exception, caught: list) -> str:
    """The error of a provider's first call, with what PyTorch warned just before it:
    SDPA restricted to one kernel raises only "No available kernel" and says why in
    warnings ("... not used because ...")."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    reasons = [str(w.message).strip().splitlines()[0] for w in caught
               if "because" in str(w.message) or "Expected" in str(w.message)]
    if reasons:
        text += " [" + "; ".join(dict.fromkeys(r[:160] for r in reasons)) + "]"
    return text[:400]


class _FirstCallFailed(Exception):
    """A provider's first call raised; the message is `_why_failed`'s."""


def _first_call(fn: Callable[[], object]):
    """`fn()`, its failure raised as `_FirstCallFailed` with PyTorch's warnings of the
    call (`_why_failed`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except Exception as e:
            raise _FirstCallFailed(_why_failed(e, caught)) from e


def _reps(fn: Callable[[], object]) -> int:
    """Graph replays for `fn`: as many as fit `GRAPH_MS`, 20 to 100."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    return min(100, max(20, int(GRAPH_MS / max(ms, 1e-3))))


def time_provider(fn: Callable[[], object], device: torch.device, timing: str = "graph",
                  quick: bool = False) -> tuple[Timing, str]:
    """(timing, how it was taken) of `fn`: see `TIMINGS`; on a CPU a loop
    ("perf_counter")."""
    if timing not in TIMINGS:
        raise ValueError(f"timing={timing!r}; choose from {TIMINGS}")
    if device.type != "cuda":
        t = time_fn(fn, device=device, **({"cpu_warmup": 1, "cpu_reps": 2} if quick else {}))
        return t, "perf_counter"
    if timing == "events":
        return time_fn(fn, device=device), "events"
    return time_kernels(fn, device=device, reps=_reps(fn))


REF_SCORES_GIB = 1.0
"""Memory the fp32 reference's (B, H, rows, S) score matrix may take: at long sequences
it checks the last query rows only (`fp32_reference`)."""


def fp32_reference(q, k, v, causal: bool) -> tuple[torch.Tensor, int]:
    """(reference, rows): naive attention in fp32 on upcast inputs
    (`attention_ref(..., upcast=True)`) for the last `rows` query rows, as many as fit
    `REF_SCORES_GIB` of fp32 scores (all of them at short sequences).

    The last rows with the full keys are exactly those rows of the causal output:
    `attention_ref` aligns a shorter query block with the end of the keys."""

    b, h, s, _ = q.shape
    per_row = b * h * s * 4  # bytes of one query row of fp32 scores, all heads
    rows = max(1, min(s, int(REF_SCORES_GIB * 2**30 // per_row)))
    with torch.no_grad():
        ref = attention_ref(q[..., -rows:, :].detach(), k.detach(), v.detach(), causal,
                            upcast=True)
    return ref, rows


def measure_case(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool,
                 providers, *, kv_heads: int | None = None, dtype=torch.bfloat16,
                 device=None, quick: bool = False, timing: str = "graph") -> list[dict]:
    """Time every provider's fwd and fwd+bwd on one set of random tensors: q
    (B, H, S, D), k and v (B, Hkv, S, D) with Hkv = `kv_heads` (default H)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kv_heads = kv_heads or heads
    case = Case(batch, heads, kv_heads, seq_len, head_dim, causal, tuple(providers),
                dtype=str(dtype).replace("torch.", ""))
    q = torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype,
                    requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype,
                    requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    ref, ref_rows = fp32_reference(q, k, v, causal)
    flops = attention_flops(batch, heads, seq_len, head_dim, causal)
    rows = []
    for provider in providers:
        row = {"kind": "speed", "provider": provider, "batch": batch, "heads": heads,
               "kv_heads": kv_heads, "layout": case.layout, "seq_len": seq_len,
               "head_dim": head_dim, "causal": causal, "dtype": case.dtype}
        reason = _skip_reason(provider, case, device, dtype)
        if reason:
            rows.append({**row, "skipped": reason})
            print(_format(rows[-1]), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            with _strict():
                fwd = make_fn(provider, q, k, v, causal)

                def fwd_bwd(fwd=fwd):
                    torch.autograd.grad(fwd(), (q, k, v), do)

                if provider == "triton" or provider in OUR_VARIANTS:
                    row["kernels"] = kernel_plan(
                        q, k, v, OUR_VARIANTS.get(provider, {}).get("kernel"), causal)
                out = _first_call(fwd)  # compile / autotune outside the timed region
                # the error column: against naive attention in fp32 on the same (upcast)
                # inputs, over the last `ref_rows` query rows (the causal rows that see
                # the most keys); not against SDPA, whose default may be cuDNN itself
                row["max_abs_err_vs_fp32"] = (out[..., -ref_rows:, :].float() - ref
                                              ).abs().max().item()
                row["err_ref_rows"] = ref_rows
                del out
                # FLOPs next to the timing: fwd = 4·B·H·S²·D (× 0.5 causal), fwd+bwd =
                # 3.5 × fwd; Hkv does not change them (GQA saves memory traffic only)
                t_fwd, how_fwd = time_provider(fwd, device, timing, quick)
                row.update(fwd_ms=t_fwd.median_ms, fwd_tflops=tflops(flops, t_fwd.median_ms),
                           fwd_spread=round(t_fwd.spread, 3), timing=how_fwd)
                try:
                    _first_call(fwd_bwd)
                except _FirstCallFailed as e:  # a kernel with a forward only at this shape
                    row["fwd_bwd_error"] = str(e)[:400]
                else:
                    t_all, how_all = time_provider(fwd_bwd, device, timing, quick)
                    row.update(fwd_bwd_ms=t_all.median_ms,
                               fwd_bwd_tflops=tflops(FWD_BWD_FACTOR * flops, t_all.median_ms),
                               fwd_bwd_spread=round(t_all.spread, 3), reps=t_all.n,
                               timing="/".join(dict.fromkeys((how_fwd, how_all))))
        except Exception as e:  # one provider failing must not stop the others
            row["error"] = (str(e) if isinstance(e, _FirstCallFailed)
                            else f"{type(e).__name__}: {e}")[:400]
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(_format(row, row["wall_s"]), flush=True)
    return rows


def measure_memory(seq_len: int, providers=MEM_PROVIDERS, *, batch: int = 1, heads: int = 32,
                   head_dim: int = 128, causal: bool = True) -> list[dict]:
    """Peak memory of one fwd+bwd (inputs included) and what it adds over the inputs."""
    rows = []
    for provider in providers:
        row = {"kind": "memory", "provider": provider, "batch": batch, "heads": heads,
               "kv_heads": heads, "layout": "mha", "seq_len": seq_len,
               "head_dim": head_dim, "causal": causal, "dtype": "bfloat16"}
        if provider == "naive" and naive_gib(batch, heads, seq_len) > NAIVE_LIMIT_GIB:
            rows.append({**row, "skipped": "memory"})
            continue
        t0 = time.perf_counter()
        try:
            shape = (batch, heads, seq_len, head_dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            with _strict():
                fwd = make_fn(provider, q, k, v, causal)
                torch.autograd.grad(fwd(), (q, k, v), do)  # warm-up (autotuning allocates)
                reset_peak_memory()
                base = torch.cuda.memory_allocated() / 2**30
                torch.autograd.grad(fwd(), (q, k, v), do)
            torch.cuda.synchronize()
            peak = peak_memory_gib()
            row.update(peak_mem_gib=peak, extra_mem_gib=peak - base)
            del q, k, v, do
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        finally:
            torch.cuda.empty_cache()
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(_format(row), flush=True)
    return rows


def measure_in_turns(case: Case, rounds: int = 1, *, quick: bool = False,
                     timing: str = "graph") -> list[dict]:
    """`measure_case` of one case `rounds` times, the providers' order rotated from
    round to round, so that a drift of the clocks between one provider's timing and the
    next reaches them alike (each round on fresh random tensors); each provider's row is
    its first round's with `fwd_ms` / `fwd_bwd_ms` (and TFLOP/s) the median of the
    rounds that timed it, all of them kept in `*_ms_rounds`. One round: `measure_case`."""
    providers = list(case.providers)
    by_round = []
    for order in in_turns(providers, rounds):
        got = measure_case(case.batch, case.heads, case.seq_len, case.head_dim,
                           case.causal, order, kv_heads=case.kv_heads,
                           dtype=getattr(torch, case.dtype), quick=quick, timing=timing)
        by_round.append({row["provider"]: row for row in got})
    if rounds == 1:
        return list(by_round[0].values())
    flops = attention_flops(case.batch, case.heads, case.seq_len, case.head_dim,
                            case.causal)
    rows = []
    for p in providers:
        row = by_round[0][p]
        for key, factor in (("fwd", 1.0), ("fwd_bwd", FWD_BWD_FACTOR)):
            ms = [rnd[p].get(f"{key}_ms") for rnd in by_round]
            if None in ms:  # not timed in every round: the first round's stands
                continue
            row[f"{key}_ms_rounds"] = ms
            row[f"{key}_ms"] = sorted(ms)[len(ms) // 2]
            row[f"{key}_tflops"] = tflops(factor * flops, row[f"{key}_ms"])
        if "fwd_ms_rounds" in row:
            row["rounds"] = rounds
            row["timing"] = (f"{row.get('timing')}; median of {rounds} rounds, the case's "
                             "providers in turns")
            print(_format(row), flush=True)
        rows.append(row)
    return rows


def run_cases(cases: list[Case], *, quick: bool = False, timing: str = "graph",
              on_rows: Callable[[list[dict]], None] | None = None,
              rounds: int = 1) -> list[dict]:
    """Measure `cases` in order; one progress line per case with the time spent and an
    estimate of the time left (`estimate_s`, rescaled by how far off it was so far);
    `on_rows(rows_so_far)` after every case (for saving)."""
    rows: list[dict] = []
    est = [estimate_s(c) for c in cases]
    t_start = time.perf_counter()
    for i, case in enumerate(cases):
        spent = time.perf_counter() - t_start
        scale = spent / sum(est[:i]) if i else 1.0
        print(f"[flash_attention] {i + 1}/{len(cases)} {case.describe()}: "
              f"{' '.join(case.providers)}  ({spent:.0f} s in, ~{scale * sum(est[i:]):.0f} s "
              "left, estimated)", flush=True)
        if case.kind == "memory":
            rows += measure_memory(case.seq_len, case.providers, batch=case.batch,
                                   heads=case.heads, head_dim=case.head_dim,
                                   causal=case.causal)
        else:
            rows += measure_in_turns(case, rounds, quick=quick, timing=timing)
        if on_rows:
            on_rows(rows)
    print(f"[flash_attention] done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return rows


def run(quick: bool = False, *, head_dims=None, seq_lens=None, providers=None,
        layouts=None, causal: str = "both", memory: bool = True, timing: str = "graph",
        on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """The sweep (`sweep_cases` with these filters); `on_rows(rows_so_far)` is called
    after every case (for saving).

    `quick`: tiny fp32 shapes on whatever device there is, providers naive, sdpa and
    triton only, no memory rows (a CPU smoke test; its numbers mean nothing).

    Providers: naive (materialised scores), PyTorch SDPA forced to its flash, memory-efficient
    and cuDNN kernels, ours (`colossal_lab.kernels.flash_attention`: "triton" as it ships,
    which on Hopper picks the Gluon kernels per pass where they are faster, and its variants
    `OUR_VARIANTS`: the portable FlashAttention-2 alone, with FA2's atomic dQ, and the Hopper
    kernels everywhere in each forward schedule), FlexAttention under `torch.compile`, and
    `flash_attn` when it is installed. Each case
    (batch, heads, kv heads, seq_len, head_dim, causal) is set up once and every provider
    runs on the same tensors, so the ratios are what to read; absolute numbers drift between
    machines.

    The sweep keeps the work per query token fixed: B·S = 16384 tokens and
    H·D = 4096 (H = 32, 64, 16 at D = 128, 64, 256), S from 512 to 16384, causal and full,
    bf16, in three head layouts: MHA, GQA-4 (Hkv = H/4) and GQA-8 (Hkv = H/8). At every
    point: ours ("triton"), cuDNN, SDPA-flash and FlexAttention (`SWEEP_PROVIDERS`); at the
    canonical point B=4, H=32, S=4096, D=128, causal (BASELINES.md's) also naive,
    SDPA-efficient, our variants and flash_attn (`CANONICAL_EXTRAS`): the steps from the
    portable kernel to the one that ships, side by side. A provider that cannot
    run a point leaves a row that says why (`skipped` or `error`), never another backend's
    time. Memory rows: peak memory of one fwd+bwd at B=1, H=32, D=128. `targets` reads the
    targets off the rows.

    The whole sweep takes longer than one GPU command may run: split it with the filters
    (`--seq-lens`, `--head-dims`, `--layouts`, `--causal`) and continue a file with
    `--resume`; `--dry-run --chunk-s 500` prints the cases, an estimate of their time
    (`estimate_s`, a cost model, not a measurement) and command lines that fit; with
    `--resume --gpu h200` it plans what the recorded file still lacks, the estimate corrected
    by the time its rows took (`calibration`). A provider whose backward cannot run at a
    point keeps its forward figure and says why in `fwd_bwd_error`.

        python -m colossal_lab bench flash_attention --dry-run --chunk-s 500   # the plan
        python -m colossal_lab bench flash_attention --head-dims 128 --causal causal
        python -m colossal_lab bench flash_attention --head-dims 64 --resume   # and so on
        python -m colossal_lab bench flash_attention --quick    # CPU smoke test, tiny shapes

    Results: `results/<gpu>/flash_attention.json` (rewritten after every case, so a run that
    is cut short keeps what it measured; `--resume` keeps the file's rows and measures only
    what it lacks, the contributing invocations listed in `config["resumed_from"]`).
    """
    cases = sweep_cases(quick, seq_lens=seq_lens, head_dims=head_dims, layouts=layouts,
                        causal=causal, providers=providers, memory=memory)
    if memory and not quick and not torch.cuda.is_available():
        cases = [c for c in cases if c.kind != "memory"]
    return run_cases(cases, quick=quick, timing=timing, on_rows=on_rows)


def _format(r: dict, seconds: float | None = None) -> str:
    head = f"  {r['provider']:<15} S={r['seq_len']:<6}"
    if "skipped" in r:
        return f"{head} skipped ({r['skipped']})"
    if "error" in r:
        return f"{head} failed: {r['error'][:100]}"
    if r["kind"] == "memory":
        return f"{head} peak {r['peak_mem_gib']:.2f} GiB (+{r['extra_mem_gib']:.2f} over inputs)"
    took = f"  [{seconds:.1f} s, {r.get('timing', '?')}]" if seconds is not None else ""
    both = (f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms {r['fwd_bwd_tflops']:7.1f} TFLOP/s"
            if "fwd_bwd_ms" in r else f"fwd+bwd failed: {r.get('fwd_bwd_error', '?')[:60]}")
    return (f"{head} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:7.1f} TFLOP/s   {both}   "
            f"err {r['max_abs_err_vs_fp32']:.1e}{took}")


# ------------------------------------------------------------------ command line


def _check(a) -> str | None:
    if a.rounds < 1:
        return f"--rounds {a.rounds}: time each provider at least once"
    if a.resume and not (a.out_name or not a.quick):
        return "--resume continues a saved file; --quick saves only with --out-name"
    if (a.chunk_s or a.gpu) and not a.dry_run:
        return "--chunk-s and --gpu plan for --dry-run"
    if a.redo and not a.resume:
        return "--redo replaces rows of a saved file: use it with --resume"
    return None


def _dry_run(a, cases: list[Case], kept: list[dict], filters: dict) -> str:
    """The cases, their estimate and, with `--chunk-s`, the commands that run them."""
    chunks, scale = None, calibration(kept) or None
    if a.chunk_s:
        chunks = plan_chunks(a.chunk_s, done=kept, scale=scale, quick=a.quick, **filters)
    extra = [x for flag_set, x in ((a.providers, ["--providers", *(a.providers or [])]),
                                   (a.exclude, ["--exclude", *a.exclude]),
                                   (a.timing != "graph", ["--timing", a.timing]),
                                   (a.rounds != 1, ["--rounds", str(a.rounds)]),
                                   (a.no_memory, ["--no-memory"])) if flag_set]
    base = " ".join(["python -m colossal_lab bench flash_attention",
                     *(shlex.join(x) for x in extra)])
    return dry_run(cases, chunks, command=base, resume_first=a.resume, scale=scale)


def _execute(call: Invocation) -> None:
    a = call.args
    name = a.out_name or (None if a.quick else NAME)
    config = config_of(a.quick, a.timing)
    filters = dict(seq_lens=a.seq_lens, head_dims=a.head_dims, layouts=a.layouts,
                   causal=a.causal, providers=a.providers, exclude=tuple(a.exclude),
                   memory=not a.no_memory)
    try:
        cases = sweep_cases(a.quick, **filters)
    except ValueError as e:
        call.error(str(e))
    if not a.quick and not a.dry_run and not torch.cuda.is_available():
        cases = [c for c in cases if c.kind != "memory"]  # memory rows need CUDA
    kept: list[dict] = []
    if a.resume:
        selected = measured_keys(cases)
        kept, config = call.resume(config, name=name, gpu=a.gpu, carry=("triton_tiles",),
                                   grown=("canonical_extras",),
                                   may_change=("triton",) if a.redo else (),
                                   retry=lambda r: "provider" not in r
                                   or row_key(r) in selected)
        if a.redo:
            kept = redone(cases, kept)
        cases = pending(cases, kept)
        print(f"[flash_attention] resuming: {len(kept)} rows kept, "
              f"{sum(len(c.providers) for c in cases)} provider runs to go", flush=True)
    if a.dry_run:
        print(_dry_run(a, cases, kept, filters))
        return

    def save(rows):
        if name:
            tiles = config.setdefault("triton_tiles", {})
            for kernel, picked in tuned_configs().items():  # what the autotuner picked
                tiles[kernel] = {**tiles.get(kernel, {}), **picked}
            return call.save(merged(kept, rows), name=name, config=config, quiet=True)

    rows = run_cases(cases, quick=a.quick, timing=a.timing, on_rows=save, rounds=a.rounds)
    print(summary(merged(kept, rows)))
    path = save(rows)
    if path:
        print(f"saved {path}")


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny CPU smoke test, not saved",
    options=[
        opt("--out-name", help="results file name (default flash_attention; with "
            "--quick: save only if given)"),
        opt("--head-dims", type=int, nargs="+", help=f"default {HEAD_DIMS}"),
        opt("--seq-lens", type=int, nargs="+", help=f"default {SEQ_LENS}"),
        opt("--layouts", nargs="+", choices=tuple(LAYOUTS),
            help="head layouts (default all): mha, gqa4 (Hkv = H/4), gqa8"),
        opt("--causal", choices=tuple(CAUSAL_CHOICES), default="both"),
        flag("providers", nargs="+", choices=PROVIDERS + ("sdpa",),
             help=f"at every point (default {SWEEP_PROVIDERS}, and {CANONICAL_EXTRAS} "
             "at the canonical point)"),
        opt("--exclude", nargs="+", choices=PROVIDERS, default=[],
            help="drop these providers (from the default set or --providers)"),
        opt("--timing", choices=TIMINGS, default="graph",
            help="graph: CUDA-graph replay; events: eager do_bench"),
        opt("--no-memory", action="store_true", help="skip the memory rows"),
        flag("rounds"), flag("resume"),
        flag("redo", help="with --resume: measure the selected points again "
             "(--head-dims, --seq-lens, --layouts, --causal, --providers choose them), "
             "replacing their rows; our kernel's rule (config 'triton') may have "
             "changed, the earlier one kept in resumed_from"),
        flag("dry_run"),
        opt("--chunk-s", type=float, help="with --dry-run: also print commands of at "
            "most this many estimated seconds that together run the selection"),
        opt("--gpu", help="with --dry-run --resume: plan what results/<GPU>/ lacks "
            "(default this machine's folder), e.g. h200")],
    file_name=lambda a: a.out_name or NAME, check=_check, execute=_execute)
main = BENCH.main

if __name__ == "__main__":
    main()
