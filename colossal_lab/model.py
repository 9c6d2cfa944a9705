"""A compact LLaMA whose parts the switches swap.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU feed-forward,
with module and parameter names identical to Hugging Face's `LlamaForCausalLM`, so its
state dicts load both ways and the logits match (`tests/test_model.py`). The attention
kernel and the norm kernel are chosen by `Switches`; the model stays readable.

Shapes: B batch, S sequence, d hidden, Hq/Hkv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.config import ModelConfig, Switches
from colossal_lab.switches import checkpointing, projections
from colossal_lab.switches.attention import attention
from colossal_lab.switches.norm import RMSNorm

QKV = ("q_proj", "k_proj", "v_proj")
"""Hugging Face's names of the projections that `qkv_proj` fuses, in row order."""
GATE_UP = ("gate_proj", "up_proj")
"""... and those that `gate_up_proj` fuses."""


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE (Su et al. 2021) in the half-split layout LLaMA uses."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_positions = max_positions

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))  # (S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, D)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q (B, Hq, S, D) and k (B, Hkv, S, D) by position; tables (S, D) in fp32."""
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads; the kernel is `attention_backend`.

    `fused_projections` (switch 3) holds q/k/v as one `qkv_proj` (rows [q; k; v]) instead
    of `q_proj`, `k_proj`, `v_proj`; either way the state dict has the separate names."""

    def __init__(self, cfg: ModelConfig, attention_backend=False, fused_projections=False):
        super().__init__()
        self.cfg = cfg
        d, D = cfg.hidden_size, cfg.head_dim
        if projections.is_fused(fused_projections):  # (Hq·D + 2·Hkv·D, d): [q; k; v]
            self.qkv_proj = nn.Linear(d, sum(self.qkv_sizes()), bias=False)
        else:
            self.q_proj = nn.Linear(d, cfg.num_attention_heads * D, bias=False)
            self.k_proj = nn.Linear(d, cfg.num_key_value_heads * D, bias=False)
            self.v_proj = nn.Linear(d, cfg.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * D, d, bias=False)
        self.attention_backend = attention_backend
        projections.register_hf_layout(self, "qkv_proj", QKV, Attention.qkv_sizes)

    def qkv_sizes(self) -> list[int]:
        """Widths of q, k, v: the row blocks of `qkv_proj.weight`."""
        c = self.cfg
        return list(projections.qkv_sizes(c.num_attention_heads, c.num_key_value_heads,
                                          c.head_dim))

    @property
    def fused(self) -> bool:
        return "qkv_proj" in self._modules

    def set_fused(self, value) -> None:
        """Apply the switch value: stack q/k/v into `qkv_proj` or split it back, in
        place, values kept."""
        fused = projections.is_fused(value)
        if fused and not self.fused:
            projections.fuse_linears(self, list(QKV), "qkv_proj")
        elif not fused and self.fused:
            projections.split_linear(self, "qkv_proj", list(QKV), self.qkv_sizes())

    def project_qkv(self, x: torch.Tensor):
        """(B, S, d) -> q (B, S, Hq*D), k and v (B, S, Hkv*D)."""
        if self.fused:  # one GEMM; q, k, v are column views of its output
            return self.qkv_proj(x).split(self.qkv_sizes(), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        D = self.cfg.head_dim
        q, k, v = self.project_qkv(x)
        q = q.view(B, S, -1, D).transpose(1, 2)  # (B, Hq, S, D)
        k = k.view(B, S, -1, D).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, S, -1, D).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        o = attention(q, k, v, causal=True, backend=self.attention_backend)  # (B, Hq, S, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020).

    `fused_projections` (switch 3) holds gate/up as one `gate_up_proj` (rows [gate; up])
    and picks the activation kernel that reads its (..., 2i) output; the state dict keeps
    the separate names."""

    def __init__(self, cfg: ModelConfig, fused_projections=False):
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        if projections.is_fused(fused_projections):  # (2i, d): [gate; up]
            self.gate_up_proj = nn.Linear(d, 2 * i, bias=False)
        else:
            self.gate_proj = nn.Linear(d, i, bias=False)
            self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self.intermediate_size = i
        self.activation = fused_projections  # the SwiGLU kernel, when fused
        projections.register_hf_layout(self, "gate_up_proj", GATE_UP,
                                       lambda m: [m.intermediate_size] * 2)

    @property
    def fused(self) -> bool:
        return "gate_up_proj" in self._modules

    def set_fused(self, value) -> None:
        """Apply the switch value: stack gate/up into `gate_up_proj` or split it back, in
        place, values kept; remember the activation backend."""
        self.activation = value
        if projections.is_fused(value) and not self.fused:
            projections.fuse_linears(self, list(GATE_UP), "gate_up_proj")
        elif not projections.is_fused(value) and self.fused:
            projections.split_linear(self, "gate_up_proj", list(GATE_UP),
                                     [self.intermediate_size] * 2)

    def project_gate_up(self, x: torch.Tensor):
        """(B, S, d) -> gate, up (B, S, i); views of one GEMM's output when fused."""
        if self.fused:
            return projections.split_gate_up(self.gate_up_proj(x))
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:  # the activation reads [gate | up] (B, S, 2i) as one tensor
            return self.down_proj(projections.swiglu(self.gate_up_proj(x), self.activation))
        gate, up = self.project_gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). The add before the
    second norm is handed to the norm, which fuses it when its backend can."""

    def __init__(self, cfg: ModelConfig, switches: Switches):
        super().__init__()
        norm = switches.enable_fused_normalization
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm)
        self.self_attn = Attention(cfg, switches.enable_flash_attention,
                                   switches.enable_fused_projections)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm)
        self.mlp = MLP(cfg, switches.enable_fused_projections)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin)
        normed, h = self.post_attention_layernorm(a, residual=x)  # h = x + a
        return h + self.mlp(normed)


class LlamaModel(nn.Module):
    """Embedding, the decoder layers, the final norm.

    Switch 4 (`switches.gradient_checkpoint_config`, chapter 04) is applied in the layer
    loop: the layers it picks run under `checkpointing.checkpoint` while training with
    gradients on. This module is one pipeline stage; `stage` says which (stage,
    num_stages, model_chunk_id, num_model_chunks) once pipeline code has sliced
    `layers`, and is None for the whole model (one stage)."""

    def __init__(self, cfg: ModelConfig, switches: Switches):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, switches)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                            switches.enable_fused_normalization)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta)
        self.stage: tuple[int, int, int, int] | None = None
        self.set_gradient_checkpointing(switches.gradient_checkpoint_config)

    def set_gradient_checkpointing(self, config) -> LlamaModel:
        """Apply a `GradientCheckpointConfig` (None: store everything); checked now, so
        a bad per-stage list fails here and not in the first training step."""
        self.gradient_checkpoint_config = checkpointing.resolve(config)
        self.checkpointed_layers()
        return self

    def checkpointed_layers(self) -> tuple[bool, ...]:
        """One flag per layer held here: does it recompute its forward in the backward?"""
        config, n = self.gradient_checkpoint_config, len(self.layers)
        if config is None:
            return (False,) * n
        stage, num_stages, chunk, num_chunks = self.stage or (0, 1, 0, 1)
        k = config.num_ckpt_layers(stage, num_stages, n, chunk, num_chunks)
        return (True,) * k + (False,) * (n - k)  # the first k, as ColossalAI

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, S, d)
        cos, sin = self.rotary_emb(input_ids.shape[1], input_ids.device)
        recompute = self.training and torch.is_grad_enabled()
        mode = self.gradient_checkpoint_config and self.gradient_checkpoint_config.mode
        for layer, ckpt in zip(self.layers, self.checkpointed_layers()):
            if ckpt and recompute:  # keep x only (or the GEMM outputs: selective)
                x = checkpointing.checkpoint(layer, x, cos, sin, mode=mode,
                                             skip_gemm_k=checkpointing.last_gemm_k(layer))
            else:
                x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Decoder + output head. `forward(input_ids, labels=None)` returns the logits, or
    the mean next-token cross-entropy when `labels` (already shifted) are given."""

    def __init__(self, cfg: ModelConfig, switches: Switches | None = None):
        super().__init__()
        self.cfg = cfg
        self.switches = switches or Switches.naive()
        self.model = LlamaModel(cfg, self.switches)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.lm_head(self.model(input_ids))  # (B, S, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().long())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------ switches, in place

    def set_switches(self, switches: Switches) -> LlamaForCausalLM:
        """Re-point every part at the kernels `switches` picks. Weights keep their
        values; switch 3 restacks the projections in place (new Parameters: make the
        optimizer afterwards). The precision is fixed when building (parameter dtype,
        fp8 linears), so a different one is an error rather than silently ignored."""
        if switches.precision != self.switches.precision:
            raise ValueError(
                f"set_switches cannot change precision {self.switches.precision!r} to "
                f"{switches.precision!r} in place yet (it sets the parameter dtype and "
                "the fp8 linears when building): rebuild with "
                "build_model(cfg, switches)")
        self.switches = switches
        for m in self.modules():
            if isinstance(m, Attention):
                m.attention_backend = switches.enable_flash_attention
                m.set_fused(switches.enable_fused_projections)
            elif isinstance(m, MLP):
                m.set_fused(switches.enable_fused_projections)
            elif isinstance(m, RMSNorm):
                m.backend = switches.enable_fused_normalization
            elif isinstance(m, LlamaModel):
                m.set_gradient_checkpointing(switches.gradient_checkpoint_config)
        return self

    # ------------------------------------------------------- Hugging Face round trip

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict in `transformers.LlamaForCausalLM` layout (same names). With
        fused projections q/k/v and gate/up come out as row views of the fused weights;
        they are copied here so that each tensor owns its storage (safetensors refuses
        tensors that share one)."""
        return {k: v.clone() if _is_slice(v) else v for k, v in self.state_dict().items()}

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a `transformers.LlamaForCausalLM` state dict (rotary buffers ignored)."""
        sd = {k: v for k, v in state_dict.items() if "rotary_emb" not in k}
        if self.cfg.tie_word_embeddings:
            sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        return self.load_state_dict(sd, strict=strict)

    @classmethod
    def from_hf(cls, hf_model, switches: Switches | None = None) -> LlamaForCausalLM:
        """Build from a `transformers.LlamaForCausalLM` (its config and weights)."""
        model = cls(ModelConfig.from_hf(hf_model.config), switches)
        model.load_hf_state_dict(hf_model.state_dict())
        return model.to(next(hf_model.parameters()).device)

    def to_hf(self):
        """An equivalent `transformers.LlamaForCausalLM` holding copies of our weights."""
        from transformers import LlamaForCausalLM as HFLlama

        hf = HFLlama(self.cfg.to_hf())
        missing, unexpected = hf.load_state_dict(self.hf_state_dict(), strict=False)
        missing = [k for k in missing if "rotary_emb" not in k]
        if missing or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        return hf.to(next(self.parameters()).device)


