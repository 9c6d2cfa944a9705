"""Switch 4, ColossalAI's `gradient_checkpoint_config`: keep less, recompute it in the backward.

On the model, `apply` wraps the forward of the chosen decoder layers in a non-reentrant
`torch.utils.checkpoint` (with a selective policy for the selective modes); the value is
None (off) or a `GradientCheckpointConfig` (which layers, which `mode`).

**The idea** (Chen et al. 2016). Training keeps every tensor the backward needs from
the forward until the backward reaches it, so activation memory grows with layers ×
batch × sequence. A *checkpointed* layer keeps only its input and runs its forward again
when the backward reaches it: one (B, S, d) tensor per layer, for one more forward of it
(the step's matmul FLOPs go from 3 forwards' worth to 4).

**Memory model of one of our decoder layers** (tensors autograd keeps per token, in
elements; h = d, q = Hq·D, kv = Hkv·D, i = intermediate size; flash attention, fused
norm — `activation_elements_per_token` counts them)::

    x (block input, kept by the norm)        h      n1 = norm(x) (kept by q/k/v proj)  h
    q, k after RoPE, v (kept by attention)   q+2kv  o (attention output, kept)        q
    o as (B, S, q) (kept by o_proj)          q      h1 = x + attn (kept by the norm)   h
    n2 = norm(h1) (kept by gate/up proj)     h      gate, up, silu(gate), product     4i

For LLaMA-7B (h = q = kv = 4096, i = 11008) that is 9h + 4i ≈ 81k elements: 158 KiB
per token in bf16, 0.62 GiB per layer per 4096-token sequence.

**What can be recomputed** (`GradientCheckpointConfig.mode`):

* ``"full"``: keep the layer input only (95 % less for 7B); recompute the layer, but for
  down_proj, whose input is saved before it runs (the non-reentrant checkpoint stops as
  soon as the backward has every tensor it saved).
* ``"selective"`` (Korthikanti et al. 2022): also keep the GEMM outputs (q, k, v,
  o_proj, gate, up: 5h + 2i, 47 % less) and recompute what is cheap between them:
  norms, RoPE, the attention core, SiLU·up. Extra FLOPs: the attention core's forward.
* ``"elementwise"``: also keep the attention output and log-sum-exp (6h + 2i, 42 %
  less): no extra matmul FLOPs where the dispatcher sees the attention kernel (SDPA,
  cuDNN, flash_attn; ours and naive attention are recomputed as in "selective").

The selective modes are a policy per aten op
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`): GEMMs (``aten.mm``,
``aten.addmm``, ``aten._scaled_mm``) and attention kernels are saved; ``aten.bmm``,
naive attention's QKᵀ and PV, is not. Our Triton kernels are autograd Functions the
dispatcher cannot see, so they are always recomputed (correct, just not savable).

**Which layers: ColossalAI's semantics** (`colossalai/shardformer/shard/
grad_ckpt_config.py` and the LLaMA policy's forward), matched here:

* `GradientCheckpointConfig(gradient_checkpointing_ratio=r)`: in each pipeline stage
  holding n layers, ``floor(r · n)`` layers are checkpointed.
* `PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[...])`: one count per
  stage (per *virtual* stage with interleaved schedules: entry
  ``stage + model_chunk_id · num_stages``).
* The checkpointed layers are the **first** ones of each stage (their activations would
  live longest under 1F1B; ColossalAI's `if idx - start_idx < num_ckpt_layers`).

Where we differ: one config class does both (`PipelineGradientCheckpointConfig` is an
alias) and works without pipeline stages (the model is one stage; ColossalAI's forward
raises there); bad values raise early and say what to change (ColossalAI `assert`s, and
lets a list silently win over a ratio); ``floor(r · n)`` is taken with a tolerance
(ColossalAI's ``int(0.29 * 100)`` is 28); a config with neither field checkpoints every
layer; ``mode`` has no ColossalAI counterpart.

**Accounting.** Recomputed FLOPs are hardware work, not model work: MFU keeps 6N (or
6N + attention) per token; HFU adds what `recompute_flops` counts. ColossalAI's example
evaluator counts 2·N·(3 + 1) = 8N per token whenever checkpointing is enabled, whatever
the ratio (`colossalai_flops`), which reports recompute as if it were progress.

References: Chen et al. 2016, arXiv:1604.06174; Korthikanti et al. 2022, "Reducing
activation recomputation in large transformer models", arXiv:2205.05198; PyTorch
`torch.utils.checkpoint` documentation (selective activation checkpointing);
ColossalAI `PipelineGradientCheckpointConfig` (hpcaitech/ColossalAI#5509).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colossal_lab.measure import mfu
from colossal_lab.model import layer_lists
from colossal_lab.ops.replay import Replay, ReplayPhase, current_replay  # noqa: F401

MODES = ("full", "selective", "elementwise")
_EPS = 1e-9  # tolerance of floor(ratio * layers) against binary floating point


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True)
class GradientCheckpointConfig:
    """Which transformer layers recompute their forward in the backward, and how much of it.

    Give at most one of `gradient_checkpointing_ratio` and `num_ckpt_layers_per_stage`;
    with neither, every layer is checkpointed."""

    gradient_checkpointing_ratio: float | None = None
    """Share of the layers of each stage to checkpoint, in [0, 1]: ``floor(r · n)`` of
    a stage's n layers (the first ones). None: 1.0 unless a per-stage list is given."""
    num_ckpt_layers_per_stage: Sequence[int] | None = None
    """How many layers to checkpoint in each pipeline stage (the first ones of the
    stage); one entry per stage, or per virtual stage (``stage + chunk · num_stages``)
    with interleaved schedules. Without a pipeline the model is one stage: one entry."""
    mode: str = "full"
    """What a checkpointed layer recomputes: "full" (everything; keeps its input only),
    "selective" (keeps GEMM outputs; recomputes the attention core and element-wise ops)
    or "elementwise" (keeps GEMM and attention outputs; recomputes element-wise ops)."""

    def __post_init__(self) -> None:
        r, counts = self.gradient_checkpointing_ratio, self.num_ckpt_layers_per_stage
        if r is not None and counts is not None:
            raise ValueError(
                "give gradient_checkpointing_ratio or num_ckpt_layers_per_stage, not both "
                f"(got {r} and {list(counts)}); ColossalAI silently lets the list win")
        if r is not None:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
                raise ValueError(f"gradient_checkpointing_ratio={r!r} must be a number in "
                                 "[0, 1]: the share of each stage's layers to checkpoint")
        if counts is not None:
            counts = tuple(counts)
            bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 0]
            if not counts or bad:
                raise ValueError(f"num_ckpt_layers_per_stage={list(counts)} must be a "
                                 "non-empty list of non-negative integers, one per stage")
            object.__setattr__(self, "num_ckpt_layers_per_stage", counts)  # hashable
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; choose one of {MODES}")

    @property
    def ratio(self) -> float | None:
        """The ratio in force (1.0 when neither field is set; None with a per-stage list)."""
        if self.num_ckpt_layers_per_stage is not None:
            return None
        r = self.gradient_checkpointing_ratio
        return 1.0 if r is None else float(r)

    def num_ckpt_layers(self, stage: int, num_stages: int, num_layers: int,
                        model_chunk_id: int = 0, num_model_chunks: int = 1) -> int:
        """How many of the `num_layers` layers held by (`stage`, `model_chunk_id`) are
        checkpointed: ColossalAI's `get_num_ckpt_layers`, with clear errors."""
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} outside 0..{num_stages - 1}")
        if not 0 <= model_chunk_id < num_model_chunks:
            raise ValueError(f"model_chunk_id={model_chunk_id} outside "
                             f"0..{num_model_chunks - 1}")
        counts = self.num_ckpt_layers_per_stage
        if counts is None:
            return math.floor(self.ratio * num_layers + _EPS)
        virtual = num_stages * num_model_chunks
        if len(counts) != virtual:
            what = ("without pipeline stages the model is one stage, so the list needs "
                    "exactly one entry (or use gradient_checkpointing_ratio)"
                    if virtual == 1 else
                    f"one entry per stage{' and model chunk' if num_model_chunks > 1 else ''}")
            raise ValueError(f"num_ckpt_layers_per_stage has {len(counts)} entries for "
                             f"{virtual} (virtual) stages: {what}")
        n = counts[stage + model_chunk_id * num_stages]
        if n > num_layers:
            raise ValueError(f"num_ckpt_layers_per_stage asks for {n} checkpointed layers in "
                             f"stage {stage} (chunk {model_chunk_id}), which holds only "
                             f"{num_layers}")
        return n


