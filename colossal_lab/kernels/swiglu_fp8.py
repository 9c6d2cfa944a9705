"""SwiGLU with its fp8 cast fused in: the activation of an fp8 MLP, forward and backward.

An fp8 MLP, y = down(swiglu(gate_up(x))), casts the SwiGLU's output h to e4m3 for the
down projection, and the SwiGLU's input gradient d(gu) to e5m2 for the gate/up
projection's two backward GEMMs (`ops.fp8` for the GEMMs, `kernels.fp8_cast` for the
cast). Unfused, h and d(gu) are materialised in the activation dtype only to be read
back by the cast. These kernels do the SwiGLU math (`kernels.swiglu`) and the cast
(`kernels.fp8_cast`) in one pass over each tile: only the fp8 copies are written, each
row-major and transposed, as `_scaled_mm` needs them::

    forward   read g, u (T, i) of gu = [g | u];   h = silu(g) · u
              write q(h · s_h) (T, i) and its transpose (i, T_pad)
    backward  read dh (T, i), g, u;   dg = dh · u · s(1 + g(1 − s)),  du = dh · g · s
              write q([dg | du] · s_g) (T, 2i) and its transpose (2i, T_pad)

with s = σ(g). Bytes per element of h (T·i elements; bf16 in, fp8 out), delayed scaling,
whose scale is known before the pass::

                      unfused: swiglu kernel, then cast       fused (this file)
    forward           read 4, write h 2; cast: read 2,        read 4, write 1 + 1 = 6
                      write 1 + 1                    = 10
    backward          read 6, write d(gu) 4; cast: read 4,    read 6, write 2 + 2 = 10
                      write 2 + 2                    = 18

At llama-7b's i = 11008 and 16,384 tokens an element of h is 0.18 G per layer, so the
fusion saves 12 bytes each: 2.2 GB of HBM traffic per layer and step. Dynamic scaling
needs the amax of h (of d(gu)) before the cast: an amax-only pass of the same kernel
reads the inputs once more (4 and 6 bytes), still less than the unfused path, which
reduces the materialised tensor (`fp8_amax`) before casting it.

**Rounding.** The fp32 result (h, or dg and du) is rounded to gu's dtype before it is
scaled, exactly as the unfused path rounds it when it writes h (d(gu)) in that dtype,
so both paths quantise the same numbers and produce the same fp8 bits, amaxes and
histories. Skipping that rounding would save two integer operations per element of a
memory-bound kernel and change the fp8 result by one step on a few elements.

Scale, saturation and fp8 rounding are `kernels.fp8_cast`'s: scale = fp8_max /
max(amax source) by IEEE division, program (0, 0) writes its inverse, values clamp to
±fp8_max, the transposed copies are zero-padded to T_pad (a multiple of 16) columns,
and under the interpreter the value is first rounded to the fp8 grid in fp32
(`_round_to_fp8_grid`) so the CPU conversion is exact.

Tiles are (BLOCK_R, BLOCK_C) of h, chosen on the GPU by Triton's autotuner among
`TILES` for each (tokens, width, outputs written): the first call of a shape times each
tile and keeps the fastest. The kernels stream (forward) 4 bytes of [gate | up] in and
2 bytes of fp8 out per element of h, (backward) 6 bytes in and 4 out, so they should run
near the copy rate; which tile gets there depends on the card and the width. The outputs
do not depend on the tile, bit for bit: every element is computed on its own, and the
amax is a max. Under the interpreter only the first tile is used.
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

TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (64, 128, 8), (128, 128, 8),
         (64, 256, 8), (64, 64, 8), (32, 64, 4), (32, 128, 4), (32, 128, 8))
"""(BLOCK_R, BLOCK_C, num_warps) the autotuner chooses among: a tile of h (tokens x
columns of one half) and the warps per program. The first is the square tile of the cast
kernel (`fp8_cast`), whose transposed store is as wide as its load. The backward keeps
eight fp32 tiles live (g, u, dh, σ, silu, its derivative, dg, du): at 64 x 64 with 4
warps that is up to 256 values a thread, past its 255 registers, so the short tiles and
the 8-warp ones, which hold fewer values a thread, let it stream nearer the copy rate."""
_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
            for r, c, w in (TILES[:1] if INTERPRET else TILES)]
_TUNE_KEY = ["n_rows", "n_cols", "WRITE_Q", "WRITE_QT", "WRITE_AMAX"]


# ------------------------------------------------------------------------------ kernels


@triton.jit
def _gate_up(GU, rows, cols, mask, stride_gu, n_cols):
    """The gate and up tiles (rows, cols) of the fused [gate | up] input, in fp32."""
    gate_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.autotune(configs=_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _swiglu_fp8_forward_kernel(
    GU,  # (n_rows, 2·n_cols) input [gate | up], row stride stride_gu, unit column stride
    Q,  # (n_rows, n_cols) fp8 output q(h · scale), contiguous (WRITE_Q)
    QT,  # (n_cols, ld_qt) fp8 output, Q transposed, columns n_rows..ld_qt-1 zero (WRITE_QT)
    AMAX_SRC,  # (n_src,) fp32: the scale is fp8_max / max(AMAX_SRC) (WRITE_Q or WRITE_QT)
    INV_SCALE,  # (1,) fp32 output: 1 / scale, written by program (0, 0)
    AMAX_OUT,  # (1,) fp32, zero-initialised: max |h| by atomic max (WRITE_AMAX)
    stride_gu,  # elements between rows of GU
    n_rows,  # T, tokens
    n_cols,  # i, the width of each half
    ld_qt,  # row length of QT (n_rows padded to a multiple of 16)
    n_src,  # entries of AMAX_SRC
    FP8_MAX: tl.constexpr,  # largest finite value of the fp8 format
    MANT_BITS: tl.constexpr,  # mantissa bits of the format (interpreter rounding only)
    MIN_EXP: tl.constexpr,  # exponent of its smallest normal (interpreter rounding only)
    EPS: tl.constexpr,  # floor of the amax the scale is computed from
    WRITE_Q: tl.constexpr,  # write the row-major copy
    WRITE_QT: tl.constexpr,  # write the transposed copy
    WRITE_AMAX: tl.constexpr,  # reduce max |h| into AMAX_OUT (alone: the amax pass)
    ROUND_IN_FP32: tl.constexpr,  # pre-round to the fp8 grid (the interpreter's casts)
    BLOCK_SRC: tl.constexpr,  # next_power_of_2(n_src)
    BLOCK_R: tl.constexpr,  # rows (tokens) per tile
    BLOCK_C: tl.constexpr,  # columns of h per tile
):
    """One (BLOCK_R, BLOCK_C) tile of h = silu(g) · u, rounded to GU's dtype, cast to
    fp8 and stored as is and transposed; tiles past n_rows (up to ld_qt) store the zero
    padding of QT (their masked loads give g = u = 0, so h = 0)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g, u = _gate_up(GU, rows, cols, mask, stride_gu, n_cols)
    s = 1.0 / (1.0 + tl.exp(-g))  # σ(g), as kernels.swiglu computes it
    h = g * s * u
    h = _to_dtype(h, GU.dtype.element_ty).to(tl.float32)  # what the unfused path writes
    if WRITE_AMAX:
        tl.atomic_max(AMAX_OUT, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
    if WRITE_Q or WRITE_QT:
        scale = _scale(AMAX_SRC, INV_SCALE, n_src, FP8_MAX, EPS, BLOCK_SRC)
        q = _quantize(h, scale, QT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP,
                      ROUND_IN_FP32)
        _store_both(Q, QT, q, rows, cols, mask, n_cols, n_cols, ld_qt, WRITE_Q, WRITE_QT)


@triton.autotune(configs=_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _swiglu_fp8_backward_kernel(
    DH,  # (n_rows, n_cols) gradient of h, row stride stride_dh, unit column stride
    GU,  # (n_rows, 2·n_cols) the forward's input [gate | up], row stride stride_gu
    Q,  # (n_rows, 2·n_cols) fp8 output q([dg | du] · scale), contiguous (WRITE_Q)
    QT,  # (2·n_cols, ld_qt) fp8 output, Q transposed, columns n_rows.. zero (WRITE_QT)
    AMAX_SRC,  # (n_src,) fp32: the scale is fp8_max / max(AMAX_SRC) (WRITE_Q or WRITE_QT)
    INV_SCALE,  # (1,) fp32 output: 1 / scale, written by program (0, 0)
    AMAX_OUT,  # (1,) fp32, zero-initialised: max(|dg|, |du|) by atomic max (WRITE_AMAX)
    stride_dh,  # elements between rows of DH
    stride_gu,  # elements between rows of GU
    n_rows,  # T
    n_cols,  # i
    ld_qt,  # row length of QT (n_rows padded to a multiple of 16)
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
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dg = dh · u · s(1 + g(1 − s)) and du = dh · g · s for one tile of columns of each
    half (s = σ(g) recomputed), rounded to GU's dtype, cast to fp8 and stored in the
    fused layout [dg | du], as is and transposed (rows c and i + c of QT)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g, u = _gate_up(GU, rows, cols, mask, stride_gu, n_cols)
    dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))  # as kernels.swiglu's backward computes it
    silu = g * s
    dsilu = s * (1.0 + g * (1.0 - s))
    dg = _to_dtype(dh * u * dsilu, GU.dtype.element_ty).to(tl.float32)
    du = _to_dtype(dh * silu, GU.dtype.element_ty).to(tl.float32)
    if WRITE_AMAX:
        m = tl.maximum(tl.abs(dg), tl.abs(du))
        tl.atomic_max(AMAX_OUT, tl.max(tl.max(m, axis=1), axis=0))
    if WRITE_Q or WRITE_QT:
        scale = _scale(AMAX_SRC, INV_SCALE, n_src, FP8_MAX, EPS, BLOCK_SRC)
        qg = _quantize(dg, scale, QT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP,
                       ROUND_IN_FP32)
        qu = _quantize(du, scale, QT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP,
                       ROUND_IN_FP32)
        # [dg | du]: du's columns start n_cols along Q's rows and n_cols rows down QT
        _store_both(Q, QT, qg, rows, cols, mask, n_cols, 2 * n_cols, ld_qt, WRITE_Q,
                    WRITE_QT)
        _store_both(Q + n_cols, QT + n_cols * ld_qt, qu, rows, cols, mask, n_cols,
                    2 * n_cols, ld_qt, WRITE_Q, WRITE_QT)


# ---------------------------------------------------------------------------- launchers


def _check(gu: torch.Tensor, dh: torch.Tensor | None = None) -> int:
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gate_up must be 2-D (T, 2i) [gate | up], got {tuple(gu.shape)}")
    if gu.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"SwiGLU takes float32, float16 or bfloat16; got {gu.dtype}")
    i = gu.shape[1] // 2
    if dh is not None and tuple(dh.shape) != (gu.shape[0], i):
        raise ValueError(f"dh {tuple(dh.shape)} does not match gate_up {tuple(gu.shape)}")
    return i


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 or t.numel() == 0 else t.contiguous()


