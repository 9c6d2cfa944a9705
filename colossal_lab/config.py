"""Model configurations, named presets, and the `Switches` that pick each fast path.

`ModelConfig` describes a LLaMA-family decoder; its field names follow Hugging Face's
`LlamaConfig` so a config converts both ways. `Switches` mirrors the argument names of
ColossalAI's `HybridParallelPlugin` where ColossalAI has them, so a ColossalAI user
recognises them; where our switch is not what ColossalAI's flag does, it has its own
honest name (see chapter 03 on fused projections).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

Backend = Union[bool, str]

PRECISIONS = ("fp32", "tf32", "bf16", "bf16-pure", "fp16", "fp8", "fp8-pure")
"""The number formats a step can run in; `colossal_lab.precision.POLICIES` says what
each one stores and computes in."""


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU."""

    vocab_size: int = 32000
    """Token embedding rows; the output head has the same number of columns."""
    hidden_size: int = 4096
    """Width of the residual stream (d_model)."""
    intermediate_size: int = 11008
    """Width of the SwiGLU feed-forward layer."""
    num_hidden_layers: int = 32
    """Number of transformer blocks (L)."""
    num_attention_heads: int = 32
    """Query heads (Hq)."""
    num_key_value_heads: int = 32
    """Key/value heads (Hkv); Hq must be a multiple. Hkv < Hq is grouped-query attention."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary table is built for."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head (LLaMA does not)."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of every linear and embedding weight."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            ok = [d for d in range(1, self.num_attention_heads + 1)
                  if self.num_attention_heads % d == 0]
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}; choose one of {ok}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_hf(self):
        """The equivalent `transformers.LlamaConfig` (no bias, SiLU, no rope scaling)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        )

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {n: getattr(hf_config, n) for n in names if hasattr(hf_config, n)}
        rope = getattr(hf_config, "rope_parameters", None) or {}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        return cls(**kwargs)


# ---------------------------------------------------------------------------- presets


def tiny() -> ModelConfig:
    """A few-second CPU model for tests and CI: odd widths on purpose, GQA 4:2."""
    return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=172,
                       num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256)


def llama_1b() -> ModelConfig:
    """TinyLlama-1.1B's shape: 22 layers, d=2048, GQA 32:4."""
    return ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, max_position_embeddings=4096)


def llama_7b() -> ModelConfig:
    """LLaMA-2-7B's shape: 32 layers, d=4096, 32 heads, no GQA (6.74B parameters)."""
    return ModelConfig()


def llama_7b_8l() -> ModelConfig:
    """LLaMA-7B's layer shape with 8 layers (1.88B): the chapters' one-GPU workhorse."""
    return llama_7b().replace(num_hidden_layers=8)


PRESETS = {"tiny": tiny, "1b": llama_1b, "llama-7b-8l": llama_7b_8l, "llama-7b": llama_7b}


