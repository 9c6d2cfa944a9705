"""Casting to fp8 in one pass: scale, saturate, round, and write both layouts.

An fp8 linear layer (`colossal_lab.ops.fp8`) runs three GEMMs per step through
`torch._scaled_mm`, which wants its first operand row-major and its second
column-major (cuBLASLt's fp8 kernels on Hopper take only the "TN" layout)::

    y  = x  @ Wᵀ      A = x   (M, K) row-major      B = Wᵀ (K, N) = W viewed transposed
    dx = dy @ W       A = dy  (M, N) row-major      B = W  (N, K) column-major = (Wᵀ)ᵀ
    dW = dyᵀ @ x      A = dyᵀ (N, M) row-major      B = x  (M, K) column-major = (xᵀ)ᵀ

So every tensor that is cast is needed twice: as it is and transposed (x and xᵀ,
W and Wᵀ, dy and dyᵀ). Casting, then transposing in a second kernel, reads the fp8
copy again and writes it again; `fp8_cast_transpose` reads the input once and writes
both (2 + 1 + 1 bytes per bf16 element instead of 2 + 1 + 1 + 1 + 1).

Per-tensor scaling (Micikevicius et al., "FP8 Formats for Deep Learning", 2022)::

    scale = fp8_max / max(amax, eps)      q = round_fp8(clamp(x · scale, ±fp8_max))
    x ≈ q · scale⁻¹                       (scale⁻¹ is what `_scaled_mm` multiplies by)

`amax` comes from one of two places (chosen by the caller, `AMAX_SRC` below):

* **dynamic**: the amax of this very tensor, so a reduction pass (`fp8_amax`) must run
  first: two reads of x. Nothing ever saturates.
* **delayed** (NVIDIA Transformer Engine's default): the largest amax of the last few
  steps (an amax *history*), known before x is read, so the cast is a single pass; the
  same pass produces this tensor's amax for the history (`AMAX_OUT`, an atomic max).
  A value larger than anything in the history saturates at ±fp8_max.

The scale is computed inside the kernel from the amax source, and program 0 writes
scale⁻¹: no host synchronisation and no tiny torch kernels between reduction and cast.

The history is a ring whose write position lives on the device, a (1,) integer tensor,
so a step replayed as a CUDA graph writes a new slot each replay. After a cast,
`advance_history` files its amax in one single-program launch::

    p = POS;  HIST[p] = AMAX;  AMAX = 0;  POS = (p + 1) mod n

which also re-zeroes `AMAX_OUT` for the next cast (a persistent buffer: no allocation,
no fill kernel per cast).
The transposed copy can be padded with zero columns up to a multiple of 16 tokens:
`_scaled_mm` needs every inner dimension to be a multiple of 16, and the token count M
is the inner dimension of dW = dyᵀ @ x.

Under the Triton interpreter (CPU, CI), NumPy's float→fp8 conversion does not carry a
rounded-up mantissa into the exponent (31.5 becomes 16, not 32), so there the kernel
first rounds to the fp8 grid in fp32 (`_round_to_fp8_grid`, round-half-to-even), after
which the conversion is exact. On a GPU the hardware conversion (also round-to-nearest-
even, saturating by our clamp) is used directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from colossal_lab.fallback import fallback
from colossal_lab.kernels import INTERPRET, runs_on

EPS = 1e-12
"""Smallest amax a scale is computed from (an all-zero tensor gets scale fp8_max/EPS)."""

_FORMATS = {  # dtype -> (largest finite value, mantissa bits, exponent of smallest normal)
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}

BLOCK_R, BLOCK_C = 64, 64
"""Tile of the cast kernel: square, so the transposed store is as wide as the load."""
AMAX_BLOCK, AMAX_ITERS = 4096, 8
"""Elements per vector and vectors per program of the amax reduction."""


def _format(dtype: torch.dtype) -> tuple[float, int, int]:
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(f"fp8 dtype {dtype} not supported; use torch.float8_e4m3fn or "
                         "torch.float8_e5m2") from None


def padded(n: int, multiple: int = 16) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------------------ kernels


@triton.jit
def _round_to_fp8_grid(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round fp32 `v` (already within ±fp8_max) to the nearest fp8 value, ties to even.

    The fp8 spacing at v is 2^(e − MANT_BITS) with e = v's binary exponent, floored at
    the smallest normal exponent (subnormals share its spacing). Powers of two are
    built from their bits, so every multiply is exact."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP) - MANT_BITS
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e
    inv_ulp = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    t = tl.abs(v) * inv_ulp  # |v| in units of the spacing
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where(((r - t) == 0.5) & odd, r - 1.0, r)  # a tie goes to the even neighbour
    r = r * ulp
    return tl.where(bits < 0, -r, r)  # the sign bit: -0.0 and tiny negatives stay negative


@triton.jit
def _fp8_amax_kernel(
    X,  # (n,) input, any float dtype, contiguous
    AMAX,  # (1,) fp32 output, zero-initialised: max |x| by atomic max
    n,  # elements
    BLOCK: tl.constexpr,  # elements per vector
    ITERS: tl.constexpr,  # vectors per program
):
    """AMAX = max(AMAX, max |x| over this program's ITERS·BLOCK elements)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.atomic_max(AMAX, tl.max(acc, axis=0))


@triton.jit
def _scale(AMAX_SRC, INV_SCALE, n_src, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
           BLOCK_SRC: tl.constexpr):
    """scale = FP8_MAX / max(max(AMAX_SRC), EPS), by IEEE division (the scale torch
    computes, `_cast_torch`); program (0, 0) stores 1 / scale in INV_SCALE."""
    src = tl.load(AMAX_SRC + tl.arange(0, BLOCK_SRC), mask=tl.arange(0, BLOCK_SRC) < n_src,
                  other=0.0)
    amax_src = tl.maximum(tl.max(src, axis=0), EPS)
    scale = tl.div_rn(FP8_MAX, amax_src)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(INV_SCALE, tl.div_rn(1.0, scale))
    return scale


@triton.jit
def _quantize(v, scale, dtype: tl.constexpr, FP8_MAX: tl.constexpr,
              MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """fp8(clamp(v · scale, ±FP8_MAX)) of an fp32 tile, round to nearest even."""
    y = tl.minimum(tl.maximum(v * scale, -FP8_MAX), FP8_MAX)  # saturate, never inf/NaN
    if ROUND_IN_FP32:
        y = _round_to_fp8_grid(y, MANT_BITS, MIN_EXP)
    return y.to(dtype)


@triton.jit
def _store_both(Y, YT, q, rows, cols, mask, n_cols, row_len, ld_t,
                WRITE_Y: tl.constexpr, WRITE_YT: tl.constexpr):
    """Store the fp8 tile q (rows, cols) at Y (row-major, rows `row_len` apart) and its
    transpose at YT (rows `ld_t` apart); the transposed store also covers the rows past
    the data up to ld_t, whose masked loads made q zero: YT's padding."""
    if WRITE_Y:
        tl.store(Y + rows[:, None] * row_len + cols[None, :], q, mask=mask)
    if WRITE_YT:
        t_mask = (cols[:, None] < n_cols) & (rows[None, :] < ld_t)
        tl.store(YT + cols[:, None].to(tl.int64) * ld_t + rows[None, :], tl.trans(q),
                 mask=t_mask)


@triton.jit
def _fp8_cast_transpose_kernel(
    X,  # (n_rows, n_cols) input, any float dtype, row stride stride_x
    Y,  # (n_rows, n_cols) fp8 output, contiguous (WRITE_Y)
    YT,  # (n_cols, ld_yt) fp8 output xᵀ, rows n_rows..ld_yt-1 zero (WRITE_YT)
    AMAX_SRC,  # (n_src,) fp32: the scale is fp8_max / max(AMAX_SRC)
    INV_SCALE,  # (1,) fp32 output: 1 / scale, written by program (0, 0)
    AMAX_OUT,  # (1,) fp32, zero-initialised: max |x| by atomic max (WRITE_AMAX)
    stride_x,  # elements between rows of X
    n_rows,  # rows of X
    n_cols,  # columns of X
    ld_yt,  # row length of YT (n_rows padded to a multiple of 16)
    n_src,  # entries of AMAX_SRC (1 for dynamic scaling, the history length for delayed)
    FP8_MAX: tl.constexpr,  # largest finite value of the fp8 format
    MANT_BITS: tl.constexpr,  # mantissa bits of the format (interpreter rounding only)
    MIN_EXP: tl.constexpr,  # exponent of its smallest normal (interpreter rounding only)
    EPS: tl.constexpr,  # floor of the amax the scale is computed from
    WRITE_Y: tl.constexpr,  # write the row-major copy
    WRITE_YT: tl.constexpr,  # write the transposed copy
    WRITE_AMAX: tl.constexpr,  # reduce this tensor's amax into AMAX_OUT
    ROUND_IN_FP32: tl.constexpr,  # pre-round to the fp8 grid (the interpreter's casts)
    BLOCK_SRC: tl.constexpr,  # next_power_of_2(n_src)
    BLOCK_R: tl.constexpr,  # rows per tile
    BLOCK_C: tl.constexpr,  # columns per tile
):
    """One (BLOCK_R, BLOCK_C) tile: q = fp8(clamp(x · scale)), stored as is and
    transposed; tiles past n_rows (up to ld_yt) store the zero padding of YT."""
    scale = _scale(AMAX_SRC, INV_SCALE, n_src, FP8_MAX, EPS, BLOCK_SRC)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # (BLOCK_R, BLOCK_C)
    if WRITE_AMAX:
        tl.atomic_max(AMAX_OUT, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    q = _quantize(x, scale, YT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP, ROUND_IN_FP32)
    _store_both(Y, YT, q, rows, cols, mask, n_cols, n_cols, ld_yt, WRITE_Y, WRITE_YT)


@triton.jit
def _advance_history_kernel(
    HIST,  # (n,) fp32 amax history, a ring
    AMAX,  # (1,) fp32: the amax to file
    POS,  # (1,) int64: the slot it goes to; advanced modulo n
    n,  # entries of HIST
    RESET: tl.constexpr,  # zero AMAX afterwards (the next cast's atomic-max target)
):
    """One program, three scalars: HIST[POS] = AMAX; AMAX = 0 (RESET); POS = (POS+1) % n."""
    p = tl.load(POS)
    tl.store(HIST + p, tl.load(AMAX).to(tl.float32))
    if RESET:
        tl.store(AMAX, 0.0)
    tl.store(POS, (p + 1) % n)


# ---------------------------------------------------------------------------- launchers


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """None: the kernel on CUDA, torch ops elsewhere. True on a CPU tensor runs the
    kernel under the interpreter; without it, torch ops through `colossal_lab.fallback`."""
    if use_triton is None:
        return x.is_cuda
    if use_triton and not runs_on(x.device):
        fallback("fp8 cast use_triton=True needs a CUDA device or TRITON_INTERPRET=1",
                 "torch ops")
        return False
    return use_triton


def fp8_amax(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """max |x| as a (1,) fp32 tensor on x's device (no host synchronisation).

    Triton on CUDA (`use_triton=None`), torch elsewhere; `use_triton=True` forces the
    kernel (the interpreter on CPU)."""
    if not _use_triton(x, use_triton):
        return x.detach().abs().amax().float().reshape(1) if x.numel() else \
            torch.zeros(1, device=x.device)
    x = x.detach().contiguous()
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, AMAX_BLOCK * AMAX_ITERS),)
        _fp8_amax_kernel[grid](x, amax, n, BLOCK=AMAX_BLOCK, ITERS=AMAX_ITERS)
    return amax


def fp8_cast_transpose(x: torch.Tensor, dtype: torch.dtype, amax_src: torch.Tensor, *,
                       write_y: bool = True, write_yt: bool = True, pad_to: int = 16,
                       amax_out: torch.Tensor | None = None,
                       use_triton: bool | None = None):
    """Cast a 2-D `x` (R, C) to fp8 `dtype` with scale = fp8_max / max(amax_src).

    Returns `(y, yt, inv_scale)`: y (R, C) fp8 row-major or None, yt (C, R_pad) fp8
    (x transposed, rows R..R_pad-1 of xᵀ zero; R_pad = R rounded up to `pad_to`) or
    None, inv_scale a (1,) fp32 tensor. With `amax_out` (a zeroed (1,) fp32 tensor),
    max |x| is reduced into it in the same pass (delayed scaling's history entry).
    """
    if x.dim() != 2:
        raise ValueError(f"fp8_cast_transpose takes a 2-D tensor, got shape {tuple(x.shape)}")
    fp8_max, mant, min_exp = _format(dtype)
    rows, cols = x.shape
    ld = padded(rows, pad_to)
    if not _use_triton(x, use_triton):
        return _cast_torch(x, dtype, fp8_max, amax_src, write_y, write_yt, ld, amax_out)
    if x.stride(1) != 1:
        x = x.contiguous()
    amax_src = amax_src.reshape(-1)
    y = torch.empty(rows, cols, dtype=dtype, device=x.device) if write_y else None
    yt = torch.empty(cols, ld, dtype=dtype, device=x.device) if write_yt else None
    inv = torch.empty(1, dtype=torch.float32, device=x.device)
    dummy = y if y is not None else yt if yt is not None else \
        torch.empty(1, dtype=dtype, device=x.device)
    # Triton 3.6 on an H200 left parts of YT unwritten when an fp32 tile was stored both
    # ways in one program (found by tests/test_fp8.py on the GPU); fp32 inputs are the
    # weights, small next to the activations, so they take two passes instead.
    passes = ((write_y, False), (False, True)) \
        if x.dtype == torch.float32 and write_y and write_yt and x.is_cuda \
        else ((write_y, write_yt),)
    for i, (wy, wyt) in enumerate(passes):
        grid = (triton.cdiv(ld if wyt else rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))
        with_amax = amax_out is not None and i == 0
        _fp8_cast_transpose_kernel[grid](
            x, dummy if y is None else y, dummy if yt is None else yt, amax_src, inv,
            amax_out if with_amax else inv,
            x.stride(0), rows, cols, ld, amax_src.numel(),
            FP8_MAX=fp8_max, MANT_BITS=mant, MIN_EXP=min_exp, EPS=EPS,
            WRITE_Y=wy, WRITE_YT=wyt, WRITE_AMAX=with_amax,
            ROUND_IN_FP32=INTERPRET or not x.is_cuda,
            BLOCK_SRC=triton.next_power_of_2(max(amax_src.numel(), 2)),
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return y, yt, inv


def _cast_torch(x, dtype, fp8_max, amax_src, write_y, write_yt, ld, amax_out):
    """The same cast in torch ops (CPU, and the reference the kernel is tested against):
    identical fp32 arithmetic, so identical bits."""
    x = x.detach()
    amax = amax_src.float().max().clamp(min=EPS)  # 0-dim fp32
    # tensor / tensor: one IEEE division (python_number / tensor is reciprocal · number)
    scale = torch.full_like(amax, fp8_max) / amax
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, x.abs().amax().float()))
    q = (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    yt = None
    if write_yt:
        yt = torch.zeros(x.shape[1], ld, dtype=dtype, device=x.device)
        yt[:, :x.shape[0]] = q.t()
    return (q if write_y else None), yt, (torch.ones_like(scale) / scale).reshape(1)


def advance_history(history: torch.Tensor, amax: torch.Tensor, pos: torch.Tensor, *,
                    reset: bool = True, use_triton: bool | None = None) -> None:
    """File `amax` ((1,) fp32) in the ring `history` ((n,) fp32) at the device position
    `pos` ((1,) int64), then pos = (pos + 1) mod n and, with `reset`, amax = 0: one
    launch, nothing read by the host, so a CUDA graph replays it as a fresh write.

    Triton on CUDA (`use_triton=None`); torch ops elsewhere (an index_copy_, a fill and
    two integer ops: the same values); `use_triton=True` forces the kernel (the
    interpreter on CPU)."""
    if not _use_triton(history, use_triton):
        history.index_copy_(0, pos, amax.to(history.dtype))
        if reset:
            amax.zero_()
        pos.add_(1).remainder_(history.numel())
        return
    _advance_history_kernel[(1,)](history, amax, pos, history.numel(), RESET=reset,
                                  num_warps=1)
