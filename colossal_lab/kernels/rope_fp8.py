"""RoPE's backward with the fp8 cast of its output fused in: the qkv gradient in e5m2.

With fused projections (switch 3), RoPE (`kernels.rope`) and fp8 linears (switch 6), the
attention's input side is an fp8 `qkv_proj` whose output is split and rotated
(`RotaryQKVFunction`). Composed from the parts, the backward writes the qkv gradient
dqkv (T, (Hq + 2·Hkv)·D) in the activation dtype, and the projection's cast reads it
back to write its e5m2 copies, row-major for dx and transposed for dW (`ops.fp8`). This
kernel rotates dq and dk back, copies dv, and casts, in one pass: only the fp8 copies
are written::

    read dq, dk, dv (T, W) in e bytes;  dx1 = dy1·cos θ + dy2·sin θ, dx2 = dy2·cos θ − dy1·sin θ
    write q(dqkv · s_g) (T, W) and its transpose (W, T_pad), 1 + 1 bytes

Bytes per element of dqkv (bf16, delayed scaling, whose scale is known before the pass):
unfused, RoPE reads 2 and writes 2, the cast reads 2 and writes 1 + 1: 8; fused, 2 + 2 =
4. At llama-7b, 16,384 tokens, W = 12,288, that is 0.8 GB a layer and step. Dynamic
scaling first runs the kernel in its amax-only mode (reads dq, dk, dv once more).

**Rounding.** The rotated gradient is rounded to dq's dtype before it is scaled, as the
unfused path rounds it when it writes dqkv, and the rotation is `kernels.rope`'s
formula (the forward's with sin θ negated), so both paths quantise the same numbers and
write the same fp8 bits. Scale, saturation and the zero padding of the transposed copy
are `kernels.fp8_cast`'s.

**Tiles.** A program takes BLOCK_T tokens of one head (`TILES`, autotuned): the two
halves of its D columns, (BLOCK_T, D/2) each, whose rows pair up in the rotation, each
stored as is and transposed (a transposed row is BLOCK_T bytes). cos and sin are
(BLOCK_T, D/2) tiles, one row per token's position. Heads [0, Hq) read dq,
[Hq, Hq + Hkv) dk, the rest dv (copied, not rotated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from colossal_lab.kernels import INTERPRET
from colossal_lab.kernels._norm_common import _to_dtype
from colossal_lab.kernels.fp8_cast import (
    EPS,
    _cast_torch,
    _format,
    _quantize,
    _scale,
    _store_both,
    _use_triton,
    padded,
)
from colossal_lab.kernels.rope import _rotate_halves, _unit_columns, check_qk

TILES = ((32, 4), (64, 4), (64, 8), (16, 4), (32, 8))
"""(BLOCK_T, num_warps) the autotuner chooses among, for each (tokens, width, outputs
written): the first call of a shape times each and keeps the fastest. A transposed row
is BLOCK_T bytes; at D = 128 six fp32 (BLOCK_T, 64) tiles are live (dy1, dy2, cos, sin,
dx1, dx2): 96 values a thread at 32 tokens and 4 warps. The outputs do not depend on
the tile, bit for bit. Under the interpreter only the first is used."""
_CONFIGS = [triton.Config({"BLOCK_T": t}, num_warps=w)
            for t, w in (TILES[:1] if INTERPRET else TILES)]
_TUNE_KEY = ["n_tokens", "width", "WRITE_Q", "WRITE_QT", "WRITE_AMAX"]


@triton.autotune(configs=_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _rope_fp8_backward_kernel(
    DQ,  # (B, S, Hq, D) gradient of the rotated q, strides stride_q*, unit column stride
    DK,  # (B, S, Hkv, D) gradient of the rotated k
    DV,  # (B, S, Hkv, D) gradient of v (copied)
    Q,  # (T, W) fp8 output q(dqkv · scale), contiguous (WRITE_Q)
    QT,  # (W, ld_qt) fp8 output, Q transposed, columns T..ld_qt-1 zero (WRITE_QT)
    COS,  # (≥ S, ≥ D/2) cos table, columns [0, D/2) read, unit column stride
    SIN,  # (≥ S, ≥ D/2) sin table, COS's strides
    AMAX_SRC,  # (n_src,) fp32: the scale is fp8_max / max(AMAX_SRC) (WRITE_Q or WRITE_QT)
    INV_SCALE,  # (1,) fp32 output: 1 / scale, written by program (0, 0)
    AMAX_OUT,  # (1,) fp32, zero-initialised: max |dqkv| by atomic max (WRITE_AMAX)
    stride_qb, stride_qs, stride_qh,  # elements between batches, positions, heads of DQ
    stride_kb, stride_ks, stride_kh,  # the same for DK
    stride_vb, stride_vs, stride_vh,  # the same for DV
    stride_table,  # elements between rows of COS and SIN
    n_tokens,  # T = B·S
    seq_len,  # S
    n_q_heads,  # Hq
    n_kv_heads,  # Hkv
    width,  # W = (Hq + 2·Hkv)·D, the row length of Q
    ld_qt,  # row length of QT (T padded to a multiple of 16)
    n_src,  # entries of AMAX_SRC
    FP8_MAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    EPS: tl.constexpr,
    WRITE_Q: tl.constexpr,
    WRITE_QT: tl.constexpr,
    WRITE_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_SRC: tl.constexpr,
    HALF: tl.constexpr,  # D / 2
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # next_power_of_2(HALF)
):
    """One head of BLOCK_T tokens: rotated back by −θ (dq, dk) or copied (dv), rounded
    to DQ's dtype, cast to fp8 and stored as is and transposed at the head's columns."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # tokens
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_tokens)[:, None] & (cols < HALF)[None, :]
    b = rows // seq_len
    s = rows % seq_len
    rotate = head < n_q_heads + n_kv_heads
    if head < n_q_heads:
        src = DQ + b * stride_qb + s * stride_qs + head * stride_qh
    elif rotate:
        src = DK + b * stride_kb + s * stride_ks + (head - n_q_heads) * stride_kh
    else:
        src = DV + b * stride_vb + s * stride_vs + (head - n_q_heads - n_kv_heads) * stride_vh
    ptrs = src[:, None] + cols[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if rotate:  # `kernels.rope`'s formula with sin negated: R(θ)ᵀ = R(−θ)
        t_ptrs = s[:, None] * stride_table + cols[None, :]
        cos = tl.load(COS + t_ptrs, mask=mask, other=0.0).to(tl.float32)
        sin = -tl.load(SIN + t_ptrs, mask=mask, other=0.0).to(tl.float32)
        y1, y2 = _rotate_halves(x1, x2, cos, sin)
    else:
        y1 = x1
        y2 = x2
    y1 = _to_dtype(y1, DQ.dtype.element_ty).to(tl.float32)  # what the unfused path writes
    y2 = _to_dtype(y2, DQ.dtype.element_ty).to(tl.float32)
    if WRITE_AMAX:
        m = tl.maximum(tl.abs(y1), tl.abs(y2))
        tl.atomic_max(AMAX_OUT, tl.max(tl.max(m, axis=1), axis=0))
    if WRITE_Q or WRITE_QT:
        scale = _scale(AMAX_SRC, INV_SCALE, n_src, FP8_MAX, EPS, BLOCK_SRC)
        q1 = _quantize(y1, scale, QT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP,
                       ROUND_IN_FP32)
        q2 = _quantize(y2, scale, QT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP,
                       ROUND_IN_FP32)
        col0 = head.to(tl.int64) * (2 * HALF)
        _store_both(Q + col0, QT + col0 * ld_qt, q1, rows, cols, mask, HALF, width, ld_qt,
                    WRITE_Q, WRITE_QT)
        _store_both(Q + col0 + HALF, QT + (col0 + HALF) * ld_qt, q2, rows, cols, mask,
                    HALF, width, ld_qt, WRITE_Q, WRITE_QT)


def _check(dq, dk, dv, cos_half, sin_half) -> None:
    check_qk(dq, dk)
    if dv.shape != dk.shape or dv.dtype != dk.dtype or dv.device != dk.device:
        raise ValueError(f"dv {tuple(dv.shape)} {dv.dtype} must match dk "
                         f"{tuple(dk.shape)} {dk.dtype} on {dk.device}")
    half = dq.shape[3] // 2
    for name, t in (("cos_half", cos_half), ("sin_half", sin_half)):
        if t.dim() != 2 or t.shape[0] < dq.shape[1] or t.shape[1] < half \
                or t.stride(1) != 1 or t.device != dq.device:
            raise ValueError(f"{name} {tuple(t.shape)} must be (≥ S, ≥ D/2) with unit "
                             f"column stride on {dq.device} (`rope.half_tables`)")


def _launch(dq, dk, dv, cos_half, sin_half, dtype, amax_src, amax_out, write_q, write_qt,
            ld, tile=None):
    """Run the kernel over (token blocks, heads); returns (q, qt, inv_scale). `tile`
    (BLOCK_T, num_warps) bypasses the autotuner (tests, probes)."""
    B, S, n_q, D = dq.shape
    n_kv = dk.shape[2]
    T, W = B * S, (n_q + 2 * n_kv) * D
    fp8_max, mant, min_exp = _format(dtype)
    dev = dq.device
    q = torch.empty(T, W, dtype=dtype, device=dev) if write_q else None
    qt = torch.empty(W, ld, dtype=dtype, device=dev) if write_qt else None
    inv = torch.empty(1, dtype=torch.float32, device=dev)
    dummy = q if q is not None else qt if qt is not None else \
        torch.empty(1, dtype=dtype, device=dev)
    src = amax_src.reshape(-1) if amax_src is not None else inv
    n_tiled = ld if write_qt else T
    if n_tiled == 0 or W == 0:
        return q, qt, inv
    dq, dk, dv = _unit_columns(dq), _unit_columns(dk), _unit_columns(dv)
    fixed = {} if tile is None else {"BLOCK_T": tile[0], "num_warps": tile[1]}
    run = _rope_fp8_backward_kernel if tile is None else _rope_fp8_backward_kernel.fn

    def grid(meta):
        return triton.cdiv(n_tiled, meta["BLOCK_T"]), n_q + 2 * n_kv

    run[grid](
        dq, dk, dv, dummy if q is None else q, dummy if qt is None else qt,
        cos_half, sin_half, src, inv, amax_out if amax_out is not None else inv,
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), cos_half.stride(0),
        T, S, n_q, n_kv, W, ld, src.numel(),
        FP8_MAX=fp8_max, MANT_BITS=mant, MIN_EXP=min_exp, EPS=EPS,
        WRITE_Q=write_q, WRITE_QT=write_qt, WRITE_AMAX=amax_out is not None,
        ROUND_IN_FP32=INTERPRET or not dq.is_cuda,
        BLOCK_SRC=triton.next_power_of_2(max(src.numel(), 2)), HALF=D // 2,
        BLOCK_D=triton.next_power_of_2(D // 2), **fixed)
    return q, qt, inv


def rope_backward_torch(dq, dk, dv, cos_half, sin_half) -> torch.Tensor:
    """The qkv gradient (B·S, (Hq + 2·Hkv)·D) in dq's dtype, in torch ops: dq and dk
    rotated by −θ in fp32 (`kernels.rope`'s arithmetic), dv as it is."""
    S, half = dq.shape[1], dq.shape[3] // 2
    cos = cos_half[:S, :half].float()[None, :, None, :]
    sin = -sin_half[:S, :half].float()[None, :, None, :]

    def back(t):
        x1, x2 = t.float()[..., :half], t.float()[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(t.dtype)

    out = torch.cat((back(dq), back(dk), dv.to(dq.dtype)), dim=2)
    return out.reshape(dq.shape[0] * S, -1)


def rope_fp8_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                      cos_half: torch.Tensor, sin_half: torch.Tensor, dtype: torch.dtype,
                      amax_src: torch.Tensor, *, write_q: bool = True,
                      write_qt: bool = True, pad_to: int = 16,
                      amax_out: torch.Tensor | None = None,
                      use_triton: bool | None = None, tile=None):
    """The qkv gradient of `RotaryQKVFunction` — dq, dk rotated back, dv — cast to fp8
    `dtype` with scale = fp8_max / max(amax_src), without writing it in dq's dtype.

    Args:
        dq: (B, S, Hq, D), dk, dv: (B, S, Hkv, D); any strides over B, S, H.
        cos_half, sin_half: (≥ S, ≥ D/2) tables (`rope.half_tables`).
    Returns `(q, qt, inv_scale)` as `fp8_cast_transpose(dqkv)` does: q (B·S, W) or None,
    qt (W, T_pad) (columns T.. zero) or None, inv_scale (1,) fp32, W = (Hq + 2·Hkv)·D.
    With `amax_out` (a zeroed (1,) fp32 tensor), max |dqkv| is reduced into it. Kernel
    on CUDA (`use_triton=None`), torch ops elsewhere; True forces the kernel. `tile`
    (one of `TILES`) runs that tile instead of the autotuner's choice."""
    _check(dq, dk, dv, cos_half, sin_half)
    ld = padded(dq.shape[0] * dq.shape[1], pad_to)
    if not _use_triton(dq, use_triton):
        return _cast_torch(rope_backward_torch(dq, dk, dv, cos_half, sin_half), dtype,
                           _format(dtype)[0], amax_src, write_q, write_qt, ld, amax_out)
    return _launch(dq, dk, dv, cos_half, sin_half, dtype, amax_src, amax_out, write_q,
                   write_qt, ld, tile)


def rope_fp8_backward_amax(dq, dk, dv, cos_half, sin_half, *,
                           use_triton: bool | None = None) -> torch.Tensor:
    """max |dqkv| as a (1,) fp32 tensor: dynamic scaling's first pass (reads dq, dk, dv,
    writes nothing else)."""
    _check(dq, dk, dv, cos_half, sin_half)
    if not _use_triton(dq, use_triton):
        return rope_backward_torch(dq, dk, dv, cos_half, sin_half).abs().amax().float() \
            .reshape(1)
    amax = torch.zeros(1, dtype=torch.float32, device=dq.device)
    _launch(dq, dk, dv, cos_half, sin_half, torch.float8_e5m2, None, amax, False, False,
            dq.shape[0] * dq.shape[1])
    return amax
