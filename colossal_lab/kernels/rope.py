"""Rotary position embedding (RoPE) in Triton: q and k in one launch, forward and backward.

One kernel does both directions, reading the projections' (B, S, H, D) layout as it is.

Math (Su et al., RoFormer, 2021), LLaMA's half-split convention: a head vector
x = [x1 | x2] of D = 2·h dims is rotated, pair by pair (x1_j, x2_j), by the angle
θ_j(s) = s · base^(−2j/D) of its position s::

    y1 = x1 · cos θ − x2 · sin θ            (the first D/2 dims)
    y2 = x2 · cos θ + x1 · sin θ            (the last D/2 dims)

which is the model's `x · cos + rotate_half(x) · sin` with its (S, D) tables, whose two
halves hold the same angles. The rotation is orthogonal, so the backward is its
transpose, the rotation by −θ::

    dx1 = dy1 · cos θ + dy2 · sin θ
    dx2 = dy2 · cos θ − dy1 · sin θ

the forward kernel with sin negated (`BACKWARD`). Nothing of q or k is saved for the
backward: only the tables (S·D/2 fp32 each).

Layout. q (B, S, Hq, D) and k (B, S, Hkv, D), before the transpose to (B, H, S, D);
any strides over B, S and H, unit stride over D, so q and k may be column slices of the
fused qkv output, `q.unflatten(-1, (Hq, D))` (rows (Hq + 2·Hkv)·D apart). The outputs
are new contiguous (B, S, H, D) tensors (not written into the fused output: autograd
refuses in-place writes to `split`'s views, and v, which attention saves, shares that
storage). The backward takes gradients in any strides and writes contiguous ones.

Tables. cos and sin (S', D) fp32, S' ≥ S, or their first halves (S', D/2): the kernel
reads only columns [0, D/2), rounding once to the output dtype, so it is slightly *more*
accurate than the eager path, which rounds the tables to bf16 first.

Bytes per element of q and k (N = B·S·(Hq + Hkv)·D elements of e bytes; the eager column
counted op by op by `colossal_lab.benchmarks.rope.eager_traffic`)::

                   eager (apply_rotary)                        Triton (this file)
    forward        mul 2, neg 1, cat 2, mul 2, add 3 = 10 N e   2 N e, 1 kernel
    backward       the same                          = 10 N e   2 N e, 1 kernel
    fused qkv,     + a transposing copy of the (B, H, S, D)     nothing: the gradient
    backward       gradient to (B, S, H·D): 2 N e               is (B, S, H, D) already

With fused qkv, `RotaryQKVFunction` also takes the split into its node: its backward
rotates dq and dk straight into their columns of the qkv gradient and copies dv into the
rest in the same launch (N e / 2 at Hq = Hkv), where autograd would concatenate dq, dk,
dv (3 N e). At LLaMA-7B, B 4, S 4096, bf16, eager moves 2.5 GiB each way per layer,
this kernel 0.5 GiB.

Launch: a 2-D grid, (B·S tokens) × (head blocks). Program (t, j) loads token t's cos/sin
half-row once and rotates heads [j·BLOCK_H, (j+1)·BLOCK_H) of q and k as (BLOCK_H, D/2)
tiles per half; BLOCK_H = next_power_of_2(max(Hq, Hkv)) capped at `MAX_TILE` elements,
so every model we run needs one head block. Loads are 16-byte vectors when D/2 and the
strides are multiples of 8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import _to_dtype

MAX_TILE = 4096
"""Elements of one (BLOCK_H, D/2) half-tile per tensor: 64 heads at D = 128."""
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_halves(x1, x2, cos, sin):
    """(x1·cos − x2·sin, x2·cos + x1·sin) in fp32 with the fused multiply-adds written
    out: left to the compiler, a·b − c·d may become fma(a, b, −c·d) in one kernel and
    fma(−c, d, a·b) in another, which round differently. Every kernel that rotates
    (`rope_fp8` too) calls this, so they write the same bits."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotate_heads(
    X,  # this token's first head of the input, heads stride_h apart, unit column stride
    OUT,  # this token's first head of the output, contiguous (n_heads, 2·HALF)
    stride_h,  # elements between heads of X
    n_heads,  # heads of this tensor (Hq or Hkv)
    heads,  # (BLOCK_H,) head indices of this program
    cols,  # (BLOCK_D,) columns of the first half
    cos,  # (BLOCK_D,) fp32 cos θ of this token
    sin,  # (BLOCK_D,) fp32 sin θ of this token (−sin θ for the backward)
    HALF: tl.constexpr,  # D / 2
):
    """[x1 | x2] -> [x1·cos − x2·sin | x2·cos + x1·sin] for a (BLOCK_H, D) tile."""
    mask = (heads < n_heads)[:, None] & (cols < HALF)[None, :]
    x_ptrs = X + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _rotate_halves(x1, x2, cos[None, :], sin[None, :])
    out_ptrs = OUT + heads[:, None] * (2 * HALF) + cols[None, :]
    tl.store(out_ptrs, _to_dtype(y1, OUT.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + HALF, _to_dtype(y2, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(
    X,  # this token's first head of the input, heads stride_h apart, unit column stride
    OUT,  # this token's first head of the output, contiguous (n_heads, 2·HALF)
    stride_h,  # elements between heads of X
    n_heads,  # heads of this tensor (Hkv)
    heads,  # (BLOCK_H,) head indices of this program
    cols,  # (BLOCK_D,) columns of the first half
    HALF: tl.constexpr,  # D / 2
):
    """A (BLOCK_H, D) tile copied as it is (dv into the qkv gradient), in two halves
    with the same masks as `_rotate_heads`."""
    mask = (heads < n_heads)[:, None] & (cols < HALF)[None, :]
    x_ptrs = X + heads[:, None] * stride_h + cols[None, :]
    out_ptrs = OUT + heads[:, None] * (2 * HALF) + cols[None, :]
    tl.store(out_ptrs, tl.load(x_ptrs, mask=mask, other=0.0), mask=mask)
    tl.store(out_ptrs + HALF, tl.load(x_ptrs + HALF, mask=mask, other=0.0), mask=mask)


@triton.jit
def _rope_kernel(
    Q,  # (B, S, Hq, D) queries, strides stride_q*, unit column stride
    K,  # (B, S, Hkv, D) keys, strides stride_k*, unit column stride
    V,  # (B, S, Hkv, D) copied to VO unrotated when COPY_V (dv); else unused
    QO,  # (B, S, Hq, D) output: heads contiguous, tokens stride_qo apart
    KO,  # (B, S, Hkv, D) output: heads contiguous, tokens stride_ko apart
    VO,  # (B, S, Hkv, D) output of the copy, tokens stride_vo apart (COPY_V)
    COS,  # (≥ S, ≥ D/2) cos table; columns [0, D/2) are read, unit column stride
    SIN,  # (≥ S, ≥ D/2) sin table, COS's strides
    stride_qb, stride_qs, stride_qh,  # elements between batches, positions, heads of Q
    stride_kb, stride_ks, stride_kh,  # the same for K
    stride_vb, stride_vs, stride_vh,  # the same for V
    stride_table,  # elements between rows (positions) of COS and SIN
    stride_qo, stride_ko, stride_vo,  # elements between tokens of QO, KO, VO
    seq_len,  # S
    n_q_heads,  # Hq
    n_kv_heads,  # Hkv
    HALF: tl.constexpr,  # D / 2
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_D: tl.constexpr,  # next_power_of_2(HALF)
    BACKWARD: tl.constexpr,  # rotate by −θ: the gradient
    COPY_V: tl.constexpr,  # also copy V's heads of this token into VO
):
    """Rotate heads of q and k of one token by θ(s) (or −θ(s)), math in fp32; with
    COPY_V, copy v's heads of the token too (the qkv gradient's dv, in the same pass)."""
    token = tl.program_id(0).to(tl.int64)  # b·S + s; int64: no overflow in offsets
    b = token // seq_len
    s = token % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HALF
    cos = tl.load(COS + s * stride_table + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + s * stride_table + cols, mask=col_ok, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = -sin  # R(θ)ᵀ = R(−θ)
    _rotate_heads(Q + b * stride_qb + s * stride_qs, QO + token * stride_qo,
                  stride_qh, n_q_heads, heads, cols, cos, sin, HALF)
    _rotate_heads(K + b * stride_kb + s * stride_ks, KO + token * stride_ko,
                  stride_kh, n_kv_heads, heads, cols, cos, sin, HALF)
    if COPY_V:
        _copy_heads(V + b * stride_vb + s * stride_vs, VO + token * stride_vo,
                    stride_vh, n_kv_heads, heads, cols, HALF)


# ----------------------------------------------------------------------------- launchers


def _tiling(n_heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, num_warps) for up to `n_heads` heads of D = 2·half."""
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_heads, 1)), max(1, MAX_TILE // block_d))
    warps = max(1, min(8, block_h * block_d // 256))  # ~8 elements per thread per half
    return block_h, block_d, warps


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    """The kernels need unit stride over D; copy only when it is not (an expanded
    gradient, a transposed head dim)."""
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def _token_rows(t: torch.Tensor) -> int | None:
    """Elements between tokens of a (B, S, H, D) tensor whose heads are contiguous and
    whose tokens (b·S + s) are evenly spaced: a contiguous tensor, or column slices of a
    (B, S, W) buffer; None for any other layout."""
    B, S, H, D = t.shape
    sb, ss, sh, sd = t.stride()
    if (sd != 1 and D > 1) or (sh != D and H > 1) or (sb != S * ss and B > 1):
        return None
    return ss


def _launch(q, k, cos_half, sin_half, backward: bool, q_out=None, k_out=None,
            v=None, v_out=None):
    """Rotate q and k into q_out and k_out (new contiguous tensors when not given;
    given ones need `_token_rows`: the backward of `RotaryQKVFunction` passes slices of
    the qkv gradient). With `v` and `v_out` (k's shape), v is copied into v_out in the
    same launch, unrotated: dv into its slice of the qkv gradient, where a separate
    `copy_` of cuDNN's transposed dv ran at a third of the copy bandwidth (strided)."""
    B, S, n_q, D = q.shape
    n_kv = k.shape[2]
    q, k = _unit_columns(q), _unit_columns(k)
    if q_out is None:
        q_out = torch.empty((B, S, n_q, D), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((B, S, n_kv, D), dtype=k.dtype, device=k.device)
    copy_v = v is not None
    if copy_v:
        if v.shape != k.shape or v_out is None or v_out.shape != k.shape:
            raise ValueError(f"v {tuple(v.shape)} and v_out "
                             f"{None if v_out is None else tuple(v_out.shape)} must have "
                             f"k's shape {tuple(k.shape)}")
        v = _unit_columns(v)
    if B * S == 0 or n_q + n_kv == 0:
        return q_out, k_out
    outs = (q_out, k_out, v_out) if copy_v else (q_out, k_out)
    rows = [_token_rows(t) for t in outs]
    if None in rows:
        raise ValueError("RoPE outputs need contiguous heads and evenly spaced tokens; "
                         f"got strides {[tuple(t.stride()) for t in outs]}")
    if not copy_v:
        v, v_out, rows = k, k_out, rows + [0]  # not read: COPY_V is off
    block_h, block_d, warps = _tiling(max(n_q, n_kv), D // 2)
    grid = (B * S, triton.cdiv(max(n_q, n_kv), block_h))
    _rope_kernel[grid](
        q, k, v, q_out, k_out, v_out, cos_half, sin_half,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cos_half.stride(0), *rows, S, n_q, n_kv,
        HALF=D // 2, BLOCK_H=block_h, BLOCK_D=block_d, BACKWARD=backward,
        COPY_V=copy_v, num_warps=warps)
    return q_out, k_out


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos_half: torch.Tensor,
                 sin_half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions, one launch.

    Args:
        q: (B, S, Hq, D), any strides over B, S, H.
        k: (B, S, Hkv, D), the same.
        cos_half, sin_half: (≥ S, ≥ D/2) tables, unit column stride; columns [0, D/2)
            are read (`half_tables` makes them from the model's (S, D) tables).
    Returns:
        q_rot (B, S, Hq, D), k_rot (B, S, Hkv, D): contiguous, in q's and k's dtype.
    """
    return _launch(q, k, cos_half, sin_half, backward=False)


def rope_backward(dq: torch.Tensor, dk: torch.Tensor, cos_half: torch.Tensor,
                  sin_half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of `rope_forward`: dq, dk rotated by −θ. Same shapes and layouts."""
    return _launch(dq, dk, cos_half, sin_half, backward=True)


# ------------------------------------------------------------------------------- checks


def half_tables(cos: torch.Tensor, sin: torch.Tensor, seq_len: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the tables and return views of their first halves, (S', D/2).

    Takes (S', D) half-split tables (the model's; the second half is assumed equal to
    the first, as `RotaryEmbedding` builds them: not checked, which would need a
    device sync) or their first halves (S', D/2), with S' ≥ seq_len; leading
    dimensions of size 1 (Hugging Face's (1, S, D)) are dropped."""
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have "
                         "the same shape")
    while cos.dim() > 2 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    if cos.dim() != 2:
        raise ValueError(f"cos/sin must be (S, D) or (S, D/2) tables, one row per "
                         f"position; got {tuple(cos.shape)} (per-batch positions are "
                         "not supported: gather the rows first)")
    half = head_dim // 2
    if cos.shape[1] not in (head_dim, half):
        raise ValueError(f"cos/sin have {cos.shape[1]} columns; head_dim={head_dim} "
                         f"needs {head_dim} (the half-split table) or {half} (its first "
                         "half)")
    if cos.shape[0] < seq_len:
        raise ValueError(f"cos/sin have {cos.shape[0]} positions, fewer than the "
                         f"sequence length {seq_len}; build the tables for at least "
                         f"{seq_len}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} is {t.dtype}; expected a float table (float32 "
                             "as the model builds it)")
    cos, sin = cos[:, :half], sin[:, :half]
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    if sin.stride(0) != cos.stride(0):  # the kernel takes one row stride for both
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    """q (B, S, Hq, D) and k (B, S, Hkv, D): same B, S, D, dtype and device; D even."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected (B, S, H, D) (a "
                f"(B, S, H·D) projection output is {name}.unflatten(-1, (H, D)), a view)")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in "
                         "batch, sequence and head_dim: (B, S, Hq, D) and (B, S, Hkv, D)")
    if q.shape[3] % 2:
        raise ValueError(f"head_dim={q.shape[3]} is odd; RoPE rotates pairs of dims, so "
                         "it needs an even head_dim")
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} and k {k.dtype}; both must be one of float32, "
                         "float16, bfloat16")
    if k.device != q.device:
        raise ValueError(f"q is on {q.device} and k on {k.device}")


# ------------------------------------------------------------------------------ autograd


def _rotate_saving_tables(ctx, q, k, cos, sin):
    """The forward both autograd nodes share: check q and k, build the half tables,
    rotate, and save the tables (all the backward needs)."""
    check_qk(q, k)
    cos_h, sin_h = half_tables(cos, sin, q.shape[1], q.shape[3])
    if cos_h.device != q.device:
        raise ValueError(f"cos/sin are on {cos_h.device}, q on {q.device}")
    ctx.save_for_backward(cos_h, sin_h)
    return rope_forward(q, k, cos_h, sin_h)


class RotaryFunction(torch.autograd.Function):
    """(q_rot, k_rot) = RoPE(q, k); saves only the tables. No gradient for the tables
    (the model's are constants)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        return _rotate_saving_tables(ctx, q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos_h, sin_h = ctx.saved_tensors
        dq_in, dk_in = rope_backward(dq, dk, cos_h, sin_h)
        return dq_in, dk_in, None, None


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q (B, S, Hq, D) and k (B, S, Hkv, D), any strides over B, S
    and H (column slices of a fused qkv output included), with tables cos, sin of shape
    (≥ S, D) (half-split, fp32) or (≥ S, D/2). Returns new contiguous (B, S, Hq, D) and
    (B, S, Hkv, D) tensors in q's dtype; transpose them for the attention afterwards."""
    return RotaryFunction.apply(q, k, cos, sin)


class RotaryQKVFunction(torch.autograd.Function):
    """The fused projection's split and RoPE in one autograd node: (B, S, (Hq + 2·Hkv)·D)
    qkv -> q_rot (B, S, Hq, D) and k_rot (B, S, Hkv, D), new and contiguous, and v
    (B, S, Hkv, D), a view of qkv. The backward writes dq and dk (rotated back) and dv
    into one qkv gradient, where `split` + `RotaryFunction` leave autograd to
    concatenate the three (a read and a write of all of them)."""

    @staticmethod
    def forward(ctx, qkv, n_q, n_kv, cos, sin):
        q, k, v = split_heads(qkv, n_q, n_kv)
        q_rot, k_rot = _rotate_saving_tables(ctx, q, k, cos, sin)
        ctx.heads = (n_q, n_kv)
        return q_rot, k_rot, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos_h, sin_h = ctx.saved_tensors
        n_q, n_kv = ctx.heads
        B, S, _, D = dq.shape
        dqkv = torch.empty((B, S, (n_q + 2 * n_kv) * D), dtype=dq.dtype, device=dq.device)
        dq_in, dk_in, dv_in = split_heads(dqkv, n_q, n_kv)
        _launch(dq, dk, cos_h, sin_h, backward=True, q_out=dq_in, k_out=dk_in,
                v=dv, v_out=dv_in)
        return dqkv, None, None, None, None


def split_heads(qkv: torch.Tensor, n_q: int, n_kv: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, (n_q + 2·n_kv)·D) -> q (B, S, n_q, D), k and v (B, S, n_kv, D): views."""
    D = qkv.shape[-1] // (n_q + 2 * n_kv)
    if D * (n_q + 2 * n_kv) != qkv.shape[-1] or qkv.dim() != 3:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}; expected (B, S, "
                         f"(n_q + 2·n_kv)·D) with n_q={n_q}, n_kv={n_kv}")
    q, k, v = qkv.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    return q.unflatten(-1, (n_q, D)), k.unflatten(-1, (n_kv, D)), v.unflatten(-1, (n_kv, D))


def rope_qkv_triton(qkv: torch.Tensor, n_q: int, n_kv: int, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused qkv projection output (B, S, (n_q + 2·n_kv)·D) and rotate q and k
    (`RotaryQKVFunction`): q_rot (B, S, n_q, D), k_rot (B, S, n_kv, D) contiguous, v
    (B, S, n_kv, D) a view of qkv; the gradient of qkv comes back in one piece."""
    return RotaryQKVFunction.apply(qkv, n_q, n_kv, cos, sin)