PipelineGradientCheckpointConfig = GradientCheckpointConfig
"""ColossalAI's name for the per-stage variant; here one class does both."""


def resolve(config) -> GradientCheckpointConfig | None:
    """Validate a `Switches.gradient_checkpoint_config` value (None or a config; a dict,
    as a config travels through JSON, is rebuilt)."""
    if config is None or isinstance(config, GradientCheckpointConfig):
        return config
    if isinstance(config, dict):
        return GradientCheckpointConfig(**config)
    raise TypeError(f"gradient_checkpoint_config must be None or a GradientCheckpointConfig,"
                    f" not {type(config).__name__}")


# ------------------------------------------------------------------------- which layers


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """An even split of `num_layers` over `num_stages`; the first ``num_layers %
    num_stages`` stages hold one more."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages")
    q, r = divmod(num_layers, num_stages)
    return [q + (s < r) for s in range(num_stages)]


def checkpoint_plan(config: GradientCheckpointConfig | None, num_layers: int | None = None,
                    layers_per_stage: Sequence[int] | None = None,
                    num_model_chunks: int = 1) -> tuple[bool, ...]:
    """One flag per layer of the whole model: is it checkpointed?

    `layers_per_stage` lists the layers of each (virtual) stage in model order (chunk 0
    of every stage, then chunk 1, ...); without it the model is one stage of
    `num_layers`. Within a stage the first layers are the checkpointed ones."""
    if layers_per_stage is None:
        if num_layers is None:
            raise ValueError("give num_layers or layers_per_stage")
        layers_per_stage = [num_layers]
    layers_per_stage = list(layers_per_stage)
    if num_layers is not None and sum(layers_per_stage) != num_layers:
        raise ValueError(f"layers_per_stage {layers_per_stage} sums to "
                         f"{sum(layers_per_stage)}, not num_layers={num_layers}")
    if len(layers_per_stage) % num_model_chunks:
        raise ValueError(f"{len(layers_per_stage)} stage entries are not a multiple of "
                         f"num_model_chunks={num_model_chunks}")
    num_stages = len(layers_per_stage) // num_model_chunks
    flags: list[bool] = []
    for v, n in enumerate(layers_per_stage):
        k = 0 if config is None else config.num_ckpt_layers(
            v % num_stages, num_stages, n, v // num_stages, num_model_chunks)
        flags += [True] * k + [False] * (n - k)
    return tuple(flags)


# ------------------------------------------------------------------------- the switch


def _recomputing_forward(layer, mode: str, skip_gemm_k: int | None, *args, **kwargs):
    """A checkpointed layer's forward: the class's own forward, recomputed in the
    backward while training with gradients on, run as it is otherwise (evaluation)."""
    plain = functools.partial(type(layer).forward, layer, **kwargs)
    if layer.training and torch.is_grad_enabled():
        return checkpoint(plain, *args, mode=mode, skip_gemm_k=skip_gemm_k)
    return plain(*args)


def apply(model: torch.nn.Module, config, stage: tuple[int, int, int, int] | None = None
          ) -> int:
    """Switch 4 on `model`, in place: the layers `config` picks recompute their forward
    in the backward (None: none does); returns how many.

    A checkpointed layer keeps its class and its parameters (state dicts and names do
    not change); it gets an instance `forward` that runs the class's forward under
    `checkpoint`, and loses it again when a later config leaves it out. `stage` is
    (stage, num_stages, model_chunk_id, num_model_chunks) of the layers held here, for
    pipeline code; None: the whole model is one stage. Checked now, so a bad
    per-stage list fails here and not in the first training step."""
    config = resolve(config)
    stage_id, num_stages, chunk, num_chunks = stage or (0, 1, 0, 1)
    count = 0
    for layers in layer_lists(model):
        n = len(layers)
        k = 0 if config is None else config.num_ckpt_layers(stage_id, num_stages, n,
                                                            chunk, num_chunks)
        for i, layer in enumerate(layers):
            layer.__dict__.pop("forward", None)  # back to the class's forward
            if i < k:  # the first k, as ColossalAI
                layer.forward = functools.partial(_recomputing_forward, layer,
                                                  config.mode, last_gemm_k(layer))
        count += k
    return count


def checkpointed(model: torch.nn.Module) -> tuple[bool, ...]:
    """One flag per transformer layer of `model`, in order: does it recompute?"""
    return tuple("forward" in layer.__dict__ for layers in layer_lists(model)
                 for layer in layers)


# ----------------------------------------------------------------- what is recomputed


def _ops(*names: str) -> frozenset:
    """aten op packets by name, skipping those this PyTorch does not have."""
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


GEMM_OPS = _ops("mm", "addmm", "_scaled_mm")
"""Linear layers (2-D matmuls, bf16 or fp8): their outputs are kept by selective modes."""
ATTENTION_OPS = _ops("_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu",
                     "_flash_attention_forward", "_efficient_attention_forward")
"""Attention kernels visible to the dispatcher: kept by "elementwise", not "selective"."""


def _reduction_dim(op, args) -> int | None:
    """K of a GEMM call: mm(a (M, K), b), addmm(bias, a (M, K), b), _scaled_mm(a, b, ...)."""
    a = args[1] if getattr(op, "overloadpacket", op) is torch.ops.aten.addmm else args[0]
    return a.shape[-1] if isinstance(a, torch.Tensor) else None


def saves(mode: str, op, args=(), skip_gemm_k: int | None = None) -> bool:
    """Does `mode` keep the output of aten `op` (an OpOverload called on `args`) instead
    of recomputing it? GEMMs with reduction dimension `skip_gemm_k` are not kept: the
    layer's last GEMM (down_proj, K = intermediate size) only feeds the residual add
    that makes the layer's output, and the recompute stops before it (non-reentrant
    checkpointing stops once the backward has every tensor it saved, and down_proj's
    input is saved before down_proj runs), so keeping it would waste h per token."""
    packet = getattr(op, "overloadpacket", op)
    if mode == "full":
        return False
    if packet in GEMM_OPS:
        return skip_gemm_k is None or _reduction_dim(op, args) != skip_gemm_k
    if mode == "elementwise":
        return packet in ATTENTION_OPS or "flash_attn" in str(packet)
    return False


@functools.cache
def _context_fn(mode: str, skip_gemm_k: int | None):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if saves(mode, op, args, skip_gemm_k)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return functools.partial(create_selective_checkpoint_contexts, policy)


def last_gemm_k(layer) -> int | None:
    """The reduction dimension that identifies a decoder layer's last GEMM (its MLP's
    down projection), or None when another GEMM of the layer shares it (then every GEMM
    output is kept: correct, h per token more)."""
    try:
        k = layer.mlp.down_proj.in_features
        others = {layer.self_attn.o_proj.in_features, layer.self_attn.o_proj.out_features}
    except AttributeError:
        return None
    return None if k in others else k


def checkpoint(fn, *args, mode: str = "full", skip_gemm_k: int | None = None):
    """`fn(*args)` with its activations recomputed in the backward (non-reentrant
    `torch.utils.checkpoint`); `mode` picks what is kept (see the module docstring),
    `skip_gemm_k` the GEMM a selective mode does not keep (`last_gemm_k`). Layers with
    state see the call's `Replay` through `current_replay()`."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    selective = None if mode == "full" else _context_fn(mode, skip_gemm_k)
    if torch.compiler.is_compiling():  # compiled, contexts must be dispatch modes
        extra = {} if selective is None else {"context_fn": selective}
        return torch_checkpoint(fn, *args, use_reentrant=False, **extra)

    def context_fn():
        replay = Replay()
        fwd, rec = selective() if selective is not None else (None, None)
        return ReplayPhase(replay, False, fwd), ReplayPhase(replay, True, rec)

    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