def _is_slice(t: torch.Tensor) -> bool:
    """A view of part of a larger storage (a row block of a fused weight)."""
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def build_model(cfg: ModelConfig, switches: Switches | None = None,
                device: torch.device | str | None = None) -> LlamaForCausalLM:
    """Construct directly on `device` (no CPU detour for multi-GB models), weights fp32.

    bf16-pure keeps bf16 parameters (the optimizer keeps fp32 masters); every other
    precision keeps fp32 parameters and autocasts the matmuls (fp16: with dynamic loss
    scaling in `train.make_step`). fp8 also swaps every `nn.Linear` whose shape allows
    it for an `Fp8Linear` sharing its weight (`switches.fp8.convert_to_fp8`; options
    from `switches.extra`: fp8_scaling, fp8_history, fp8_skip, fp8_backend, ...)."""
    switches = switches or Switches.naive()
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if switches.precision == "fp8":
        from colossal_lab.switches import fp8

        fp8.check_fp8_supported(device)  # before allocating a multi-GB model
        ckpt = switches.gradient_checkpoint_config
        if (switches.extra.get("fp8_scaling") == "delayed"
                and getattr(ckpt, "mode", "full") != "full"):
            raise ValueError(
                "fp8_scaling='delayed' updates its amax history inside the forward, so a "
                f"selective recompute (mode={ckpt.mode!r}) replays different ops; use "
                "fp8_scaling='dynamic' or GradientCheckpointConfig(mode='full')")
    with device:
        model = LlamaForCausalLM(cfg, switches)
    if switches.precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    elif switches.precision == "fp8":
        fp8.convert_to_fp8(model, fp8.Fp8Config.from_extra(switches.extra),
                           skip=tuple(switches.extra.get("fp8_skip", ())))
    return model