def _launch(kernel, tensors: tuple, strides: tuple, gu, n_out_cols: int, dtype, amax_src,
            amax_out, write_q: bool, write_qt: bool, ld: int, tile=None):
    """Run `kernel` over h's tiles; returns (q, qt, inv_scale). Without writes (the
    amax pass) the grid covers the tokens only; with the transposed copy, its padding.
    `tile` (BLOCK_R, BLOCK_C, num_warps) bypasses the autotuner (tests, probes)."""
    rows, i = gu.shape[0], gu.shape[1] // 2
    fp8_max, mant, min_exp = _format(dtype)
    dev = gu.device
    q = torch.empty(rows, n_out_cols, dtype=dtype, device=dev) if write_q else None
    qt = torch.empty(n_out_cols, ld, dtype=dtype, device=dev) if write_qt else None
    inv = torch.empty(1, dtype=torch.float32, device=dev)
    dummy = q if q is not None else qt if qt is not None else \
        torch.empty(1, dtype=dtype, device=dev)
    src = amax_src.reshape(-1) if amax_src is not None else inv
    # As in fp8_cast_transpose: an fp32 tile stored both ways in one program lost parts
    # of the transposed copy on an H200 (Triton 3.6), so fp32 inputs take two passes.
    passes = ((write_q, False), (False, True)) \
        if gu.dtype == torch.float32 and write_q and write_qt and gu.is_cuda \
        else ((write_q, write_qt),)
    fixed = {} if tile is None else {"BLOCK_R": tile[0], "BLOCK_C": tile[1],
                                     "num_warps": tile[2]}
    run = kernel if tile is None else kernel.fn  # the autotuner, or its kernel as is
    for n, (wq, wqt) in enumerate(passes):
        with_amax = amax_out is not None and n == 0
        n_tiled = ld if wqt else rows
        if n_tiled == 0 or i == 0:
            continue

        def grid(meta, n_tiled=n_tiled):
            return triton.cdiv(n_tiled, meta["BLOCK_R"]), triton.cdiv(i, meta["BLOCK_C"])

        run[grid](
            *tensors, dummy if q is None else q, dummy if qt is None else qt, src, inv,
            amax_out if with_amax else inv, *strides, rows, i, ld, src.numel(),
            FP8_MAX=fp8_max, MANT_BITS=mant, MIN_EXP=min_exp, EPS=EPS,
            WRITE_Q=wq, WRITE_QT=wqt, WRITE_AMAX=with_amax,
            ROUND_IN_FP32=INTERPRET or not gu.is_cuda,
            BLOCK_SRC=triton.next_power_of_2(max(src.numel(), 2)), **fixed)
    return q, qt, inv