# ------------------------------------------------------------------------- accounting


SAVABLE_ATTENTION = ("sdpa", "sdpa-flash", "sdpa-efficient", "cudnn", "flash_attn")
"""Attention backends whose kernel is an op the "elementwise" policy can keep."""


@dataclass(frozen=True)
class RecomputeSpec:
    """What a config recomputes in a model of `num_layers` layers."""

    layers: int
    """Checkpointed layers."""
    fraction: float
    """layers / num_layers."""
    gemms: bool
    """Are their GEMMs (all but the last) recomputed ("full")?"""
    attention: bool
    """Is their attention core recomputed?"""


def recompute_spec(config: GradientCheckpointConfig | None, num_layers: int,
                   layers_per_stage: Sequence[int] | None = None,
                   num_model_chunks: int = 1, attention_backend: str = "cudnn"
                   ) -> RecomputeSpec:
    """`attention_backend` (a resolved name, `switches.attention.resolve_backend`)
    matters for "elementwise", which can keep only kernels in `SAVABLE_ATTENTION`."""
    plan = checkpoint_plan(config, num_layers, layers_per_stage, num_model_chunks)
    k = sum(plan)
    mode = config.mode if config is not None else "full"
    attention = mode in ("full", "selective") or attention_backend not in SAVABLE_ATTENTION
    return RecomputeSpec(k, k / num_layers if num_layers else 0.0,
                         gemms=k > 0 and mode == "full", attention=k > 0 and attention)


