"""`python -m colossal_lab doctor`: the seed's tuning checklist as code.

The seed closes with eight checks that "catch 90% of performance problems", in order:
1 bf16 / fp16 on; 2 flash attention on; 3 fused norm on; 4 tensor parallelism no wider
than 8; 5 Gemini (heterogeneous memory) only when memory needs it; 6 enough
micro-batches for the pipeline stages; 7 a checkpoint ratio no higher than memory
needs; 8 no data-loader stalls. The doctor runs each against a `Plan` (a model preset,
its `Switches`, the batch, the parallel layout) and this machine, then five of ours:
MFU against what this GPU's matmuls reach, compile or CUDA graphs, fp8, memory
headroom, host-bound steps.

Each finding carries the gain it should bring **as recorded on this GPU**
(`results/<gpu>/*.json`, the step benchmarks of the chapters); on a machine without a
GPU, as recorded on the reference GPU (`results.REFERENCE_GPU`), and it says so; when
nothing was recorded for it, it says that instead of inventing a number. Findings are
ranked: what will fail first, then by expected gain.

Configuration checks run anywhere. What only a run can tell (data-loader stalls,
host-bound steps, the MFU of an arbitrary configuration) comes from a short profile
(`--profile`, `colossal_lab.measure.profile`) on a GPU; without one, those checks say they were
not run.

    python -m colossal_lab doctor --preset llama-7b-8l --switches naive
    python -m colossal_lab doctor --switches best --batch 8 --pp 4 --microbatches 4
    python -m colossal_lab doctor --switches '{"precision": "bf16"}' --profile   # GPU
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from colossal_lab.config import PRESETS, SWITCH_SETS, ModelConfig, Switches, preset

GIB = 2**30


# ---------------------------------------------------------------- what is examined


@dataclass(frozen=True)
class Plan:
    """A training configuration, as the doctor examines it."""

    preset: str = "llama-7b-8l"
    """Model preset (`config.PRESETS`)."""
    switches: Switches = SWITCH_SETS["best"]
    """The switches the run applies (`apply_switches`)."""
    switches_name: str | None = "best"
    """The `SWITCH_SETS` name of `switches`, when it is one (recorded MFU is by name)."""
    batch: int = 4
    """Sequences per step (per data-parallel rank)."""
    seq_len: int = 4096
    micro_batch: int | None = None
    """Gradient-accumulation slice (None: the whole batch at once)."""
    tp_size: int = 1
    """Tensor-parallel width (ColossalAI's `tp_size`)."""
    pp_size: int = 1
    """Pipeline stages (`pp_size`)."""
    num_microbatches: int | None = None
    """Micro-batches per pipeline step (`num_microbatches`; None: batch / micro_batch)."""
    gemini: bool = False
    """Gemini / heterogeneous memory (parameters and optimizer states offloaded)."""
    compile: bool = False
    """The step runs under `torch.compile`."""
    cuda_graphs: bool = False
    """The step is captured and replayed as a CUDA graph."""
    gpus_per_node: int = 8
    """GPUs that share one node's NVLink (a TP group wider than this crosses nodes)."""

    @property
    def cfg(self) -> ModelConfig:
        cfg = preset(self.preset)
        if self.seq_len > cfg.max_position_embeddings:
            cfg = cfg.replace(max_position_embeddings=self.seq_len)
        return cfg

    @property
    def micro(self) -> int:
        return self.micro_batch or self.batch

    @property
    def microbatches(self) -> int:
        return self.num_microbatches or max(1, self.batch // self.micro)


@dataclass(frozen=True)
class Machine:
    """The GPU the advice is for: this one, or the reference GPU on a machine without."""

    gpu: str
    slug: str
    peak_tflops: float | None
    """Dense bf16 datasheet peak."""
    supports_fp8: bool
    capacity_gib: float | None
    """What the allocator can hand out (None: unknown)."""
    reference: bool
    """True when this machine has no GPU and the advice is for the reference GPU."""


def this_machine() -> Machine:
    """This GPU; on a machine without one, the reference GPU (`results.REFERENCE_GPU`)
    with its recorded memory capacity (`results/<gpu>/checkpointing.json`)."""
    import torch

    from colossal_lab.measure import hardware, results
    from colossal_lab.training import memory

    if torch.cuda.is_available():
        dev = hardware.detect()
        return Machine(dev.name, dev.slug, dev.peak_tflops("bf16"), dev.supports_fp8,
                       memory.capacity_gib(), reference=False)
    spec = next(s for s in hardware.GPUS if s.slug == results.REFERENCE_GPU)
    capacity = None
    try:
        rows = results.load_results("checkpointing", gpu=spec.slug).rows
        capacity = next((r["mem_capacity_gib"] for r in rows if r.get("mem_capacity_gib")),
                        None)
    except FileNotFoundError:
        pass
    return Machine(spec.name, spec.slug, spec.bf16, spec.fp8 is not None, capacity,
                   reference=True)


# ---------------------------------------------------------------- recorded evidence


class Recorded:
    """The results recorded for `machine`'s GPU, read on demand."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self._cache: dict[str, object] = {}

    def load(self, name: str):
        from colossal_lab.measure import results

        if name not in self._cache:
            try:
                self._cache[name] = results.load_results(name, gpu=self.machine.slug)
            except FileNotFoundError:
                self._cache[name] = None
        return self._cache[name]

    def where(self) -> str:
        m = self.machine
        if m.reference:
            return f"recorded on the reference {m.gpu}: this machine has no GPU"
        return f"recorded on this {m.gpu}"

    def row(self, name: str, setup: str) -> dict | None:
        res = self.load(name)
        if res is None:
            return None
        row = next((r for r in res.rows if r.get("setup") == setup), None)
        return row if row is not None and "error" not in row else None

    def speedup(self, name: str, slow: str, fast: str | list[str]) -> tuple[float | None, str]:
        """(slow step / fast step, where it comes from). A list of `fast` setups takes
        the fastest one recorded."""
        base = self.row(name, slow)
        cands = [r for r in (self.row(name, f) for f in
                             ([fast] if isinstance(fast, str) else fast)) if r]
        if base is None or not cands:
            return None, (f"no recorded result: results/{self.machine.slug}/{name}.json "
                          f"lacks {slow!r} or {fast!r}")
        best = min(cands, key=lambda r: r["step_ms"])
        return (base["step_ms"] / best["step_ms"],
                f"results/{self.machine.slug}/{name}.json: {slow} {base['step_ms']:.0f} ms "
                f"→ {best['setup']} {best['step_ms']:.0f} ms per step "
                f"({base['preset']}, seq {base['seq_len']}, batch {base['batch']}; "
                f"{self.where()})")

    def ceiling(self) -> tuple[float | None, str]:
        """(measured bf16 matmul TFLOP/s as a fraction of the datasheet peak, source)."""
        res = self.load("env")
        if res is None or not res.rows:
            return None, f"no results/{self.machine.slug}/env.json (`python -m " \
                         "colossal_lab env --save` records it)"
        row = res.rows[0]
        peak = row.get("peak_bf16_tflops") or self.machine.peak_tflops
        if not (peak and row.get("matmul_bf16_tflops")):
            return None, "env.json has no bf16 matmul ceiling"
        return (row["matmul_bf16_tflops"] / peak,
                f"results/{self.machine.slug}/env.json: an 8192³ bf16 matmul reaches "
                f"{row['matmul_bf16_tflops']:.0f} of {peak:g} TFLOP/s")


NOT_RECORDED = "no recorded result"
"""How an expected gain starts when no measurement backs it."""

RECORDED_STEPS = {"naive": ("baseline", "ours-fp32-naive"),
                  "bf16": ("baseline", "ours-bf16-naive"),
                  "best": ("composed", "ours-bf16"),
                  "best-fp8": ("composed", "ours-fp8")}
"""Where each `SWITCH_SETS` entry's training step was recorded (file, setup)."""


# ---------------------------------------------------------------- memory


def estimate_memory(plan: Plan, capacity_gib: float | None):
    """A `memory.MemoryModel` of `plan`'s step from its shapes alone (no GPU needed).

    * fixed: per parameter, its weight and gradient in the parameter dtype, AdamW's two
      moments (fp32, or bf16 with our AdamW and `extra["adamw_moments"]`), an fp32
      master copy with low-precision parameters (2 bytes, its low half, with our
      optimizer on bf16 ones: `kernels.adamw.split_master`), and autocast's
      low-precision weight copies (kept from forward to backward; 1 byte with fp8
      linears, whose backward keeps the fp8 cast). The gradients are counted whole
      although they arrive as the backward frees activations: a bound from above;
    * per sequence and layer: `checkpointing.activation_elements_per_token` (flash
      attention's layout; a checkpointed layer keeps its input only) in the activation
      dtype, plus, with naive attention, the softmax probabilities (heads × seq per
      token, fp32 and their low-precision copy under autocast);
    * the head: fp32 logits, their gradient and an autocast copy, unless the fused
      cross-entropy (which never holds them whole).

    Against the recorded H200 steps of llama-7b-8l it is within 20% (chapter 09 shows
    the comparison)."""
    import torch

    from colossal_lab import precision
    from colossal_lab.measure import mfu
    from colossal_lab.switches.checkpointing import activation_elements_per_token
    from colossal_lab.training import memory

    cfg, sw = plan.cfg, plan.switches
    pol = precision.policy(sw.precision)
    n = mfu.count_params(cfg)
    pbytes = 2 if pol.param_dtype.itemsize == 2 else 4
    autocast = pol.autocast_dtype is not None
    ours = sw.enable_fused_optimizer not in (False, None, "torch")  # on the plan's GPU
    split = ours and pol.param_dtype == torch.bfloat16
    master = (2 if split else 4) if pol.master_weights else 0
    moments = 4 if ours and precision.adamw_moments(sw) == "bf16" else 8
    copies = (1 if pol.fp8 else 2) if autocast else 0  # fp8 linears keep fp8 weights
    fixed = n * (2 * pbytes + moments + master + copies)
    act = 2 if (autocast or pbytes == 2) else 4
    per_token = {m: sum(activation_elements_per_token(cfg, m).values()) * act
                 for m in (None, "full")}
    if sw.enable_flash_attention in (False, None):
        per_token[None] += cfg.num_attention_heads * plan.seq_len * (4 + act if autocast
                                                                     else 4)
    head = 0 if sw.enable_fused_cross_entropy not in (False, None) else \
        cfg.vocab_size * (8 + (2 if autocast else 0))
    layers = cfg.num_hidden_layers
    none = plan.seq_len * (layers * per_token[None] + head)
    full = plan.seq_len * (layers * per_token["full"] + per_token[None] + head)
    return memory.MemoryModel(fixed / GIB, none / GIB, full / GIB, layers,
                              capacity_gib if capacity_gib is not None else float("inf"))


def ckpt_layers(plan: Plan) -> int:
    """Layers the plan's checkpoint config recomputes (one stage: no pipeline here)."""
    from colossal_lab.switches import checkpointing

    config = checkpointing.resolve(plan.switches.gradient_checkpoint_config)
    if config is None:
        return 0
    return config.num_ckpt_layers(0, 1, plan.cfg.num_hidden_layers)


# ---------------------------------------------------------------- findings


@dataclass
class Finding:
    """One thing to change."""

    check: str
    """The check's name ("1 bf16", ..., "ours: fp8")."""
    message: str
    """What is wrong, in numbers."""
    fix: str
    """What to change."""
    gain: float | None = None
    """Expected step speed-up (×), or None when nothing backs one."""
    basis: str = "recorded"
    """Where `gain` comes from: "recorded" (results files), "profile" (this run's
    profile) or "formula" (a model such as the bubble formula: no recorded result)."""
    evidence: str = ""
    """Where the gain comes from: a results file and its rows, or why there is none."""
    severity: str = "gain"
    """"fails" (the run will not work), "gain" (faster with the fix), "summary" (the
    sum of the others: MFU against the ceiling)."""


@dataclass
class Verdict:
    """A check that found nothing to change, or could not run."""

    check: str
    status: str
    """"ok" or "not checked"."""
    why: str


@dataclass
class Context:
    """Everything a check may look at."""

    plan: Plan
    machine: Machine
    recorded: Recorded
    memory: object  # memory.MemoryModel
    summary: object | None = None
    """A `profile.ProfileSummary` of this plan's step (`--profile`), or None."""
    measured_peak_gib: float | None = None
    """Peak memory of the profiled steps, when profiled on a GPU."""

    @property
    def cfg(self) -> ModelConfig:
        return self.plan.cfg


def _gain(ctx: Context, name: str, slow: str, fast) -> dict:
    g, why = ctx.recorded.speedup(name, slow, fast)
    return {"gain": g, "evidence": why}


def check_bf16(ctx: Context):
    """1. Low precision on: bf16 (or fp16) matmuls run on the tensor cores."""
    p = ctx.plan.switches.precision
    if p not in ("fp32", "tf32"):
        return Verdict("1 bf16", "ok", f"precision {p!r}")
    slow = "ours-fp32-naive"
    kw = _gain(ctx, "baseline", slow, "ours-bf16-naive")
    if p == "tf32":
        kw = _gain(ctx, "precision_step", "tf32", ["bf16", "bf16-pure"])
    return Finding("1 bf16", f"precision={p!r}: every matmul in {p}, a fraction of the "
                   "bf16 tensor-core rate", "precision='bf16-pure' (bf16 parameters, fp32 "
                   "master weights) or 'bf16' (autocast); chapter 06", **kw)


def check_flash(ctx: Context):
    """2. Flash attention on: no S × S score matrix in memory, no softmax round trip."""
    v = ctx.plan.switches.enable_flash_attention
    if v not in (False, None):
        return Verdict("2 flash attention", "ok", f"enable_flash_attention={v!r}")
    s = ctx.plan.seq_len
    return Finding("2 flash attention", f"naive attention materialises "
                   f"{ctx.cfg.num_attention_heads} × {s} × {s} scores per sequence and layer"
                   + (" (long sequences: the largest gain)" if s >= 4096 else ""),
                   "enable_flash_attention=True (cuDNN on a GPU, else SDPA); chapter 01",
                   **_gain(ctx, "flash_attention_step", "attn-naive",
                           ["attn-cudnn", "attn-sdpa-flash", "attn-triton"]))


def check_fused_norm(ctx: Context):
    """3. Fused normalization: one kernel for RMSNorm instead of five."""
    v = ctx.plan.switches.enable_fused_normalization
    if v not in (False, None):
        return Verdict("3 fused norm", "ok", f"enable_fused_normalization={v!r}")
    return Finding("3 fused norm", "eager RMSNorm: pow, mean, add, rsqrt and mul kernels, "
                   "each a round trip through memory", "enable_fused_normalization='triton' "
                   "(ours, with the residual add fused); chapter 02",
                   **_gain(ctx, "fused_norm_step", "norm-eager",
                           ["norm-triton", "norm-liger", "norm-torch"]))


def check_tp_size(ctx: Context):
    """4. Tensor parallelism no wider than one node's NVLink (8 GPUs)."""
    tp, node = ctx.plan.tp_size, ctx.plan.gpus_per_node
    limit = min(8, node)
    if tp <= limit:
        return Verdict("4 TP size", "ok", f"tp_size={tp} ≤ {limit}")
    return Finding("4 TP size", f"tp_size={tp} > {limit}: every layer's all-reduces (or "
                   "all-gathers and reduce-scatters with sequence parallelism) cross the "
                   "inter-node network, an order of magnitude slower than NVLink",
                   f"tp_size ≤ {limit} (within a node); spread the rest over pipeline or "
                   "data parallelism", gain=None,
                   evidence=f"{NOT_RECORDED}: tensor parallelism (switch 5) is not measured "
                   "in this book yet; the seed lists it as a communication bottleneck")


def check_gemini(ctx: Context):
    """5. Gemini / offload only when the model does not fit without it."""
    if not ctx.plan.gemini:
        return Verdict("5 Gemini", "ok", "no heterogeneous memory (Gemini) asked for")
    mm = ctx.memory
    k = ckpt_layers(ctx.plan)
    peak = mm.peak(ctx.plan.micro, k)
    if ctx.machine.capacity_gib is None:
        return Verdict("5 Gemini", "not checked", "the GPU's memory capacity is unknown")
    if peak > mm.capacity_gib:
        return Verdict("5 Gemini", "ok", f"~{peak:.0f} GiB without offload > "
                       f"{mm.capacity_gib:.0f} GiB: offload is needed")
    return Finding("5 Gemini", f"Gemini offloads parameters and optimizer states, but the "
                   f"step fits without it: ~{peak:.0f} GiB of {mm.capacity_gib:.0f} GiB "
                   "(memory model)", "HybridParallelPlugin (or no plugin) without offload: "
                   "no PCIe traffic for parameters and optimizer states", gain=None,
                   evidence=f"{NOT_RECORDED}: Gemini is not measured in this book; the "
                   "seed: HybridParallel is faster whenever memory suffices")


def check_microbatches(ctx: Context):
    """6. Enough micro-batches for the pipeline: the 1F1B bubble is (p−1)/(m+p−1)."""
    p, m = ctx.plan.pp_size, ctx.plan.microbatches
    if p <= 1:
        return Verdict("6 micro-batches vs stages", "ok", "no pipeline (pp_size=1)")
    bubble = (p - 1) / (m + p - 1)
    if m >= 4 * p:
        return Verdict("6 micro-batches vs stages", "ok",
                       f"m={m} ≥ 4·p: bubble {bubble:.0%} of the step")
    target = 4 * p
    gain = ((m + p - 1) / m) / ((target + p - 1) / target)
    return Finding("6 micro-batches vs stages", f"pp_size={p} with {m} micro-batches: "
                   f"the 1F1B pipeline idles {bubble:.0%} of the step ((p−1)/(m+p−1))"
                   + ("; fewer micro-batches than stages" if m < p else ""),
                   f"num_microbatches ≥ {target} (4 per stage), or pp_style='zbv' "
                   "(zero-bubble); chapter 07", gain=gain, basis="formula",
                   evidence=f"{NOT_RECORDED}: from the bubble formula, ideal stages "
                   f"((m+p−1)/m at m={m} against m={target}), not a measurement")


def check_ckpt_ratio(ctx: Context):
    """7. Checkpoint no more layers than memory needs: recomputation costs time."""
    k = ckpt_layers(ctx.plan)
    if k == 0:
        return Verdict("7 checkpoint ratio", "ok", "no gradient checkpointing")
    if ctx.machine.capacity_gib is None:
        return Verdict("7 checkpoint ratio", "not checked",
                       "the GPU's memory capacity is unknown")
    mm, L = ctx.memory, ctx.cfg.num_hidden_layers
    need = mm.min_ckpt_layers(ctx.plan.micro)
    if need is not None and need >= k:
        return Verdict("7 checkpoint ratio", "ok",
                       f"{k} of {L} layers checkpointed; the memory model needs {need}")
    if need is None:
        return Verdict("7 checkpoint ratio", "ok", "even every layer checkpointed does not "
                       "fit: see memory headroom")
    cur, new = _ckpt_setup(k / L), _ckpt_setup(need / L)
    kw = _gain(ctx, "checkpointing", cur, new) if cur != new else \
        {"gain": None, "evidence": f"{NOT_RECORDED} between these ratios"}
    return Finding("7 checkpoint ratio", f"{k} of {L} layers recompute their forward, but "
                   f"{need} would fit: ~{mm.peak(ctx.plan.micro, need):.0f} of "
                   f"{mm.capacity_gib:.0f} GiB (memory model)",
                   f"gradient_checkpointing_ratio={need / L:g} (or "
                   f"num_ckpt_layers_per_stage=[{need}]); chapter 04", **kw)


def _ckpt_setup(ratio: float) -> str:
    """The recorded `checkpointing` setup nearest to `ratio` (full recomputation)."""
    options = {0.0: "ckpt-none", 0.25: "ckpt-0.25", 0.5: "ckpt-0.5", 0.75: "ckpt-0.75",
               1.0: "ckpt-full"}
    return options[min(options, key=lambda r: abs(r - ratio))]


def check_data_loader(ctx: Context):
    """8. The data loader keeps up: the device never waits for the next batch."""
    s = ctx.summary
    if s is None:
        return Verdict("8 data loader", "not checked", "needs a profile (--profile)")
    share = s.data_stall_ms / s.step_ms if s.step_ms else 0.0
    if share < 0.05:
        return Verdict("8 data loader", "ok", f"{s.data_stall_ms:.1f} ms of a "
                       f"{s.step_ms:.0f} ms step idle waiting for data ({share:.1%})")
    return Finding("8 data loader", f"the device idles {s.data_stall_ms:.1f} ms per step "
                   f"({share:.0%}) while the host fetches the next batch",
                   "DataLoader(num_workers>0, pin_memory=True, prefetch_factor≥2), and "
                   "copy with non_blocking=True; pre-tokenize", gain=s.step_ms /
                   max(s.step_ms - s.data_stall_ms, 1e-9), basis="profile",
                   evidence="this run's profile: the step without its data stall")


def _mfu_now(ctx: Context) -> tuple[float | None, str]:
    """This plan's MFU: from the profile, else recorded for its switch set."""
    from colossal_lab.measure import mfu

    p, s = ctx.plan, ctx.summary
    if s is not None and ctx.machine.peak_tflops and s.device == "cuda":
        st = mfu.step_stats(ctx.cfg, batch=p.batch, seq_len=p.seq_len,
                            step_time_s=s.step_ms / 1e3, peak_tflops=ctx.machine.peak_tflops)
        return st.mfu, f"this run's profiled step ({s.step_ms:.0f} ms, under the profiler)"
    where = RECORDED_STEPS.get(p.switches_name or "")
    if where and SWITCH_SETS.get(p.switches_name) == p.switches:
        row = ctx.recorded.row(*where)
        if row and (row["preset"], row["seq_len"], row["batch"]) == \
                (p.preset, p.seq_len, p.batch):
            return row["mfu"], (f"results/{ctx.machine.slug}/{where[0]}.json, "
                                f"{where[1]}")
    return None, ("no profile and no recorded step of this configuration "
                  "(run with --profile on a GPU)")


def check_mfu(ctx: Context):
    """Ours: MFU against what this GPU's matmuls reach (`env.json`'s ceiling)."""
    ceiling, cwhy = ctx.recorded.ceiling()
    now, why = _mfu_now(ctx)
    if now is None or ceiling is None:
        return Verdict("ours: MFU vs ceiling", "not checked", why if now is None else cwhy)
    if now >= 0.75 * ceiling:
        return Verdict("ours: MFU vs ceiling", "ok", f"MFU {now:.1%} is {now / ceiling:.0%} "
                       f"of the {ceiling:.1%} this GPU's matmuls reach ({why})")
    best = ctx.recorded.row("composed", "ours-bf16")
    kw = {"gain": best["mfu"] / now, "evidence": (
        f"results/{ctx.machine.slug}/composed.json: ours-bf16 reaches MFU "
        f"{best['mfu']:.1%}; {ctx.recorded.where()}")} if best else \
        {"gain": None, "evidence": f"{NOT_RECORDED}: no composed.json"}
    return Finding("ours: MFU vs ceiling", f"MFU {now:.1%} is {now / ceiling:.0%} of the "
                   f"{ceiling:.1%} this GPU's bf16 matmuls reach (MFU from {why})",
                   "the findings above; the best composition is --switches best "
                   "(chapter 10)", severity="summary", **kw)


def check_compile(ctx: Context):
    """Ours: element-wise chains left to eager PyTorch: compile them, or fuse them."""
    from colossal_lab.switches import compile as compile_switch

    sw, p = ctx.plan.switches, ctx.plan
    mode = compile_switch.resolve(sw.enable_compile)
    graphs = p.cuda_graphs or mode == "graph"  # the step replayed
    compiled = p.compile or mode in ("layers", "model")  # the wrapper, or in place
    if compiled or graphs:
        return Verdict("ours: compile / CUDA graphs", "ok",
                       "torch.compile" if compiled else "CUDA graphs")
    eager = [name for name, v in (("RMSNorm", sw.enable_fused_normalization),
                                  ("RoPE", sw.enable_fused_rope),
                                  ("SwiGLU", sw.enable_fused_projections),
                                  ("cross-entropy", sw.enable_fused_cross_entropy))
             if v in (False, None)]
    if not eager:
        return Verdict("ours: compile / CUDA graphs", "ok", "every element-wise chain "
                       "already runs in a fused kernel")
    return Finding("ours: compile / CUDA graphs", f"eager element-wise chains: "
                   f"{', '.join(eager)}", "torch.compile the model, or switch on our fused "
                   "kernels (--switches best)",
                   **_gain(ctx, "baseline", "hf-bf16-sdpa", "hf-bf16-sdpa-compile"))


def check_fp8(ctx: Context):
    """Ours: fp8 linears where the GPU has fp8 tensor cores (Hopper, Ada)."""
    if ctx.plan.switches.precision == "fp8":
        return Verdict("ours: fp8", "ok", "precision 'fp8'")
    if not ctx.machine.supports_fp8:
        return Verdict("ours: fp8", "ok", f"{ctx.machine.gpu} has no fp8 tensor cores")
    return Finding("ours: fp8", f"{ctx.machine.gpu} has fp8 tensor cores (twice the bf16 "
                   "rate); the linears run in "
                   f"{ctx.plan.switches.precision}", "--switches best-fp8 (fp8 linears, "
                   "delayed scaling); check the loss curve first, chapter 06",
                   **_gain(ctx, "composed", "ours-bf16", "ours-fp8"))


def check_memory(ctx: Context):
    """Ours: the step fits, with headroom (memory model, or the profiled peak)."""
    mm, p = ctx.memory, ctx.plan
    if ctx.machine.capacity_gib is None:
        return Verdict("ours: memory headroom", "not checked",
                       "the GPU's memory capacity is unknown")
    k = ckpt_layers(p)
    peak = ctx.measured_peak_gib or mm.peak(p.micro, k)
    how = "measured" if ctx.measured_peak_gib else "memory model"
    if peak <= 0.95 * mm.capacity_gib:
        return Verdict("ours: memory headroom", "ok", f"~{peak:.0f} of "
                       f"{mm.capacity_gib:.0f} GiB ({how}); the largest micro-batch that "
                       f"fits: ~{mm.largest_batch(k)}")
    need = mm.min_ckpt_layers(p.micro)
    fits = mm.largest_batch(k)
    fix = " or ".join(filter(None, [
        f"micro-batches of ≤ {fits} sequences (--micro-batch)" if fits else None,
        f"checkpoint {need} of {p.cfg.num_hidden_layers} layers "
        f"(gradient_checkpointing_ratio={need / p.cfg.num_hidden_layers:g})"
        if need is not None and need > k else None])) or "a GPU with more memory"
    return Finding("ours: memory headroom", f"~{peak:.0f} GiB ({how}) against "
                   f"{mm.capacity_gib:.0f} GiB: "
                   + ("out of memory" if peak > mm.capacity_gib else "under 5% headroom"),
                   fix + "; chapter 04", gain=None, evidence="the memory model "
                   "(`doctor.estimate_memory`); a run that does not fit has no speed",
                   severity="fails")


def check_host_bound(ctx: Context):
    """Ours: the GPU waits for the host (launch overhead, Python) between kernels."""
    s = ctx.summary
    if s is None or s.device != "cuda":
        return Verdict("ours: host-bound steps", "not checked",
                       "needs a profile on a GPU (--profile)")
    hta = s.hta or {}
    wait = hta.get("host_wait_ms")
    idle = s.idle_ms - s.data_stall_ms
    share = idle / s.window_ms if s.window_ms else 0.0
    if share < 0.10:
        return Verdict("ours: host-bound steps", "ok", f"GPU idle {share:.1%} of the step")
    detail = f" (HTA: {wait:.1f} ms waiting for the host)" if wait is not None else ""
    return Finding("ours: host-bound steps", f"the GPU idles {idle:.1f} ms of a "
                   f"{s.window_ms:.0f} ms step ({share:.0%}){detail}: {s.kernels_per_step:,.0f}"
                   " kernels per step outrun the host", "CUDA graphs (torch.compile "
                   "mode='reduce-overhead'), fused kernels (fewer launches), or a larger "
                   "micro-batch", gain=s.window_ms / max(s.window_ms - idle, 1e-9),
                   basis="profile",
                   evidence="this run's profile: the step without its idle time")


CHECKS = (check_bf16, check_flash, check_fused_norm, check_tp_size, check_gemini,
          check_microbatches, check_ckpt_ratio, check_data_loader, check_mfu,
          check_compile, check_fp8, check_memory, check_host_bound)
"""The seed's eight, in its order, then ours."""


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    plan: Plan
    machine: Machine
    memory: object
    findings: list[Finding] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    summary: object | None = None

    def __str__(self) -> str:
        p, m, mm = self.plan, self.machine, self.memory
        k = ckpt_layers(p)
        sw = p.switches_name or "custom"
        lines = [f"doctor: {p.preset}, seq {p.seq_len}, batch {p.batch}"
                 + (f" (micro-batch {p.micro})" if p.micro != p.batch else "")
                 + f", switches {sw} (precision {p.switches.precision})",
                 f"for {m.gpu}" + (" (the reference GPU: this machine has none)"
                                   if m.reference else ""),
                 f"memory model: ~{mm.peak(p.micro, k):.0f} GiB"
                 + (f" of {m.capacity_gib:.0f} GiB" if m.capacity_gib else "")]
        if self.summary is not None:
            s = self.summary
            lines.append(f"profile: {s.step_ms:.1f} ms per step, device idle "
                         f"{s.idle_share:.0%}, {s.kernels_per_step:,.0f} kernels per step")
        lines.append("")
        if self.findings:
            lines.append(f"{len(self.findings)} finding(s), most expected gain first:")
        else:
            lines.append("no findings: every check passed or could not run")
        for i, f in enumerate(self.findings, 1):
            gain = describe_gain(f)
            lines += [f"{i:>2}. [{f.check}] {gain}", f"    {f.message}",
                      f"    fix: {f.fix}", f"    evidence: {f.evidence}"]
        ok = [v for v in self.verdicts if v.status == "ok"]
        skipped = [v for v in self.verdicts if v.status != "ok"]
        if ok:
            lines += ["", "fine:"] + [f"    [{v.check}] {v.why}" for v in ok]
        if skipped:
            lines += ["", "not checked:"] + [f"    [{v.check}] {v.why}" for v in skipped]
        return "\n".join(lines)


SEVERITY_ORDER = ("fails", "gain", "summary")


def describe_gain(f: Finding) -> str:
    """The gain of a finding in words, with its basis."""
    if f.severity == "fails":
        return "will fail"
    if not f.gain:
        return "gain not recorded"
    if f.severity == "summary":
        return f"up to ×{f.gain:.2f} (the best recorded composition)"
    return {"recorded": f"expected ×{f.gain:.2f} (recorded)",
            "profile": f"expected ×{f.gain:.2f} (this profile)",
            "formula": f"predicted ×{f.gain:.2f} by a formula, not recorded"}[f.basis]


def rank(findings: list[Finding]) -> list[Finding]:
    """What will fail first, then by expected gain (largest first, unrecorded last),
    then the summary (MFU against the ceiling, which the others explain)."""
    return sorted(findings, key=lambda f: (SEVERITY_ORDER.index(f.severity),
                                           -(f.gain or 0.0)))


def diagnose(plan: Plan, machine: Machine | None = None, *, summary=None,
             measured_peak_gib: float | None = None) -> Report:
    """Run every check of `CHECKS` on `plan` for `machine` (default: `this_machine()`)."""
    machine = machine or this_machine()
    mm = estimate_memory(plan, machine.capacity_gib)
    ctx = Context(plan, machine, Recorded(machine), mm, summary, measured_peak_gib)
    report = Report(plan, machine, mm, summary=summary)
    for check in CHECKS:
        out = check(ctx)
        (report.findings if isinstance(out, Finding) else report.verdicts).append(out)
    report.findings = rank(report.findings)
    return report


# ---------------------------------------------------------------- a short profile


def profile_plan(plan: Plan, trace_path: str | Path) -> tuple[object, float | None]:
    """Profile a few steps of `plan` on this machine (`profile.profile_steps`); returns
    the `ProfileSummary` and the peak memory in GiB (None on a CPU)."""
    import torch

    from colossal_lab.benchmarks.steps import Setup, build
    from colossal_lab.measure import profile, timing
    from colossal_lab.training import data, train

    if plan.tp_size > 1 or plan.pp_size > 1:
        raise ValueError("--profile runs one process: tensor and pipeline parallelism "
                         "are not built yet; profile with --tp 1 --pp 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = Setup("doctor", "doctor", "ours", plan.switches, compile=plan.compile)
    model, loss_fn = build(setup, plan.preset, device)
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt, loss_fn, micro_batches=plan.batch // plan.micro)
    batches = data.random_batches(plan.cfg.vocab_size, plan.batch, plan.seq_len, seed=0,
                                  device=device)
    timing.reset_peak_memory()
    with train.gc_between_steps():
        path = profile.profile_steps(step, batches, trace_path)
    return profile.summarize(path), timing.peak_memory_gib()


# ---------------------------------------------------------------- the command line


def add_arguments(d: argparse.ArgumentParser) -> None:
    from colossal_lab.training.cli import _whole

    d.add_argument("--preset", default="llama-7b-8l", choices=sorted(PRESETS))
    d.add_argument("--switches", default="best", help=f"one of {', '.join(SWITCH_SETS)}, "
                   "a JSON file of Switches fields, or the JSON object itself")
    d.add_argument("--batch", type=_whole(1), default=4)
    d.add_argument("--seq", "--seq-len", dest="seq", type=_whole(2), default=4096)
    d.add_argument("--micro-batch", type=_whole(1))
    d.add_argument("--tp", type=_whole(1), default=1, help="tensor-parallel size")
    d.add_argument("--pp", type=_whole(1), default=1, help="pipeline stages")
    d.add_argument("--microbatches", type=_whole(1), help="pipeline micro-batches")
    d.add_argument("--gemini", action="store_true", help="heterogeneous memory (offload)")
    d.add_argument("--compile", action="store_true", help="the step runs torch.compile'd")
    d.add_argument("--cuda-graphs", action="store_true", help="the step is a CUDA graph")
    d.add_argument("--profile", action="store_true", help="profile a few steps (GPU; "
                   "on a CPU only --preset tiny)")
    d.add_argument("--trace", default="doctor_trace.json",
                   help="where --profile writes its trace (Perfetto, chrome://tracing)")


def switches_of(spec: str) -> tuple[Switches, str | None]:
    """A `SWITCH_SETS` name, a JSON file, or an inline JSON object of `Switches` fields;
    ValueError saying what is wrong."""
    from colossal_lab.training.cli import load_switches

    if not spec.lstrip().startswith("{"):
        return load_switches(spec), spec if spec in SWITCH_SETS else None
    try:
        fields = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--switches: not valid JSON ({e})") from None
    known = set(Switches.__dataclass_fields__)
    if unknown := sorted(set(fields) - known):
        raise ValueError(f"--switches: unknown fields {unknown}; Switches has "
                         f"{sorted(known)}")
    from colossal_lab.switches.checkpointing import resolve

    try:
        fields["gradient_checkpoint_config"] = resolve(
            fields.get("gradient_checkpoint_config"))
        sw = Switches(**fields)
    except TypeError as e:
        raise ValueError(f"--switches: {e}") from None
    name = next((n for n, s in SWITCH_SETS.items() if s == sw), None)
    return sw, name


def plan_of(a: argparse.Namespace) -> Plan:
    """The `Plan` the command line describes; ValueError for what cannot be."""
    from colossal_lab.switches.apply import check

    sw, name = switches_of(a.switches)
    check(sw.replace(overlap_communication=False))  # backend names, checkpoint config
    if a.micro_batch and a.batch % a.micro_batch:
        raise ValueError(f"--micro-batch {a.micro_batch} must divide --batch {a.batch}")
    cfg = preset(a.preset)
    if a.tp > 1 and (cfg.num_key_value_heads % a.tp or cfg.num_attention_heads % a.tp):
        ok = [d for d in range(1, cfg.num_key_value_heads + 1)
              if cfg.num_key_value_heads % d == 0]
        raise ValueError(f"--tp {a.tp} does not divide num_key_value_heads="
                         f"{cfg.num_key_value_heads}; choose one of {ok}")
    if a.pp > cfg.num_hidden_layers:
        raise ValueError(f"--pp {a.pp} > {cfg.num_hidden_layers} layers of {a.preset}")
    return Plan(preset=a.preset, switches=sw, switches_name=name, batch=a.batch,
                seq_len=a.seq, micro_batch=a.micro_batch, tp_size=a.tp, pp_size=a.pp,
                num_microbatches=a.microbatches, gemini=a.gemini, compile=a.compile,
                cuda_graphs=a.cuda_graphs)


def run(a: argparse.Namespace, error) -> None:
    """`python -m colossal_lab doctor`: print the report; `error(message)` ends the
    program with status 2 for bad input."""
    import torch

    try:
        plan = plan_of(a)
        if a.profile and not torch.cuda.is_available() and plan.preset != "tiny":
            raise ValueError("--profile without a GPU profiles only --preset tiny (a CPU "
                             f"step of {plan.preset} takes minutes)")
    except ValueError as e:
        error(str(e).splitlines()[0])
        return
    summary = peak = None
    if a.profile:
        summary, peak = profile_plan(plan, a.trace)
        print(f"trace: {a.trace} (open in https://ui.perfetto.dev)")
    print(diagnose(plan, summary=summary, measured_peak_gib=peak))