def swiglu_fp8_forward(gu: torch.Tensor, dtype: torch.dtype, amax_src: torch.Tensor, *,
                       write_q: bool = True, write_qt: bool = True, pad_to: int = 16,
                       amax_out: torch.Tensor | None = None,
                       use_triton: bool | None = None, tile=None):
    """h = silu(gate) · up of gu (T, 2i), cast to fp8 `dtype` with scale = fp8_max /
    max(amax_src), without writing h.

    Returns `(q, qt, inv_scale)` as `fp8_cast_transpose(h)` does: q (T, i) or None, qt
    (i, T_pad) (rows T..T_pad-1 of hᵀ zero) or None, inv_scale (1,) fp32. With
    `amax_out` (a zeroed (1,) fp32 tensor), max |h| is reduced into it in the same pass.
    Kernel on CUDA (`use_triton=None`), torch ops elsewhere; True forces the kernel.
    `tile` (one of `TILES`) runs that tile instead of the autotuner's choice."""
    i = _check(gu)
    ld = padded(gu.shape[0], pad_to)
    if not _use_triton(gu, use_triton):
        return _cast_torch(swiglu_torch(gu), dtype, _format(dtype)[0], amax_src, write_q,
                           write_qt, ld, amax_out)
    gu = _unit_cols(gu)
    return _launch(_swiglu_fp8_forward_kernel, (gu,), (gu.stride(0),), gu, i, dtype,
                   amax_src, amax_out, write_q, write_qt, ld, tile)


