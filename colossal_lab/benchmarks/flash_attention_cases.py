"""The attention sweep's cases, a cost model of their time, and the plan of a long run.

`sweep_cases` lists the (batch, heads, kv heads, S, D, causal) points and providers a
selection runs; `pending` what a saved file still lacks. `estimate_s` is a cost model
(an assumed rate and set-up time per provider, `calibration` correcting it from the
seconds recorded rows took), not a measurement; `plan_chunks` cuts the selection into
invocations that fit a time budget (`harness.pack`), `dry_run` prints them.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from colossal_lab.benchmarks.harness import pack, then_resume
from colossal_lab.kernels import flash_attention as fa
from colossal_lab.kernels import flash_attention_hopper as hopper
from colossal_lab.kernels.flash_attention import (
    SUPPORTED_HEAD_DIMS,
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
"""The providers at every point of the sweep."""
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
        # kernel", an error row); repeating K and V would time
        # another computation under its name
        return "no grouped-query heads in PyTorch's memory-efficient kernel"
    if provider == "triton" or provider in OUR_VARIANTS:

        if case.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {case.head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if provider in HOPPER_VARIANTS:

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
    `STARTUP_S`) fits `budget_s` where it can (`harness.pack`): per head dim and causal,
    as many layouts as fit, a layout alone split over its sequence lengths when it does
    not. Each chunk is the `sweep_cases` filters it runs plus its estimate "s"; a chunk
    with nothing left to measure is dropped."""
    base = {k: v for k, v in filters.items() if k not in ("head_dims", "causal",
                                                          "layouts", "seq_lens")}
    head_dims = filters.get("head_dims") or HEAD_DIMS
    layouts = filters.get("layouts") or tuple(LAYOUTS)
    seq_lens = tuple(filters.get("seq_lens") or SEQ_LENS)
    done = list(done)

    def est(**f) -> float:
        todo = pending(sweep_cases(**base, **f), done)
        return STARTUP_S + sum(estimate_s(c, scale) for c in todo) if todo else 0.0

    which = filters.get("causal") or "both"
    chunks: list[dict] = []
    for head_dim in head_dims:
        for causal in ("causal", "full") if which == "both" else (which,):
            at = {"head_dims": (head_dim,), "causal": causal, "seq_lens": seq_lens}
            def layouts_s(g, at=at) -> float:
                return est(**at, layouts=tuple(g))

            for group in pack(layouts, layouts_s, budget_s):
                one = {**at, "layouts": tuple(group)}
                if len(group) > 1 or est(**one) <= budget_s:
                    chunks.append(one)
                    continue
                def seq_s(part, one=one) -> float:
                    return est(**{**one, "seq_lens": tuple(part)})

                chunks += [{**one, "seq_lens": tuple(part)}
                           for part in pack(seq_lens, seq_s, budget_s)]
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
        lines.append(f"  ~{chunk['s']:4.0f} s  {command} "
                     f"{shlex.join(chunk_argv(chunk))}{then_resume(i, resume_first)}")
    return "\n".join(lines)


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
