"""Switch 1's micro-benchmark: every attention backend side by side, in one process.

Providers: naive (materialised scores), PyTorch SDPA forced to its flash, memory-efficient
and cuDNN kernels, ours (`colossal_lab.kernels.flash_attention`: "triton" as it ships,
which on Hopper picks the Gluon kernels per pass where they are faster, and its variants
`OUR_VARIANTS`: the portable FlashAttention-2 alone, with FA2's atomic dQ, and the Hopper
kernels everywhere in each forward schedule), FlexAttention under `torch.compile`, and
`flash_attn` when it is installed. Each case
(batch, heads, kv heads, seq_len, head_dim, causal) is set up once and every provider
runs on the same tensors, so the ratios are what to read; absolute numbers drift between
machines.

The sweep (issue #14) keeps the work per query token fixed: B·S = 16384 tokens and
H·D = 4096 (H = 32, 64, 16 at D = 128, 64, 256), S from 512 to 16384, causal and full,
bf16, in three head layouts: MHA, GQA-4 (Hkv = H/4) and GQA-8 (Hkv = H/8). At every
point: ours ("triton"), cuDNN, SDPA-flash and FlexAttention (`SWEEP_PROVIDERS`); at the
canonical point B=4, H=32, S=4096, D=128, causal (BASELINES.md's) also naive,
SDPA-efficient, our variants and flash_attn (`CANONICAL_EXTRAS`): the steps from the
portable kernel to the one that ships, side by side. A provider that cannot
run a point leaves a row that says why (`skipped` or `error`), never another backend's
time. Memory rows: peak memory of one fwd+bwd at B=1, H=32, D=128. `targets` reads the
issue's done-when off the rows.

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

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from colossal_lab.measure.results import fell_back, save_results
from colossal_lab.measure.timing import (
    Timing,
    in_turns,
    peak_memory_gib,
    reset_peak_memory,
    tflops,
    time_fn,
    time_kernels,
)

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
"""B·S of every sweep case: the batch shrinks as the sequence grows."""
HIDDEN = 4096
"""H·D of every sweep case (a LLaMA-7B layer)."""
HEAD_DIMS = (128, 64, 256)
"""D = 128 first (the canonical point's), then 64, then 256 (where cuDNN runs it)."""
LAYOUTS = {"mha": 1, "gqa4": 4, "gqa8": 8}
"""Head layouts: query heads per key/value head (Hq / Hkv)."""
CANONICAL = {"batch": 4, "heads": 32, "seq_len": 4096, "head_dim": 128, "causal": True}
SWEEP_PROVIDERS = ("triton", "cudnn", "sdpa-flash", "flex")
"""The providers at every point of the sweep (issue #14)."""
OUR_VARIANTS = {"triton-portable": {"kernel": "portable"},
                "triton-atomic": {"kernel": "portable", "dq_mode": "atomic"},
                "triton-hopper": {"kernel": "hopper"},
                "triton-hopper-overlap": {"kernel": "hopper-overlap"},
                "triton-hopper-pingpong": {"kernel": "hopper-pingpong"}}
"""Our kernel with one choice changed (`flash_attention`'s keyword arguments)."""
HOPPER_VARIANTS = ("triton-hopper", "triton-hopper-overlap", "triton-hopper-pingpong")
CANONICAL_EXTRAS = ("naive", "sdpa-efficient", "triton-portable", "triton-atomic",
                    *HOPPER_VARIANTS,
                    "flash_attn", "flex-static")
"""Extra providers at the canonical (S, D, causal), in every layout: the chapter's table,
and "flex-static", which checks the dynamic-shape compile of "flex" against a compile
for that one shape; elsewhere they would only lengthen the run."""
FLEX_COMPILE = {"flex": "torch.compile(flex_attention, dynamic=True), one compile per "
                        "(head dim, causal, layout) serving every sequence length",
                "flex-static": "torch.compile(flex_attention, dynamic=False), one compile "
                               "per shape"}
"""How each FlexAttention provider is compiled (recorded in the results file's config).
One static compile per shape costs about 30 s of the sweep's ~108 cases; the canonical
point runs both."""
PROVIDERS = ("naive", "sdpa-flash", "sdpa-efficient", "cudnn", "triton", *OUR_VARIANTS,
             "flex", "flex-static", "flash_attn")
"""Every provider `--providers` takes. `triton` is our attention as it ships
(`flash_attention.DEFAULT_KERNEL`, "auto": per pass the Hopper or the portable kernel,
as `AUTO_HOPPER` rules; each row's `kernels` says which ran); `triton-portable` the
portable FlashAttention-2 kernels alone (what runs on an A100), `triton-atomic` the same
with FA2's atomic dQ (`dq_mode="atomic"`); `triton-hopper` both Gluon
kernels for Hopper (`kernels/flash_attention_hopper*.py`) at every shape they take,
`-overlap` and `-pingpong` the same with the forward's other schedules
(`OUR_VARIANTS`)."""
QUICK_PROVIDERS = ("naive", "sdpa", "triton")
MEM_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
MEM_PROVIDERS = ("naive", "triton", "sdpa-flash")
NAIVE_LIMIT_GIB = 40.0
"""Skip the naive provider where its score matrices would need more than this."""
TIMINGS = ("graph", "events")
"""How the GPU times a provider: "graph" replays one captured CUDA graph (the kernels
alone, `timing.time_kernels`; where capture fails it times eagerly and the row's
`timing` says why), "events" times eager calls with `do_bench` (Python launches
included). Every row's `timing` field records how it was timed, as other benchmarks'
rows do ("cuda_graph", "events", "cuda_graph/events (capture failed: ...)" where fwd and
fwd+bwd differ, "perf_counter" on a CPU)."""
GRAPH_MS = 500.0
"""Graph replays per measurement: as many as fit this many milliseconds, 20 to 100."""


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs: two matmuls (Q Kᵀ and P V) of 2·S²·D each per head; causal halves it."""
    flops = 4.0 * batch * heads * seq_len**2 * head_dim
    return flops * 0.5 if causal else flops


FWD_BWD_FACTOR = 3.5
"""fwd+bwd FLOPs = 3.5 × fwd: the backward's 5 matmuls (dV, dP, dQ, dK and the recomputed
Q Kᵀ are 2.5 × the forward's 2), the FlashAttention papers' and BASELINES.md's convention.
Recomputation beyond that (our dQ kernel recomputes P and dP) is not counted."""


def naive_gib(batch: int, heads: int, seq_len: int) -> float:
    """Rough peak of naive fwd+bwd: per score element bf16 scores, fp32 softmax in and out,
    bf16 probabilities, and their gradients — about 16 bytes."""
    return 16.0 * batch * heads * seq_len**2 / 2**30


# --------------------------------------------------------------------------- the cases


def layout_of(heads: int, kv_heads: int) -> str:
    """"mha" when every query head has its own key/value head, else "gqa<Hq/Hkv>"."""
    return "mha" if heads == kv_heads else f"gqa{heads // kv_heads}"


@dataclass(frozen=True)
class Case:
    """One point of the sweep: tensors set up once, `providers` timed on them."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    causal: bool
    providers: tuple[str, ...]
    kind: str = "speed"
    """"speed" (fwd and fwd+bwd TFLOP/s) or "memory" (peak of one fwd+bwd)."""
    dtype: str = "bfloat16"

    @property
    def layout(self) -> str:
        return layout_of(self.heads, self.kv_heads)

    def key(self, provider: str) -> tuple:
        """What identifies this case's row of `provider` in a results file (`row_key`)."""
        return (self.kind, provider, self.batch, self.heads, self.kv_heads, self.seq_len,
                self.head_dim, self.causal, self.dtype)

    def describe(self) -> str:
        return (f"{self.kind} B={self.batch} H={self.heads} Hkv={self.kv_heads} "
                f"S={self.seq_len} D={self.head_dim} {'causal' if self.causal else 'full'}")


def row_key(row: dict) -> tuple:
    """`Case.key` of the case and provider a results row measured."""
    return (row.get("kind", "speed"), row["provider"], row["batch"], row["heads"],
            row.get("kv_heads", row["heads"]), row["seq_len"], row["head_dim"],
            row["causal"], row.get("dtype", "bfloat16"))


CAUSAL_CHOICES = {"both": (True, False), "causal": (True,), "full": (False,)}


def sweep_cases(quick: bool = False, *, seq_lens=None, head_dims=None, layouts=None,
                causal: str = "both", providers=None, exclude=(), memory: bool = True
                ) -> list[Case]:
    """The sweep's cases in the order they run, narrowed by the filters (None: all).

    `providers` (None: `SWEEP_PROVIDERS` everywhere and `CANONICAL_EXTRAS` at the
    canonical point) runs the named providers at every point; `exclude` drops providers
    (a first pass without Flex's compilations, say). `quick`: tiny fp32 shapes
    (B·S = 64, H·D = 64, D = 32, MHA), `QUICK_PROVIDERS`, no memory rows."""
    if quick:
        dtype, tokens, hidden = "float32", 64, 64
        seq_lens, head_dims = seq_lens or (32, 64), head_dims or (32,)
        layouts = layouts or ("mha",)
        every, extras = tuple(providers or QUICK_PROVIDERS), ()
    else:
        dtype, tokens, hidden = "bfloat16", TOKENS, HIDDEN
        seq_lens, head_dims = seq_lens or SEQ_LENS, head_dims or HEAD_DIMS
        layouts = layouts or tuple(LAYOUTS)
        every = tuple(providers) if providers else SWEEP_PROVIDERS
        extras = () if providers else CANONICAL_EXTRAS
    if causal not in CAUSAL_CHOICES:
        raise ValueError(f"causal={causal!r}; choose from {tuple(CAUSAL_CHOICES)}")
    c = CANONICAL
    cases = []
    for head_dim in head_dims:
        if hidden % head_dim:
            raise ValueError(f"head_dim={head_dim} does not divide H·D={hidden}; choose "
                             f"from {HEAD_DIMS}")
        heads = hidden // head_dim
        for is_causal in CAUSAL_CHOICES[causal]:
            for layout in layouts:
                group = LAYOUTS[layout]
                if heads % group:
                    raise ValueError(f"layout {layout} needs H={heads} (D={head_dim}) to "
                                     f"be a multiple of {group}; choose another layout")
                for seq_len in seq_lens:
                    canon = (seq_len, head_dim, is_causal) == (
                        c["seq_len"], c["head_dim"], c["causal"])
                    more = tuple(p for p in extras if canon and p not in every)
                    chosen = tuple(p for p in every + more if p not in exclude)
                    if chosen:
                        cases.append(Case(max(1, tokens // seq_len), heads, heads // group,
                                          seq_len, head_dim, is_causal, chosen,
                                          dtype=dtype))
    mem = tuple(p for p in MEM_PROVIDERS if (providers is None or p in providers)
                and p not in exclude)
    if memory and not quick and mem and 128 in head_dims and "mha" in layouts \
            and True in CAUSAL_CHOICES[causal]:
        cases += [Case(1, 32, 32, s, 128, True, mem, kind="memory")
                  for s in MEM_SEQ_LENS if s in seq_lens]
    return cases


def pending(cases: list[Case], done_rows: Iterable[dict]) -> list[Case]:
    """`cases` less the providers whose rows are already in `done_rows` without an
    `error` (a skipped row counts as done: it would be skipped again); cases left with
    no provider are dropped. A provider that `_static_skip` rules out at the case and
    has no such row stays: the run records its skip and why, at no cost (an error row
    it left before the rule existed is dropped on resume, as every error row is, and
    would otherwise leave no row at all)."""
    done = {row_key(r) for r in done_rows if "error" not in r and "provider" in r}
    out = []
    for case in cases:
        todo = tuple(p for p in case.providers if case.key(p) not in done)
        if todo:
            out.append(Case(**{**case.__dict__, "providers": todo}))
    return out


def measured_keys(cases: list[Case]) -> set[tuple]:
    """The `row_key`s of the rows a run of `cases` measures."""
    return {case.key(p) for case in cases for p in case.providers}


def redone(cases: list[Case], rows: list[dict]) -> list[dict]:
    """`rows` less those of `cases`' providers (`--redo`: they are measured again)."""
    again = measured_keys(cases)
    return [r for r in rows if "provider" not in r or row_key(r) not in again]


# ------------------------------------------------------------------- a cost estimate

RATE_TFLOPS = {"naive": 25, "sdpa-efficient": 150, "sdpa-flash": 300, "flash_attn": 300,
               "flex": 350, "flex-static": 350, "triton": 450, "triton-portable": 400,
               "triton-atomic": 400,
               "triton-hopper": 450, "triton-hopper-overlap": 450,
               "triton-hopper-pingpong": 450, "cudnn": 500}
"""Assumed fwd TFLOP/s per provider on an H200 (near the recorded canonical-point figures;
fwd+bwd taken 15 % slower): only for `estimate_s`."""
SETUP_S = {"flex": 6.0, "flex-static": 30.0, "triton": 8.0, "triton-portable": 4.0,
           "triton-atomic": 4.0,
           "triton-hopper": 4.0, "triton-hopper-overlap": 4.0, "triton-hopper-pingpong": 4.0}
"""Assumed seconds to set a provider up at one case before it is timed (others 1 s):
"flex-static" compiles FlexAttention's forward and backward for every shape, "flex" once
per six sequence lengths (`FLEX_COMPILE`); our kernels autotune three kernels per (D,
causal, group, S bucket), compiling each tile once per fresh machine. Guesses; the
rows' `wall_s` say what they really took."""
CASE_S = 1.5
"""Per case: random tensors and the fp32 reference."""
MEMORY_S = 3.0
"""Per provider of a memory case."""
STARTUP_S = 30.0
"""Per invocation: importing torch, starting CUDA, the cuDNN and Triton caches."""


def _static_skip(provider: str, case: Case) -> str | None:
    """Why `provider` cannot run `case` on any device (None: it may)."""
    if provider == "naive" and naive_gib(case.batch, case.heads, case.seq_len) \
            > NAIVE_LIMIT_GIB:
        return "memory"
    if provider == "sdpa-efficient" and case.kv_heads != case.heads:
        # torch 2.11's memory-efficient SDPA kernel refuses enable_gqa ("No available
        # kernel", recorded as an error row at 9aa680f); repeating K and V would time
        # another computation under its name
        return "no grouped-query heads in PyTorch's memory-efficient kernel"
    if provider == "triton" or provider in OUR_VARIANTS:
        from colossal_lab.kernels.flash_attention import SUPPORTED_HEAD_DIMS

        if case.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {case.head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if provider in HOPPER_VARIANTS:
        from colossal_lab.kernels import flash_attention_hopper as hopper

        dims = hopper.BACKWARD_HEAD_DIMS  # (the forward's are a superset)
        if case.head_dim not in dims or case.seq_len % hopper.BLOCK_M:
            return f"the Hopper kernels take D in {dims}, S % {hopper.BLOCK_M} == 0"
    return None


def _timed_s(ms: float) -> float:
    """Seconds one GPU measurement of a `ms`-millisecond call takes (`_reps` replays,
    warm-up, capture, probe, L2 flushes)."""
    reps = min(100, max(20, int(GRAPH_MS / ms)))
    return (reps + 6) * ms / 1e3 + 0.3


def provider_s(provider: str, case: Case) -> float:
    """A rough estimate of the seconds `provider` takes at `case` on an H200, from an
    assumed rate (`RATE_TFLOPS`) and set-up time (`SETUP_S`)."""
    if case.kind == "memory":
        return MEMORY_S
    if _static_skip(provider, case):
        return 0.0
    flops = attention_flops(case.batch, case.heads, case.seq_len, case.head_dim, case.causal)
    fwd_ms = flops / (RATE_TFLOPS.get(provider, 200) * 1e12) * 1e3
    return SETUP_S.get(provider, 1.0) + _timed_s(fwd_ms) \
        + _timed_s(FWD_BWD_FACTOR * fwd_ms / 0.85)


def estimate_s(case: Case, scale: dict[str, float] | None = None) -> float:
    """A rough estimate of the seconds `case` takes on an H200 (`provider_s` of each
    provider, times its `scale` factor where given: `calibration`): for planning runs,
    not a measurement."""
    scale = scale or {}
    return (CASE_S if case.kind == "speed" else 0.0) + sum(
        provider_s(p, case) * scale.get(p, 1.0) for p in case.providers)


def calibration(rows: Iterable[dict]) -> dict[str, float]:
    """Per provider, the seconds its recorded rows took (`wall_s`) over what
    `provider_s` estimated for them: the factor that corrects the cost model after a
    first run (rows without `wall_s` are left out)."""
    spent: dict[str, list[float]] = {}
    for r in rows:
        if r.get("wall_s") is None or "provider" not in r:
            continue
        case = Case(r["batch"], r["heads"], r.get("kv_heads", r["heads"]), r["seq_len"],
                    r["head_dim"], r["causal"], (r["provider"],), kind=r.get("kind", "speed"))
        est = provider_s(r["provider"], case)
        if est > 0:
            got = spent.setdefault(r["provider"], [0.0, 0.0])
            got[0] += r["wall_s"]
            got[1] += est
    return {p: real / est for p, (real, est) in spent.items()}


def plan_chunks(budget_s: float, *, done: Iterable[dict] = (),
                scale: dict[str, float] | None = None, **filters) -> list[dict]:
    """The selected sweep (`sweep_cases(**filters)`, less what the rows `done` hold:
    `pending`) cut into invocations whose estimate (`estimate_s` with `scale` +
    `STARTUP_S`) fits `budget_s` where it can: per head dim and causal, as many layouts
    as fit, a layout alone split over its sequence lengths when it does not. Each chunk
    is the `sweep_cases` filters it runs plus its estimate "s"; a chunk with nothing
    left to measure is dropped."""
    base = {k: v for k, v in filters.items() if k not in ("head_dims", "causal",
                                                          "layouts", "seq_lens")}
    head_dims = filters.get("head_dims") or HEAD_DIMS
    layouts = filters.get("layouts") or tuple(LAYOUTS)
    seq_lens = filters.get("seq_lens") or SEQ_LENS
    done = list(done)

    def est(**f) -> float:
        todo = pending(sweep_cases(**base, **f), done)
        return STARTUP_S + sum(estimate_s(c, scale) for c in todo) if todo else 0.0

    which = filters.get("causal") or "both"
    chunks: list[dict] = []
    for head_dim in head_dims:
        for causal in ("causal", "full") if which == "both" else (which,):
            at = {"head_dims": (head_dim,), "causal": causal, "seq_lens": tuple(seq_lens)}
            group: list[str] = []
            for layout in layouts:
                if group and est(**at, layouts=(*group, layout)) > budget_s:
                    chunks.append({**at, "layouts": tuple(group)})
                    group = []
                group.append(layout)
                if len(group) == 1 and est(**at, layouts=(layout,)) > budget_s:
                    part: list[int] = []
                    for s in seq_lens:
                        one = {**at, "layouts": (layout,)}
                        if part and est(**{**one, "seq_lens": (*part, s)}) > budget_s:
                            chunks.append({**one, "seq_lens": tuple(part)})
                            part = []
                        part.append(s)
                    chunks.append({**at, "layouts": (layout,), "seq_lens": tuple(part)})
                    group = []
            if group:
                chunks.append({**at, "layouts": tuple(group)})
    for chunk in chunks:
        chunk["s"] = est(**{k: v for k, v in chunk.items() if k != "s"})
    return [c for c in chunks if c["s"] > 0]


def chunk_argv(chunk: dict) -> list[str]:
    """The command-line filters of a `plan_chunks` chunk."""
    argv = ["--head-dims", *map(str, chunk["head_dims"]), "--causal", chunk["causal"],
            "--layouts", *chunk["layouts"]]
    if tuple(chunk["seq_lens"]) != SEQ_LENS:
        argv += ["--seq-lens", *map(str, chunk["seq_lens"])]
    return argv


# ------------------------------------------------------------------------ measuring


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
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
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

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
        from colossal_lab.kernels.flash_attention import flash_attention

        return lambda: flash_attention(q, k, v, causal, **OUR_VARIANTS[provider])
    from colossal_lab.ops.attention import attention

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
    from colossal_lab.ops.attention import BACKENDS, _why_not

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
    from colossal_lab.fallback import STRICT_ENV

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
    from colossal_lab.ops.attention import attention_ref

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
                    from colossal_lab.kernels.flash_attention import kernel_plan

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
    triton only, no memory rows (a CPU smoke test; its numbers mean nothing)."""
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


# -------------------------------------------------------------------------- targets

TARGET_CANONICAL = 0.90
"""Issue #14: ours / cuDNN at the canonical point, forward and fwd+bwd."""
TARGET_LONG = 0.85
"""Issue #14: ours / cuDNN at every point with S >= `TARGET_MIN_SEQ`."""
TARGET_MIN_SEQ = 1024
POINT = ("batch", "heads", "kv_heads", "seq_len", "head_dim", "causal")
"""The fields that make a sweep point (with the provider, a row)."""


def _point(r: dict) -> tuple:
    return tuple(r.get("kv_heads", r["heads"]) if f == "kv_heads" else r[f] for f in POINT)


def targets(rows: list[dict], *, numerator: str = "triton",
            denominator: str = "cudnn") -> list[dict]:
    """Issue #14's done-when, read off `rows`: one dict per check, the canonical point
    first (fwd, fwd+bwd; ≥ `TARGET_CANONICAL`), then every point with S ≥
    `TARGET_MIN_SEQ` that any speed row measured (fwd, fwd+bwd; ≥ `TARGET_LONG`).

    Each dict: "check", "metric" ("fwd" or "fwd_bwd"), the point's fields and "layout",
    "ratio" (`numerator` / `denominator` TFLOP/s, None when not measured), "target",
    "status" ("met", "not met" or "not measured") and "why" (for "not measured": which
    provider has no figure and its `error` / `skipped`, or a timing that fell back,
    `results.fell_back`; else None). Where a point has
    several rows of a provider (a re-measured one), the last counts."""
    speed = [r for r in rows if r.get("kind", "speed") == "speed" and "provider" in r]
    last = {(r["provider"], _point(r)): r for r in speed}
    c = CANONICAL
    canon = (c["batch"], c["heads"], c["heads"], c["seq_len"], c["head_dim"], c["causal"])
    long = sorted({_point(r) for r in speed if r["seq_len"] >= TARGET_MIN_SEQ},
                  key=lambda p: (-p[4], not p[5], p[1] // p[2], p[3]))

    def check(name: str, point: tuple, metric: str, target: float) -> dict:
        out = {"check": name, "metric": metric, **dict(zip(POINT, point)),
               "layout": layout_of(point[1], point[2]), "ratio": None, "target": target}
        missing = []
        for p in (numerator, denominator):
            r = last.get((p, point))
            if r is None or not r.get(f"{metric}_tflops"):
                why = "no row" if r is None else (r.get("error") or r.get(f"{metric}_error")
                                                  or r.get("skipped") or "no figure")
                missing.append(f"{p}: {why}"[:120])
            elif fell_back(r):  # timed by a fallback: a failed measurement, not a figure
                missing.append(f"{p}: {r['timing']}"[:120])
        if missing:
            return {**out, "status": "not measured", "why": "; ".join(missing)}
        ratio = (last[(numerator, point)][f"{metric}_tflops"]
                 / last[(denominator, point)][f"{metric}_tflops"])
        return {**out, "ratio": ratio, "status": "met" if ratio >= target else "not met",
                "why": None}

    out = [check("canonical", canon, m, TARGET_CANONICAL) for m in ("fwd", "fwd_bwd")]
    out += [check(f"S>={TARGET_MIN_SEQ}", p, m, TARGET_LONG)
            for p in long for m in ("fwd", "fwd_bwd")]
    return out


def targets_summary(checks: list[dict]) -> str:
    """Two lines: the canonical ratios, then how many long-sequence checks are met,
    missed (the worst) and not measured."""
    canon = [c for c in checks if c["check"] == "canonical"]
    lines = ["targets (issue #14), ours / cuDNN: canonical " + ", ".join(
        f"{c['metric']} " + (f"{c['ratio']:.2f}" if c["ratio"] is not None else "-")
        + f" ({c['status']}, >= {c['target']:.2f})" for c in canon)]
    rest = [c for c in checks if c["check"] != "canonical"]
    if rest:
        n = {s: [c for c in rest if c["status"] == s]
             for s in ("met", "not met", "not measured")}
        worst = min(n["not met"], key=lambda c: c["ratio"], default=None)
        lines.append(
            f"  {rest[0]['check']} (>= {rest[0]['target']:.2f}): {len(n['met'])} met, "
            f"{len(n['not met'])} not met, {len(n['not measured'])} not measured of "
            f"{len(rest)}" + (f"; worst {worst['ratio']:.2f} at S={worst['seq_len']} "
                              f"D={worst['head_dim']} {worst['layout']} "
                              f"{'causal' if worst['causal'] else 'full'} "
                              f"{worst['metric']}" if worst else ""))
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Provider × key cases, fwd / fwd+bwd TFLOP/s; ratios at the canonical point."""
    speed = [r for r in rows if r.get("kind") == "speed"]
    if not speed:
        return "no speed rows"
    big = max(r["seq_len"] for r in speed)
    dims = sorted({r["head_dim"] for r in speed}, reverse=True)
    c = CANONICAL
    cases = [(f"S={c['seq_len']} D={c['head_dim']} causal", dict(
                 seq_len=c["seq_len"], head_dim=c["head_dim"], causal=True)),
             (f"S={c['seq_len']} D={c['head_dim']} full", dict(
                 seq_len=c["seq_len"], head_dim=c["head_dim"], causal=False)),
             (f"S={big} D={c['head_dim']} causal", dict(seq_len=big,
                                                       head_dim=c["head_dim"], causal=True))]
    cases += [(f"S={c['seq_len']} D={d} causal", dict(seq_len=c["seq_len"], head_dim=d,
                                                      causal=True))
              for d in dims if d != c["head_dim"]]
    if not any(r["seq_len"] == c["seq_len"] for r in speed):  # quick runs
        cases = [(f"S={big} D={dims[0]} causal", dict(seq_len=big, head_dim=dims[0],
                                                      causal=True))]

    def find(provider, kv_heads=None, **match):
        for r in speed:
            if r["provider"] == provider and all(r.get(k) == v for k, v in match.items()) \
                    and (kv_heads is None or r["kv_heads"] == kv_heads) \
                    and (kv_heads is not None or r["kv_heads"] == r["heads"]):
                return r
        return None

    def cell(r):
        if r is None:
            return "-"
        if "fwd_tflops" not in r:
            return r.get("skipped", "error")[:13]
        return f"{r['fwd_tflops']:.0f} / " + (f"{r['fwd_bwd_tflops']:.0f}"
                                              if "fwd_bwd_tflops" in r else "error")

    cases = [(name, m) for name, m in cases if any(find(p, **m) for p in
                                                   {r["provider"] for r in speed})]
    if not cases:  # a chunk without the canonical point: its first MHA point
        r = next((r for r in speed if r["kv_heads"] == r["heads"]), speed[0])
        cases = [(f"S={r['seq_len']} D={r['head_dim']} "
                  f"{'causal' if r['causal'] else 'full'}",
                  dict(seq_len=r["seq_len"], head_dim=r["head_dim"], causal=r["causal"]))]
    providers = list(dict.fromkeys(r["provider"] for r in speed))
    width = 24
    lines = ["TFLOP/s, fwd / fwd+bwd (fwd+bwd counted as 3.5 x fwd), MHA",
             f"{'provider':<16}" + "".join(f"{name:>{width}}" for name, _ in cases)]
    for p in providers:
        lines.append(f"{p:<16}" + "".join(f"{cell(find(p, **m)):>{width}}" for _, m in cases))
    name, m = cases[0]
    ours = find("triton", **m)
    if ours and "fwd_tflops" in ours:
        for other in ("sdpa-flash", "cudnn", "flex", "flash_attn", *OUR_VARIANTS):
            r = find(other, **m)
            if r and "fwd_tflops" in r:
                lines.append(f"triton / {other} at {name}: fwd "
                             f"{ours['fwd_tflops'] / r['fwd_tflops']:.2f}x, fwd+bwd "
                             f"{ours['fwd_bwd_tflops'] / r['fwd_bwd_tflops']:.2f}x")
    at = {k: v for k, v in m.items()}
    for kv in sorted({r["kv_heads"] for r in speed if r["kv_heads"] != r["heads"]
                      and all(r.get(k) == v for k, v in at.items())}, reverse=True):
        gqa = [r for r in speed if r["kv_heads"] == kv
               and all(r.get(k) == v for k, v in at.items())]
        lines.append(f"grouped-query (Hkv={kv}) at {name}: " + ", ".join(
            f"{r['provider']} {cell(r)}" for r in gqa))
    mem = [r for r in rows if r.get("kind") == "memory"]
    if mem:
        seqs = sorted({r["seq_len"] for r in mem})
        lines.append("peak memory of one fwd+bwd, GiB (B=1, H=32, D=128, causal)")
        lines.append(f"{'provider':<16}" + "".join(f"{'S=' + str(s):>10}" for s in seqs))
        for p in dict.fromkeys(r["provider"] for r in mem):
            cells = []
            for s in seqs:
                r = next((r for r in mem if r["provider"] == p and r["seq_len"] == s), None)
                cells.append(f"{r['peak_mem_gib']:.2f}" if r and "peak_mem_gib" in r
                             else (r or {}).get("skipped", "error")[:8])
            lines.append(f"{p:<16}" + "".join(f"{x:>10}" for x in cells))
    if any(r["provider"] == "cudnn" for r in speed):
        lines.append(targets_summary(targets(rows)))
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def config_of(quick: bool = False, timing: str = "graph") -> dict:
    """The sweep's fixed parameters: equal in every invocation that adds to one file
    (`--resume` refuses another)."""
    return {"tokens_per_case": 64 if quick else TOKENS, "hidden": 64 if quick else HIDDEN,
            "dtype": "float32" if quick else "bfloat16", "canonical": CANONICAL,
            "seq_lens": SEQ_LENS, "head_dims": HEAD_DIMS, "layouts": LAYOUTS,
            "providers": SWEEP_PROVIDERS, "canonical_extras": CANONICAL_EXTRAS,
            "flops_fwd": "4*B*H*S^2*D, x0.5 if causal",
            "flops_fwd_bwd": f"{FWD_BWD_FACTOR} x fwd",
            "timing": {"graph": "CUDA-graph replay (timing.time_kernels: median of 20-100 "
                                "replays, L2 flushed before each; eager do_bench where "
                                "capture fails, said in the row)",
                       "events": "triton do_bench median (CUDA events, eager calls)"
                       }[timing] + "; each row's timing field says how it was timed",
            "fwd": "forward with autograd recording (training forward)",
            "naive_limit_gib": NAIVE_LIMIT_GIB, "flex_compile": FLEX_COMPILE,
            "memory": "peak of one fwd+bwd incl. inputs, B=1 H=32 D=128 causal",
            "triton": _triton_config()}


def _triton_config() -> dict:
    """What `triton` means in this file: the kernel choice and its rules."""
    from colossal_lab.kernels import flash_attention as fa
    from colossal_lab.kernels import flash_attention_hopper as hopper

    scheduler = {causal: hopper.default_scheduler(causal) for causal in (True, False)}
    # (worded as the recorded files have it while the choice is the measured one)
    persistent = "forward without the causal mask" if scheduler == \
        {True: "grid", False: "static"} else f"forward scheduler {scheduler}"
    return {"kernel": fa.DEFAULT_KERNEL, "auto_hopper": fa.AUTO_HOPPER,
            "auto_forward": [{"causal": causal, "max_seq_len": longest,
                              "plan": "-".join(plan[:2]) if plan else "portable",
                              **({"options": plan[2]} if plan and plan[2:] else {})}
                             for causal, longest, plan in fa.AUTO_FORWARD],
            "hopper_schedule": hopper.DEFAULT_SCHEDULE, "hopper_persistent": persistent}


def merged(kept: list[dict], new: list[dict]) -> list[dict]:
    """`kept` with the rows `new` re-measures (an errored row run again) replaced,
    then `new`."""
    again = {row_key(r) for r in new}
    return [r for r in kept if row_key(r) not in again] + list(new)


def dry_run(cases: list[Case], chunks: list[dict] | None = None,
            command: str = "python -m colossal_lab bench flash_attention",
            resume_first: bool = False, scale: dict[str, float] | None = None) -> str:
    """The cases, each with its estimate, the total, and, given `chunks`
    (`plan_chunks`), one command line per chunk. Touches no GPU."""
    lines = []
    for i, c in enumerate(cases):
        lines.append(f"{i + 1:>4} {c.describe():<46} ~{estimate_s(c, scale):5.0f} s  "
                     f"{' '.join(c.providers)}")
    runs = sum(len(c.providers) for c in cases)
    total = sum(estimate_s(c, scale) for c in cases)
    how = ("calibrated by the recorded rows' wall_s: " + ", ".join(
        f"{p} x{f:.2f}" for p, f in scale.items())) if scale else "not a measurement"
    lines.append(f"{len(cases)} cases, {runs} provider runs, ~{total:.0f} s + "
                 f"{STARTUP_S:.0f} s start-up (estimate_s: an assumed rate and set-up time "
                 f"per provider; {how})")
    for i, chunk in enumerate(chunks or []):
        resume = " --resume" if i or resume_first else ""
        lines.append(f"  ~{chunk['s']:4.0f} s  {command} "
                     f"{shlex.join(chunk_argv(chunk))}{resume}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke test, not saved")
    p.add_argument("--out-name", help="results file name (default flash_attention; "
                                      "with --quick: save only if given)")
    p.add_argument("--head-dims", type=int, nargs="+", help=f"default {HEAD_DIMS}")
    p.add_argument("--seq-lens", type=int, nargs="+", help=f"default {SEQ_LENS}")
    p.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS),
                   help="head layouts (default all): mha, gqa4 (Hkv = H/4), gqa8")
    p.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default="both")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS + ("sdpa",),
                   help=f"at every point (default {SWEEP_PROVIDERS}, and "
                        f"{CANONICAL_EXTRAS} at the canonical point)")
    p.add_argument("--exclude", nargs="+", choices=PROVIDERS, default=[],
                   help="drop these providers (from the default set or --providers)")
    p.add_argument("--timing", choices=TIMINGS, default="graph",
                   help="graph: CUDA-graph replay; events: eager do_bench")
    p.add_argument("--no-memory", action="store_true", help="skip the memory rows")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each case's providers this many times, in turns (order "
                        "rotated each round), and keep each row's median (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="keep the results file's rows and measure only what it lacks "
                        "(rows with an error run again)")
    p.add_argument("--redo", action="store_true",
                   help="with --resume: measure the selected points again (--head-dims, "
                        "--seq-lens, --layouts, --causal, --providers choose them), "
                        "replacing their rows; our kernel's rule (config 'triton') may "
                        "have changed since, the earlier one kept in resumed_from")
    p.add_argument("--dry-run", action="store_true",
                   help="print the cases and an estimate of their time; run nothing")
    p.add_argument("--chunk-s", type=float,
                   help="with --dry-run: also print commands of at most this many "
                        "estimated seconds that together run the selection")
    p.add_argument("--gpu", help="with --dry-run --resume: plan what results/<GPU>/ "
                                 "lacks (default this machine's folder), e.g. h200")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: time each provider at least once")
    name = a.out_name or (None if a.quick else "flash_attention")
    if a.resume and not name:
        p.error("--resume continues a saved file; --quick saves only with --out-name")
    if (a.chunk_s or a.gpu) and not a.dry_run:
        p.error("--chunk-s and --gpu plan for --dry-run")
    if a.redo and not a.resume:
        p.error("--redo replaces rows of a saved file: use it with --resume")
    command = f"python -m colossal_lab bench flash_attention {shlex.join(argv)}".strip()
    config = config_of(a.quick, a.timing)
    filters = dict(seq_lens=a.seq_lens, head_dims=a.head_dims, layouts=a.layouts,
                   causal=a.causal, providers=a.providers, exclude=tuple(a.exclude),
                   memory=not a.no_memory)
    try:
        cases = sweep_cases(a.quick, **filters)
    except ValueError as e:
        p.error(str(e))
    if not a.quick and not a.dry_run and not torch.cuda.is_available():
        cases = [c for c in cases if c.kind != "memory"]  # memory rows need CUDA

    kept: list[dict] = []
    if a.resume:
        from colossal_lab.measure import hardware
        from colossal_lab.measure.results import load_results, resumed_rows

        try:
            recorded = load_results(name, gpu=a.gpu or hardware.detect().slug)
        except FileNotFoundError:
            recorded = None
        selected = measured_keys(cases)
        kept, config = resumed_rows(name, recorded, config, p.error, what="results file",
                                    carry=("triton_tiles",), grown=("canonical_extras",),
                                    may_change=("triton",) if a.redo else (),
                                    retry=lambda r: "provider" not in r
                                    or row_key(r) in selected)
        if a.redo:
            kept = redone(cases, kept)
        cases = pending(cases, kept)
        print(f"[flash_attention] resuming: {len(kept)} rows kept, "
              f"{sum(len(c.providers) for c in cases)} provider runs to go", flush=True)
    if a.dry_run:
        chunks, scale = None, calibration(kept) or None
        if a.chunk_s:
            chunks = plan_chunks(a.chunk_s, done=kept, scale=scale, quick=a.quick, **filters)
        extra = [x for flag, x in ((a.providers, ["--providers", *(a.providers or [])]),
                                   (a.exclude, ["--exclude", *a.exclude]),
                                   (a.timing != "graph", ["--timing", a.timing]),
                                   (a.rounds != 1, ["--rounds", str(a.rounds)]),
                                   (a.no_memory, ["--no-memory"])) if flag]
        base = " ".join(["python -m colossal_lab bench flash_attention",
                         *(shlex.join(x) for x in extra)])
        print(dry_run(cases, chunks, command=base, resume_first=a.resume, scale=scale))
        return

    def save(rows):
        if name:
            from colossal_lab.kernels.flash_attention import tuned_configs

            tiles = config.setdefault("triton_tiles", {})
            for kernel, picked in tuned_configs().items():  # what the autotuner picked
                tiles[kernel] = {**tiles.get(kernel, {}), **picked}
            return save_results(name, merged(kept, rows), config=config, command=command)

    rows = run_cases(cases, quick=a.quick, timing=a.timing, on_rows=save, rounds=a.rounds)
    print(summary(merged(kept, rows)))
    path = save(rows)
    if path:
        print(f"saved {path}")


if __name__ == "__main__":
    main()