def layer_forward_flops(cfg, tokens: int, seq_len: int, causal: bool = True) -> dict:
    """Matmul FLOPs of one decoder layer's forward over `tokens` tokens: "gemm" (the
    seven linears, 2 per weight per token), "last_gemm" (down_proj, part of "gemm"), and
    "attention" (QKᵀ and PV, 4·d·S per token, halved when `causal`; `causal=False` is
    how `FlopCounterMode` counts naive attention, which multiplies the masked half too)."""
    gemm = 2.0 * (mfu.layer_params(cfg) - 2 * cfg.hidden_size) * tokens
    last = 2.0 * cfg.intermediate_size * cfg.hidden_size * tokens
    attention = 4.0 * cfg.hidden_size * seq_len * (0.5 if causal else 1.0) * tokens
    return {"gemm": gemm, "last_gemm": last, "attention": attention}


def recompute_flops(cfg, batch: int, seq_len: int, config: GradientCheckpointConfig | None,
                    causal: bool = True, layers_per_stage: Sequence[int] | None = None,
                    attention_backend: str = "cudnn", attention_counted: bool = True
                    ) -> float:
    """Matmul FLOPs that recomputation adds to one training step of `batch` sequences:
    MFU leaves them out, HFU counts them. `attention_counted=False` for attention
    kernels a FLOP counter cannot see (SDPA on the CPU)."""
    spec = recompute_spec(config, cfg.num_hidden_layers, layers_per_stage,
                          attention_backend=attention_backend)
    f = layer_forward_flops(cfg, batch * seq_len, seq_len, causal)
    per_layer = (f["gemm"] - f["last_gemm"] if spec.gemms else 0.0) \
        + (f["attention"] if spec.attention and attention_counted else 0.0)
    return spec.layers * per_layer


