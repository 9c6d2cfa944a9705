"""A plain LLaMA: the model every switch is applied to.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU feed-forward,
with module and parameter names identical to Hugging Face's `LlamaForCausalLM`, so its
state dicts load both ways and the logits match (`tests/test_model.py`). No constructor
here takes a switch: build the plain model, then `apply_switches(model, switches)`
(`colossal_lab.switches.apply`) sets the kernels, fuses the projections, checkpoints
layers and sets the precision, each switch through its own function, in place.

What a switch changes is an attribute the forward reads, shown where it is read:
`Attention.attention_backend` and `RMSNorm.backend` pick kernels; a fused `qkv_proj` /
`gate_up_proj` child (switch 3) replaces the separate projections; a checkpointed
decoder layer gets its forward wrapped (switch 4).

Shapes: B batch, S sequence, d hidden, Hq/Hkv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.config import ModelConfig
from colossal_lab.ops import (
    cross_entropy,
    embedding,
    fp8_mlp,
    fp8_qkv,
    projections,
    rope,
    swiglu,
)
from colossal_lab.ops.attention import attention
from colossal_lab.ops.norm import RMSNorm
from colossal_lab.ops.rope import apply_rotary, rotate_half  # noqa: F401 (public)


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


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads.

    `attention_backend` is the attention kernel (switch 1; False: materialised scores),
    `rope_backend` the rotary embedding's (False: the element-wise chain). Fused
    projections (switch 3) hold q/k/v as one `qkv_proj` (rows [q; k; v]) instead of
    `q_proj`, `k_proj`, `v_proj`; either way the state dict has the separate names."""

    attention_backend = False
    rope_backend = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * D, d, bias=False)
        # Hugging Face's names in the state dict, also for a fused `qkv_proj`
        projections.register_hf_layout(self, "qkv_proj", projections.FUSIONS["qkv_proj"],
                                       self.qkv_sizes())

    def qkv_sizes(self) -> list[int]:
        """Widths of q, k, v: the row blocks of a fused `qkv_proj.weight`."""
        c = self.cfg
        return list(swiglu.qkv_sizes(c.num_attention_heads, c.num_key_value_heads,
                                          c.head_dim))

    @property
    def fused(self) -> bool:
        return "qkv_proj" in self._modules

    def project_qkv(self, x: torch.Tensor):
        """(B, S, d) -> q (B, S, Hq*D), k and v (B, S, Hkv*D)."""
        if self.fused:  # one GEMM; q, k, v are column views of its output
            return self.qkv_proj(x).split(self.qkv_sizes(), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        D = self.cfg.head_dim
        if self.fused and self.rope_backend:  # the split and RoPE as one autograd node:
            # its backward writes one qkv gradient instead of concatenating three
            n_q, n_kv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
            if fp8_qkv.fusable(self.qkv_proj, self.rope_backend, x.device):
                q, k, v = fp8_qkv.fp8_qkv_rope(x, self.qkv_proj, n_q, n_kv, cos, sin)
            else:
                q, k, v = rope.split_rotary(self.qkv_proj(x), n_q, n_kv, cos, sin,
                                            self.rope_backend)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, S, D)
        else:
            q, k, v = self.project_qkv(x)
            q, k, v = (t.unflatten(-1, (-1, D)) for t in (q, k, v))  # (B, S, H, D) views
            if self.rope_backend:  # one kernel on the projections' layout
                q, k = rope.rotary(q, k, cos, sin, self.rope_backend)
                q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, S, D)
            else:
                q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return self._attend(q, k, v)

    def _attend(self, q, k, v):
        """q, k (B, H, S, D), v (B, S, Hkv, D) -> the attention core and o_proj, (B, S, d)."""
        o = attention(q, k, v.transpose(1, 2), causal=True,
                      backend=self.attention_backend)  # (B, Hq, S, D)
        # (B, S, Hq*D); S from o, not x: under sequence parallelism x is a shard
        return self.o_proj(o.transpose(1, 2).flatten(2))

    def fuses_norm(self, norm, device) -> bool:
        """Can `forward_normed` take `norm` in: the fp8 qkv projection with RoPE, its
        input written by the norm (`fp8_qkv.fusable` with `norm`)?"""
        return self.fused and bool(self.rope_backend) and fp8_qkv.fusable(
            self.qkv_proj, self.rope_backend, device, norm)

    def forward_normed(self, norm, x, residual, cos, sin):
        """`self(norm(x + residual), cos, sin)` and the stream x + residual (residual
        None: of norm(x), and x), the norm writing qkv_proj's fp8 input (`ops.fp8_norm`)."""
        n_q, n_kv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q, k, v, h = fp8_qkv.fp8_qkv_rope(x, self.qkv_proj, n_q, n_kv, cos, sin, norm,
                                          residual)
        return self._attend(q.transpose(1, 2), k.transpose(1, 2), v), h


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020).

    Fused projections (switch 3) hold gate/up as one `gate_up_proj` (rows [gate; up])
    and run `activation`, the SwiGLU kernel that reads its (..., 2i) output; the state
    dict keeps the separate names. When both projections are fp8 linears (switch 6) and
    the activation is our Triton kernel, the SwiGLU also writes the fp8 casts of its
    output and gradient (`ops.fp8_mlp`): h and d(gate_up) are never written in bf16."""

    activation = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        projections.register_hf_layout(self, "gate_up_proj",
                                       projections.FUSIONS["gate_up_proj"], [i, i])

    @property
    def fused(self) -> bool:
        return "gate_up_proj" in self._modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:  # the activation reads [gate | up] (B, S, 2i) as one tensor
            if fp8_mlp.fusable(self.gate_up_proj, self.down_proj, self.activation,
                               x.device):
                return fp8_mlp.fp8_swiglu_mlp(x, self.gate_up_proj, self.down_proj)
            return self.down_proj(swiglu.swiglu(self.gate_up_proj(x), self.activation))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuses_norm(self, norm, device) -> bool:
        """Can `forward_normed` take `norm` in: the fused fp8 MLP, its input written by
        the norm (`fp8_mlp.fusable` with `norm`)?"""
        return self.fused and fp8_mlp.fusable(self.gate_up_proj, self.down_proj,
                                              self.activation, device, norm)

    def forward_normed(self, norm, x, residual):
        """`self(norm(x + residual))` and the stream x + residual (residual None: of
        norm(x), and x), the norm writing gate_up_proj's fp8 input (`ops.fp8_norm`)."""
        return fp8_mlp.fp8_swiglu_mlp(x, self.gate_up_proj, self.down_proj, norm, residual)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). The add before the
    second norm is handed to the norm, which fuses it when its backend can.

    `LlamaModel` may defer the last add too (`defer_residual`): the layer then returns
    (mlp(norm(h)), h) unsummed and the next layer's first norm (or the final norm)
    adds them, as the second norm adds h; `residual` is that pending stream.

    With fp8 projections each norm may write its block's fp8 input itself
    (`_pre_norm`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                residual: torch.Tensor | None = None, defer: bool = False):
        # residual: the previous layer's deferred add, x = x + residual in the norm
        a, x = _pre_norm(self.input_layernorm, self.self_attn, x, residual, cos, sin)
        m, h = _pre_norm(self.post_attention_layernorm, self.mlp, a, x)  # h = x + a
        return (m, h) if defer else h + m


