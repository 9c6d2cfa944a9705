"""What the doctor examines: a training `Plan`, the `Machine` it runs on, the evidence.

`Recorded` reads the results recorded for the machine's GPU (the step benchmarks of the
chapters), and `estimate_memory` models the plan's peak memory from its shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colossal_lab import precision
from colossal_lab.config import SWITCH_SETS, ModelConfig, Switches, preset
from colossal_lab.measure import hardware, mfu, results
from colossal_lab.switches import checkpointing
from colossal_lab.training import memory

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
                  "best-fp8": ("composed", "ours-fp8-eager"),
                  "best-fp8-graph": ("composed", "ours-fp8")}
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

    Chapter 09 compares it with the recorded steps."""
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
    per_token = {m: sum(checkpointing.activation_elements_per_token(cfg, m).values()) * act
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
    config = checkpointing.resolve(plan.switches.gradient_checkpoint_config)
    if config is None:
        return 0
    return config.num_ckpt_layers(0, 1, plan.cfg.num_hidden_layers)
