"""The doctor's checks: the tutorial's eight, then ours, each a `Finding` or a `Verdict`.

A check takes a `Context` (the plan, the machine, the recorded results, the memory
model and, with `--profile`, the profile of a few steps) and returns a `Finding` (what
to change, with the gain it should bring and where that number comes from) or a
`Verdict` (nothing to change, or could not run).
"""

from __future__ import annotations

from dataclasses import dataclass

from colossal_lab.config import SWITCH_SETS, ModelConfig
from colossal_lab.doctor_plan import (
    NOT_RECORDED,
    RECORDED_STEPS,
    Machine,
    Plan,
    Recorded,
    ckpt_layers,
)
from colossal_lab.measure import mfu
from colossal_lab.precision import policy
from colossal_lab.switches import compile as compile_switch

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
                   "in this book yet; the tutorial lists it as a communication bottleneck")


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
    if policy(ctx.plan.switches.precision).fp8:
        return Verdict("ours: fp8", "ok", f"precision {ctx.plan.switches.precision!r}")
    if not ctx.machine.supports_fp8:
        return Verdict("ours: fp8", "ok", f"{ctx.machine.gpu} has no fp8 tensor cores")
    return Finding("ours: fp8", f"{ctx.machine.gpu} has fp8 tensor cores (twice the bf16 "
                   "rate); the linears run in "
                   f"{ctx.plan.switches.precision}", "--switches best-fp8 (fp8 linears, "
                   "delayed scaling); check the loss curve first, chapter 06",
                   **_gain(ctx, "composed", "ours-bf16", "ours-fp8-eager"))


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
"""The tutorial's eight, in its order, then ours."""