def swiglu_fp8_forward_amax(gu: torch.Tensor, *, use_triton: bool | None = None):
    """max |h| of h = silu(gate) · up (rounded to gu's dtype) as a (1,) fp32 tensor: the
    first pass of dynamic scaling, which reads gu and writes nothing else."""
    _check(gu)
    if not _use_triton(gu, use_triton):
        return _amax_torch(swiglu_torch(gu), gu.device)
    gu = _unit_cols(gu)
    amax = torch.zeros(1, dtype=torch.float32, device=gu.device)
    _launch(_swiglu_fp8_forward_kernel, (gu,), (gu.stride(0),), gu, gu.shape[1] // 2,
            torch.float8_e4m3fn, None, amax, False, False, gu.shape[0])
    return amax


def swiglu_fp8_backward(dh: torch.Tensor, gu: torch.Tensor, dtype: torch.dtype,
                        amax_src: torch.Tensor, *, write_q: bool = True,
                        write_qt: bool = True, pad_to: int = 16,
                        amax_out: torch.Tensor | None = None,
                        use_triton: bool | None = None, tile=None):
    """The SwiGLU's input gradient d(gu) = [dg | du] (T, 2i) from dh (T, i) and the
    forward's gu, cast to fp8 `dtype` with scale = fp8_max / max(amax_src), without
    writing d(gu). Returns `(q, qt, inv_scale)`: q (T, 2i), qt (2i, T_pad), as
    `fp8_cast_transpose(d(gu))` does; `amax_out` receives max |d(gu)|; `tile` as in
    `swiglu_fp8_forward`."""
    _check(gu, dh)
    ld = padded(gu.shape[0], pad_to)
    if not _use_triton(gu, use_triton):
        return _cast_torch(swiglu_backward_torch(dh, gu), dtype, _format(dtype)[0],
                           amax_src, write_q, write_qt, ld, amax_out)
    dh, gu = _unit_cols(dh), _unit_cols(gu)
    return _launch(_swiglu_fp8_backward_kernel, (dh, gu), (dh.stride(0), gu.stride(0)), gu,
                   gu.shape[1], dtype, amax_src, amax_out, write_q, write_qt, ld, tile)


