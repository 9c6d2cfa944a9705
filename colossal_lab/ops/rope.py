"""Rotary position embedding of q and k (`enable_fused_rope`), fused into one kernel.

Attention rotates every query and key head vector by its position (Su et al., RoFormer,
2021): with x = [x1 | x2] (LLaMA's half-split layout) and θ_j(s) = s · base^(−2j/D)::

    rope(x) = x · cos θ + rotate_half(x) · sin θ,    rotate_half([x1 | x2]) = [−x2 | x1]

Eager PyTorch runs that as six element-wise kernels per tensor, 10·e bytes per element
of q (e bytes each) against 2·e for one kernel; the backward, the rotation by −θ, the
same (`kernels.rope` has the table; `results/h200/rope.json` the times).

q (B, S, Hq, D) and k (B, S, Hkv, D) are taken *before* the transpose to (B, H, S, D):
the Triton kernel reads any row strides (column slices of the fused qkv output) and
writes contiguous (B, S, H, D), so the caller's transpose is a view and the gradient
needs no transposing copy. cos/sin are (S', D) fp32 tables (S' ≥ S), or (S', D/2).

Backends (the attention modules' `rope_backend`, which `switches.rope` sets): False /
"eager" (`rotary_ref`), "compile" (`torch.compile` of it), "triton" (ours; on CPU tensors
only under the interpreter, else "eager" through `colossal_lab.fallback`), True
("triton" on a GPU, "eager" on the CPU).
"""

from __future__ import annotations

import functools

import torch

from colossal_lab.fallback import fallback
from colossal_lab.kernels.rope import rope_qkv_triton, rope_triton, split_heads
from colossal_lab.ops import kernel_switch

BACKENDS = ("eager", "compile", "triton")


# ----------------------------------------------------------------------------- reference


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [−x2 | x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q (B, Hq, S, D) and k (B, Hkv, S, D) by position; tables (S, D) in fp32:
    the model's eager path (switch off), in the attention's (B, H, S, D) layout."""
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _full_table(t: torch.Tensor, seq_len: int, head_dim: int, dtype) -> torch.Tensor:
    """(≥ S, D) or (≥ S, D/2) -> (S, 1, D) in `dtype`, broadcasting over heads."""
    t = t[:seq_len]
    if t.shape[-1] == head_dim // 2:
        t = torch.cat((t, t), dim=-1)  # the half-split table repeats its angles
    return t.to(dtype)[:, None, :]


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE, eager: x · cos + rotate_half(x) · sin for q and k.

    Args:
        q: (B, S, Hq, D) queries.
        k: (B, S, Hkv, D) keys.
        cos, sin: (S', D) half-split tables with S' ≥ S (fp32, as the model builds
            them), or their first halves (S', D/2); rows [0, S) are used.
    Returns:
        q_rot (B, S, Hq, D), k_rot (B, S, Hkv, D). The tables are cast to q's dtype
        first, as `apply_rotary` does, so in bf16 this is the model's numerics.
    """
    S, D = q.shape[1], q.shape[-1]
    cos = _full_table(cos, S, D, q.dtype)  # (S, 1, D)
    sin = _full_table(sin, S, D, q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ------------------------------------------------------------------------------- dispatch


def _validate(value) -> None:
    kernel_switch.check_value(value, BACKENDS, "rope_backend")


def resolve_backend(value, device=None) -> str:
    """The backend the switch value picks on `device`: "eager", "compile" or "triton"
    (`kernel_switch.resolve`: "triton" without a GPU or the interpreter falls back to
    "eager")."""
    return kernel_switch.resolve(value, device, names=BACKENDS, field="rope_backend",
                                 what="RoPE")


@functools.cache
def _compiled():
    return torch.compile(rotary_ref)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           backend="eager") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding with a selectable backend.

    Args:
        q: (B, S, Hq, D) queries, before the transpose to (B, Hq, S, D); may be a
            strided view (a column slice of the fused qkv output, unflattened).
        k: (B, S, Hkv, D) keys, likewise.
        cos, sin: (S', D) fp32 half-split tables, S' ≥ S, or (S', D/2).
        backend: "eager", "compile", "triton", or a switch value (True / False / None).
    Returns:
        q_rot (B, S, Hq, D), k_rot (B, S, Hkv, D) in q's dtype; callers transpose them
        to (B, H, S, D) afterwards ("triton" returns contiguous tensors, so that
        transpose is a view whose gradient needs no copy).
    """
    name = resolve_backend(backend, q.device)
    if name == "triton":
        return rope_triton(q, k, cos, sin)
    if name == "compile":
        try:
            return _compiled()(q, k, cos, sin)
        except Exception as e:  # no C++ compiler, an unsupported torch build, ...
            fallback(f"torch.compile of RoPE failed ({type(e).__name__}: "
                     f"{str(e)[:200]})", "eager")
    return rotary_ref(q, k, cos, sin)


def split_rotary(qkv: torch.Tensor, n_q: int, n_kv: int, cos: torch.Tensor,
                 sin: torch.Tensor, backend="eager"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv projection's output (B, S, (n_q + 2·n_kv)·D) split into q, k, v
    (B, S, H, D), with RoPE on q and k (`rotary`). With "triton" the split and the
    rotation are one autograd node whose backward writes the qkv gradient in one piece
    (`kernels.rope.RotaryQKVFunction`): no concatenation of dq, dk and dv."""
    name = resolve_backend(backend, qkv.device)
    if name == "triton":
        return rope_qkv_triton(qkv, n_q, n_kv, cos, sin)
    q, k, v = split_heads(qkv, n_q, n_kv)
    q, k = rotary(q, k, cos, sin, name)
    return q, k, v