def preset(name: str) -> ModelConfig:
    """Look up a preset by name (`tiny`, `1b`, `llama-7b-8l`, `llama-7b`)."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


# ---------------------------------------------------------------------------- switches


@dataclass(frozen=True)
class Switches:
    """The throughput switches. `False` is the naive reference, `True` the best backend
    available on this device, and a string names a backend. A value only: nothing
    changes until `apply_switches(model, switches)` (`colossal_lab.switches.apply`)."""

    enable_flash_attention: Backend = False
    """Attention kernel: False = materialised scores; or "sdpa", "sdpa-flash", "cudnn",
    "triton" (ours), "flash_attn"."""
    enable_fused_normalization: Backend = False
    """RMSNorm kernel: False = eager PyTorch ops; or "torch", "compile", "triton",
    "liger", "apex"."""
    enable_fused_projections: Backend = False
    """One GEMM for q/k/v and one for gate/up (chapter 03). False = separate GEMMs; or
    the SwiGLU kernel that reads the fused gate/up output: "eager", "compile", "triton"
    (ours); True = "triton" on a GPU, "eager" on the CPU. Not ColossalAI's
    `enable_jit_fused`, which fuses bias+GeLU and bias+dropout+add."""
    precision: str = "bf16"
    """One of "fp32", "tf32" (fp32 with TF32 matmuls), "bf16" (autocast), "bf16-pure",
    "fp16", "fp8", "fp8-pure" (fp8 linears over bf16 parameters with fp32 masters): what
    each decides is `precision.POLICIES`."""
    gradient_checkpoint_config: object = None
    """None (keep every activation) or a `switches.checkpointing.GradientCheckpointConfig`
    (chapter 04): a `gradient_checkpointing_ratio` of each stage's layers, or
    `num_ckpt_layers_per_stage`, recompute their forward in the backward; its `mode`
    recomputes everything ("full") or only what is cheap ("selective", "elementwise")."""
    extra: dict = field(default_factory=dict)
    """Backend-specific knobs that have no ColossalAI counterpart. fp8 (chapter 06):
    "fp8_scaling" ("dynamic" | "delayed"), "fp8_history" (amax history length),
    "fp8_skip" (names of linears to keep in bf16, e.g. ["lm_head"]),
    "fp8_fast_accum_backward" (bool), "fp8_backend" ("auto" | "scaled_mm" | "emulate"),
    "fp8_fuse_mlp" (bool, default True: the SwiGLU kernels write the fp8 casts of the
    MLP's activation and its gradient, `ops.fp8_mlp`), "fp8_fuse_rope" (bool, default
    True: RoPE's backward writes the fp8 casts of the qkv projection's gradient,
    `ops.fp8_qkv`), "fp8_fuse_norm" (bool, default True: the RMSNorm in front of the
    qkv and gate/up projections writes their fp8 input, `ops.fp8_norm`).
    `enable_compile`: "compile_backend" (default "inductor"; "aot_eager" and "eager"
    run without code generation), "compile_mode" (Inductor's, e.g. "max-autotune").
    Our AdamW: "adamw_moments" ("fp32" default, "bf16": stochastically rounded moments,
    a change of numerics, `kernels.adamw.FusedAdamW`; torch's AdamW keeps fp32 ones),
    "adamw_defer" (bool: each step's update runs during the next forward, on a side
    stream; exact, `switches.deferred_adamw`). Harmful on purpose, for loss checks:
    "adamw_moments": "bf16-nearest" (moments rounded to nearest), "adamw_masters": False
    (bf16 parameters updated in place by torch's AdamW, no fp32 masters)."""

    enable_fused_rope: Backend = False
    """Rotary embedding of q and k: False = the element-wise chain; or "compile",
    "triton" (ours, one kernel on the projections' layout); True = "triton" on a GPU.
    No ColossalAI counterpart (Liger-Kernel's `rope`)."""
    enable_fused_cross_entropy: Backend = False
    """The output head and the loss: False = full fp32 logits then cross-entropy; or
    "chunked", "triton" (ours: chunks of tokens, the gradient written in place, the
    logits never whole). No ColossalAI counterpart (Liger's fused linear cross-entropy)."""
    enable_fused_embedding: Backend = False
    """The token embedding's backward: False = torch's (sort, fp32 partial segments,
    zero-fill: eight launches); "triton" (ours: one sorted segment sum per vocabulary
    row, every row written once). The forward gather is the same. No ColossalAI or
    Liger counterpart (`switches.embedding`)."""
    enable_sequence_parallelism: bool = False
    """Switch 5, under tensor parallelism (a mesh whose "tp" dim is > 1; chapter 05):
    False = plain TP, an all-reduce after every attention and MLP block; True =
    sequence parallelism in `sequence_parallelism_mode` (norms and residual adds on
    1/tp of the sequence). ColossalAI's name; applied by `switches.tensor_parallel`."""
    sequence_parallelism_mode: str | None = None
    """With `enable_sequence_parallelism`: "split_gather" (default; Megatron's
    all-gather before and reduce-scatter after each block), "ring" (the same cut into
    tp steps, each overlapped with a GEMM), "dtensor" (torch's `SequenceParallel`
    plan), "symm_mem" (torch's async TP, CUDA only). ColossalAI's name and first two
    values; its "all_to_all" and "ring_attn" are context parallelism, not built here."""
    overlap_communication: Backend = False
    """Switch 8, the data-parallel gradient reduction (ColossalAI's
    `overlap_communication`): False = none on one process, one flat all-reduce after
    the backward on several; True or "overlap" = ours, buckets all-reduced as their
    gradients become ready; "naive", "ddp" (torch DDP), "fsdp2" (`fully_shard`).
    Bucket size and reduction dtype in `extra`: "dp_bucket_elems", "dp_reduce_dtype"."""
    enable_fused_optimizer: Backend = False
    """The optimizer step (the finale): False = `clip_grad_norm_`, then torch's AdamW (its
    fused CUDA kernel on a GPU) or, for bf16 parameters, `MasterAdamW`; "triton" (ours,
    `kernels.adamw.FusedAdamW`) = one pass per parameter reading the gradient once, the
    clipping folded in, fp32 masters written back as bf16; True = "triton" on a GPU.
    Read by `switches.precision.make_optimizer`; the model itself does not change.
    ColossalAI's counterpart is an optimizer class (`FusedAdam`, `HybridAdam`)."""
    enable_compile: Backend = False
    """`torch.compile` over what the kernel switches leave eager (`switches.compile`):
    False = eager; "layers" (or True) = each decoder layer compiled on its own
    (regional compilation: one layer's compile time, reused by every layer); "model" =
    the whole forward in one graph. In place (`nn.Module.compile`): modules, hooks and
    state-dict keys stay. The first step pays the compilation, a new shape recompiles.
    Backend and mode in `extra`: "compile_backend", "compile_mode". No ColossalAI
    counterpart."""

    pp_style: str = "1f1b"
    """Switch 7, the pipeline schedule when the mesh's "pp" dim is > 1 (ColossalAI's
    `pp_style`): "1f1b", "interleaved" (`num_model_chunks` >= 2 per rank), "zbv" (zero
    bubble, V placement, 2 chunks per rank); ours also "gpipe" and "zb-h1". Ignored
    when pp = 1. `pipeline.schedules` builds them, `pipeline.runtime` runs them."""
    num_microbatches: int | None = None
    """Micro-batches per pipelined step (ColossalAI's `num_microbatches`); the batch
    must divide into them. Required when pp > 1: more of them shrink the bubble,
    (p − 1)/(m + p − 1) of the step for 1F1B."""
    num_model_chunks: int | None = None
    """Model chunks (virtual stages) per pipeline rank (ColossalAI's): None = 1 for
    "1f1b", "gpipe", "zb-h1" and 2 for "interleaved" and "zbv" (which needs exactly 2)."""
    overlap_p2p: bool = True
    """Post the pipeline's receives early and its sends asynchronously, so transfers
    run under the computation (ColossalAI's `overlap_p2p`, on by default); False waits
    for each group of transfers where the schedule puts it."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; choose one of {PRECISIONS}")

    def replace(self, **changes) -> Switches:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, fields: dict, *, checkpoint_config: Callable | None = None,
                  where: str = "") -> Switches:
        """`Switches` from a dict of its fields, as read from JSON; the one parser.

        `checkpoint_config` turns a `gradient_checkpoint_config` given as a dict into a
        `GradientCheckpointConfig`: pass `switches.checkpointing.resolve` (that class
        lives with the switch, a layer above this module). Bad input raises ValueError,
        prefixed with `where` (e.g. "--switches FILE"): not a dict, unknown fields (the
        known ones are named), a checkpoint config that cannot be built."""
        prefix = f"{where}: " if where else ""
        if not isinstance(fields, dict):
            raise ValueError(f"{prefix}expected a JSON object of Switches fields")
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"{prefix}unknown fields {unknown}; Switches has "
                             f"{sorted(known)}")
        fields = dict(fields)
        check_extra(fields.get("extra", {}), where)
        ckpt = fields.get("gradient_checkpoint_config")
        if checkpoint_config is not None and ckpt is not None:
            try:
                fields["gradient_checkpoint_config"] = checkpoint_config(ckpt)
            except TypeError as e:
                raise ValueError(f"{prefix}{e}") from None
        elif isinstance(ckpt, dict):
            raise TypeError("a gradient_checkpoint_config dict needs checkpoint_config="
                            "switches.checkpointing.resolve to become its class")
        return cls(**fields)

    @classmethod
    def naive(cls, precision: str = "fp32") -> Switches:
        """Every switch off: what the tutorial starts from."""
        return cls(precision=precision)


EXTRA_KEYS = ("fp8_scaling", "fp8_history", "fp8_skip", "fp8_fast_accum_backward",
              "fp8_backend", "fp8_fuse_mlp", "fp8_fuse_rope", "fp8_fuse_norm",
              "compile_backend", "compile_mode",
              "adamw_moments", "adamw_defer", "adamw_masters", "dp_bucket_elems",
              "dp_reduce_dtype")
"""The keys `Switches.extra` may hold (its docstring says what each does)."""


def check_extra(extra, where: str = "") -> None:
    """`extra` is a dict of known keys (`EXTRA_KEYS`): a misspelt knob (``fp8_scalng``)
    would otherwise be ignored without a word. ValueError names the known keys."""
    prefix = f"{where}: " if where else ""
    if not isinstance(extra, dict):
        raise ValueError(f"{prefix}extra={extra!r} must be a JSON object of knobs "
                         f"({', '.join(EXTRA_KEYS)})")
    if unknown := sorted(set(extra) - set(EXTRA_KEYS)):
        raise ValueError(f"{prefix}unknown extra keys {unknown}; known: "
                         f"{', '.join(EXTRA_KEYS)}")


def _every_switch(precision: str, **extra) -> Switches:
    """Every single-GPU switch on (chapter 10's composition) in `precision`."""
    return Switches(enable_flash_attention=True, enable_fused_normalization="triton",
                    enable_fused_projections=True, precision=precision, extra=extra,
                    enable_fused_rope=True, enable_fused_cross_entropy=True,
                    enable_fused_embedding=True, enable_fused_optimizer=True)


SWITCH_SETS = {
    "naive": Switches.naive("fp32"),
    "bf16": Switches.naive("bf16"),
    "best": _every_switch("bf16-pure"),
    "best-bf16-moments": _every_switch("bf16-pure", adamw_moments="bf16"),
    "best-fp8": _every_switch("fp8-pure", fp8_scaling="delayed"),
    "best-fp8-graph": _every_switch("fp8-pure", fp8_scaling="delayed").replace(
        enable_compile="graph"),
    "best-fp8-fp32-params": _every_switch("fp8", fp8_scaling="delayed"),
}
"""Named switch sets (`train --switches NAME`): "best" is what chapter 10 measures as
ours-bf16: every single-GPU switch, bf16 parameters with fp32 master weights and fp32
moments, so the optimizer computes what `torch.optim.AdamW` computes. "best-fp8" is its
fp8 composition: the same storage and optimizer, the linears in fp8.
"best-fp8-graph" (ours-fp8, chapter 10's fp8 headline) replays that step as one CUDA graph
(`switches.step_graph`): the same numerics, without the launch gaps the host leaves
between kernels, which weigh more the shorter fp8 makes the step; it needs a GPU and
captures again whenever the batch shape or a hyper-parameter changes.
"best-fp8-fp32-params" keeps fp32 parameters instead (fp8's autocast-like regime): every
fp8 cast reads a 4-byte weight, and the optimizer moves 32 bytes a parameter, not 28.
"best-bf16-moments" keeps AdamW's moments in bf16, stochastically rounded: 8 bytes a
parameter less, and a change of numerics."""