def colossalai_flops(cfg, tokens: int, checkpointing: bool) -> float:
    """What ColossalAI's example `PerformanceEvaluator` counts for a step:
    ``tokens · N · 2 · (3 + checkpointing)``: 8N per token whenever checkpointing is on,
    whatever the ratio, and with recompute counted as model work."""
    return tokens * mfu.count_params(cfg) * 2.0 * (3 + int(bool(checkpointing)))


def activation_elements_per_token(cfg, mode: str | None) -> dict:
    """The memory model of the module docstring: elements one decoder layer keeps per
    token, by tensor, for `mode` None (no checkpointing) or one of `MODES`. Flash
    attention and a fused norm are assumed; the small per-row statistics (RMSNorm's
    1/rms, attention's log-sum-exp) are left out."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    if mode is None:
        return {"x": h, "norm1": h, "q,k (RoPE), v": q + 2 * kv, "attn out": q,
                "attn out (B,S,q)": q, "h1": h, "norm2": h, "gate, up": 2 * i,
                "silu(gate), product": 2 * i}
    if mode == "full":
        return {"x": h}
    gemm = {"x": h, "q, k, v": q + 2 * kv, "o_proj out": h, "gate, up": 2 * i}
    if mode == "selective":
        return gemm
    if mode == "elementwise":
        return {**gemm, "attn out": q}
    raise ValueError(f"mode={mode!r}; choose None or one of {MODES}")