def _pre_norm(norm, block, x, residual, *args):
    """block(norm(x + residual), *args) and the stream x + residual (residual None:
    block(norm(x), *args) and x). With fp8 projections the norm may run inside the
    block's first projection, writing its fp8 input (`block.forward_normed`,
    `ops.fp8_norm`), when `block.fuses_norm` says so and no hook waits for the block's
    own call."""
    if not (block._forward_hooks or block._forward_pre_hooks) \
            and block.fuses_norm(norm, x.device):
        return block.forward_normed(norm, x, residual, *args)
    if residual is None:
        return block(norm(x), *args), x
    normed, h = norm(x, residual=residual)
    return block(normed, *args), h


class LlamaModel(nn.Module):
    """Embedding, the decoder layers, the final norm. A layer that switch 4
    checkpoints (`switches.checkpointing.apply`) is called the same way: its forward
    recomputes in the backward.

    `embedding_backend` is the embedding switch's value (its backward;
    `switches.embedding`). `defer_residual` (set by the norm switch when its backend
    fuses adds) hands each layer's last residual add to the next norm: one pass over
    the stream fewer forward, and backward no separate sum of the two gradients of a
    layer's input (on the H200 at LLaMA-7B-8L the adds saved outweigh the norms' extra
    time about two to one)."""

    embedding_backend = False
    defer_residual = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = embedding.lookup(input_ids, self.embed_tokens, self.embedding_backend)  # (B, S, d)
        cos, sin = self.rotary_emb(input_ids.shape[1], input_ids.device)
        if not self.defer_residual:
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.norm(x)
        residual = None  # the stream whose add into x is pending
        for layer in self.layers:
            x, residual = layer(x, cos, sin, residual, True)
        return self.norm(x) if residual is None else self.norm(x, residual=residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder + output head. `forward(input_ids, labels=None)` returns the logits, or
    the mean next-token cross-entropy when `labels` (already shifted) are given: the
    head and the loss in one chunked pass when `loss_backend` is set (the fused loss,
    `switches.loss`; the logits never exist whole).

    `switches` records what `apply_switches` last applied (None on a plain model)."""

    loss_backend = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.switches = None
        self.model = LlamaModel(cfg)
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
        hidden = self.model(input_ids)  # (B, S, d)
        if labels is not None and self.loss_backend:
            return cross_entropy.fused_linear_cross_entropy(
                hidden.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                backend=self.loss_backend)
        logits = self.lm_head(hidden)  # (B, S, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().long())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

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
    def from_hf(cls, hf_model) -> LlamaForCausalLM:
        """A plain model from a `transformers.LlamaForCausalLM` (its config and
        weights), on its device; apply switches afterwards."""
        device = next(hf_model.parameters()).device
        model = build_model(ModelConfig.from_hf(hf_model.config), device)
        model.load_hf_state_dict(hf_model.state_dict())
        return model

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


def build_model(cfg: ModelConfig, device: torch.device | str | None = None
                ) -> LlamaForCausalLM:
    """The plain model, constructed directly on `device` (no CPU detour for multi-GB
    models; default: the GPU when there is one), fp32 weights, every switch off.
    Then `apply_switches(model, switches)`."""
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"build_model(cfg, device) builds the plain model; got a "
            f"{type(device).__name__} for device. Switches are applied afterwards: "
            "apply_switches(build_model(cfg, device), switches)")
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    with device:
        return LlamaForCausalLM(cfg)


def layer_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The transformer-layer lists of `model`: every `nn.ModuleList` named `layers`
    (ours, Hugging Face's, one per pipeline chunk once pipelines slice them)."""
    return [m for name, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"]