def swiglu_fp8_backward_amax(dh: torch.Tensor, gu: torch.Tensor, *,
                             use_triton: bool | None = None):
    """max |d(gu)| as a (1,) fp32 tensor: dynamic scaling's first pass of the backward."""
    _check(gu, dh)
    if not _use_triton(gu, use_triton):
        return _amax_torch(swiglu_backward_torch(dh, gu), gu.device)
    dh, gu = _unit_cols(dh), _unit_cols(gu)
    amax = torch.zeros(1, dtype=torch.float32, device=gu.device)
    _launch(_swiglu_fp8_backward_kernel, (dh, gu), (dh.stride(0), gu.stride(0)), gu,
            gu.shape[1], torch.float8_e5m2, None, amax, False, False, gu.shape[0])
    return amax


# ------------------------------------------------------------------- torch reference


def swiglu_torch(gu: torch.Tensor) -> torch.Tensor:
    """h = silu(g) · u in fp32, rounded to gu's dtype: the kernels' formula in torch ops
    (torch's exp may differ from the GPU's or NumPy's in the last bit)."""
    i = gu.shape[1] // 2
    g, u = gu[:, :i].float(), gu[:, i:].float()
    s = 1.0 / (1.0 + torch.exp(-g))
    return (g * s * u).to(gu.dtype)


def swiglu_backward_torch(dh: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """[dg | du] (T, 2i) in gu's dtype, by the backward kernel's formula in torch ops."""
    i = gu.shape[1] // 2
    g, u, d = gu[:, :i].float(), gu[:, i:].float(), dh.float()
    s = 1.0 / (1.0 + torch.exp(-g))
    dg = d * u * (s * (1.0 + g * (1.0 - s)))
    du = d * (g * s)
    return torch.cat([dg, du], dim=1).to(gu.dtype)


def _amax_torch(t: torch.Tensor, device) -> torch.Tensor:
    return t.abs().amax().float().reshape(1) if t.numel() else torch.zeros(1, device=device)
