"""FLOP accounting for a training step, and MFU / HFU from a measured step time.

Three numbers, always printed with N and the peak they divide by:

* **MFU, the tutorial's formula** (the tutorial chapter, after Kaplan et al. 2020):
  ``6 · N · tokens / (time · peak)``. N counts *every* parameter, embeddings included;
  2N FLOPs per token forward (one multiply-add per weight) and 4N backward (gradient
  w.r.t. inputs and w.r.t. weights). It ignores attention's S×S matmuls.
* **MFU, attention-aware model FLOPs** (PaLM, Chowdhery et al. 2022, appendix B):
  ``(6N + 12 · L · d · S · c) · tokens`` where the attention scores QKᵀ and the mix PV
  cost 2·S·d each per token and layer forward, ×3 for forward+backward, and
  **c = 1/2 for causal attention** (the upper triangle is skipped; that is our
  convention, as in FlashAttention's and Megatron's counts) or 1 for full attention.
* **HFU** (hardware FLOPs utilisation): the model FLOPs plus the forward work that
  activation recomputation repeats. Recompute is *not* model work: counting it in MFU
  (as ColossalAI's evaluator does with 8N whenever checkpointing is on) flatters the
  figure.

Peaks are the dense datasheet figures for the dtype the matmuls run in (`hardware`).
"""

from __future__ import annotations

from dataclasses import dataclass

from colossal_lab.config import ModelConfig


def layer_params(cfg: ModelConfig) -> int:
    """Weights of one transformer block (attention, SwiGLU, two norms)."""
    d, dh = cfg.hidden_size, cfg.head_dim
    attn = d * cfg.num_attention_heads * dh + 2 * d * cfg.num_key_value_heads * dh \
        + cfg.num_attention_heads * dh * d
    mlp = 3 * d * cfg.intermediate_size
    return attn + mlp + 2 * d


def count_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """N: all parameters (the tutorial's N), or without the input embedding table."""
    emb = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    n = cfg.num_hidden_layers * layer_params(cfg) + cfg.hidden_size + head
    return n + (emb if include_embedding else 0)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every linear of every block plus
    the output head. (The embedding is a lookup and the norms are element-wise.)"""
    d = cfg.hidden_size
    return cfg.num_hidden_layers * (layer_params(cfg) - 2 * d) + cfg.vocab_size * d


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True,
                              backward: bool = True) -> float:
    """FLOPs of QKᵀ and PV per token, all layers: 4·L·d·S forward (×3 with backward),
    halved for causal attention."""
    f = 4 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    f *= 3 if backward else 1
    return f * (0.5 if causal else 1.0)


def seed_flops(cfg: ModelConfig, tokens: int) -> float:
    """The tutorial chapter's 6·N·tokens."""
    return 6.0 * count_params(cfg) * tokens


def model_flops(cfg: ModelConfig, tokens: int, seq_len: int, causal: bool = True) -> float:
    """Attention-aware model FLOPs of one training step: (6N + attention) · tokens."""
    return (6.0 * count_params(cfg) + attention_flops_per_token(cfg, seq_len, causal)) * tokens


def hardware_flops(cfg: ModelConfig, tokens: int, seq_len: int, causal: bool = True,
                   recompute_fraction: float = 0.0, recompute_attention: bool = True,
                   recompute_flops: float | None = None) -> float:
    """Model FLOPs plus the forward that recomputation repeats.

    `recompute_fraction` is the share of transformer layers whose forward runs twice
    (1.0 = full checkpointing); `recompute_attention` whether their attention core is
    among what is recomputed. `recompute_flops`, when given, is the exact recomputed
    work of the step instead (`switches.checkpointing.recompute_flops`: it knows that
    selective recomputation repeats no GEMM and that full recomputation skips the
    last one)."""
    if recompute_flops is not None:
        if recompute_flops < 0:
            raise ValueError(f"recompute_flops={recompute_flops} must be >= 0")
        return model_flops(cfg, tokens, seq_len, causal) + recompute_flops
    if not 0.0 <= recompute_fraction <= 1.0:
        raise ValueError(f"recompute_fraction={recompute_fraction} must be in [0, 1]")
    layer_fwd = 2.0 * cfg.num_hidden_layers * (layer_params(cfg) - 2 * cfg.hidden_size)
    if recompute_attention:
        layer_fwd += attention_flops_per_token(cfg, seq_len, causal, backward=False)
    return model_flops(cfg, tokens, seq_len, causal) + recompute_fraction * layer_fwd * tokens


def exact_matmul_flops(cfg: ModelConfig, batch: int, seq_len: int,
                       causal_counted_full: bool = True) -> float:
    """Matmul FLOPs of forward+backward exactly as `FlopCounterMode` counts them on our
    model with naive attention (which multiplies the full S×S, masked or not)."""
    tokens = batch * seq_len
    return (6.0 * matmul_params(cfg)
            + attention_flops_per_token(cfg, seq_len, causal=not causal_counted_full)) * tokens


@dataclass(frozen=True)
class StepStats:
    """Throughput and utilisation of a measured training step."""

    tokens_per_s: float
    mfu: float
    """The tutorial's formula, 6·N·tokens / (time · peak); a fraction."""
    mfu_attn: float
    """Attention-aware model FLOPs / (time · peak)."""
    hfu: float
    """Model + recomputed FLOPs / (time · peak)."""
    n_params: int
    peak_tflops: float
    achieved_tflops: float
    """Attention-aware model TFLOP/s."""

    def __str__(self) -> str:
        return (f"{self.tokens_per_s:,.0f} tok/s | MFU {self.mfu:.1%} (6N) "
                f"{self.mfu_attn:.1%} (+attn) | HFU {self.hfu:.1%} | "
                f"{self.achieved_tflops:.0f} TFLOP/s of {self.peak_tflops:g} peak, "
                f"N={self.n_params / 1e9:.2f}B")


def step_stats(cfg: ModelConfig, *, batch: int, seq_len: int, step_time_s: float,
               peak_tflops: float, causal: bool = True,
               recompute_fraction: float = 0.0,
               recompute_flops: float | None = None) -> StepStats:
    """MFU, attention-aware MFU and HFU of one step over `batch · seq_len` tokens (per
    device: pass the tokens this device processed and this device's peak). HFU adds the
    recomputed work: `recompute_flops` exactly, else a `recompute_fraction` of layers."""
    if step_time_s <= 0:
        raise ValueError("step_time_s must be positive")
    if not peak_tflops or peak_tflops <= 0:
        raise ValueError("peak_tflops must be positive (unknown GPU? pass one explicitly)")
    tokens = batch * seq_len
    peak = peak_tflops * 1e12
    mf = model_flops(cfg, tokens, seq_len, causal)
    return StepStats(
        tokens_per_s=tokens / step_time_s,
        mfu=seed_flops(cfg, tokens) / step_time_s / peak,
        mfu_attn=mf / step_time_s / peak,
        hfu=hardware_flops(cfg, tokens, seq_len, causal, recompute_fraction,
                           recompute_flops=recompute_flops) / step_time_s / peak,
        n_params=count_params(cfg),
        peak_tflops=peak_tflops,
        achieved_tflops=mf / step_time_s / 1e12,
    )
