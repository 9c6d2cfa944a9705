"""RMSNorm, with the residual add, writing its output straight to fp8 in both layouts.

In the fp8 step each decoder layer has two RMSNorms whose output y feeds an fp8
projection (`input_layernorm` -> `qkv_proj`, `post_attention_layernorm` ->
`gate_up_proj`). Composed from the parts, the norm writes y (T, d) in the activation
dtype and the projection's cast (`kernels.fp8_cast`) reads it back to write its e4m3
copies: row-major for the forward GEMM, transposed for dW. y has no other reader (the
norm's backward reads h and rstd). This kernel normalises and casts in one kernel, so
y is never written::

    h = x + residual          (fused add; rounded to its dtype and stored, as the norm does)
    r = (mean(h²) + eps)^(-1/2)                stored (fp32) for the norm's backward
    y = h · r · w                              rounded to the dtype the norm writes y in
    write q(y · s) (T, d) and its transpose (d, T_pad), zero-padded to T_pad = 16k tokens

Bytes per element of y (bf16, delayed scaling, whose scale is known before the pass)::

                      unfused: norm, then cast                fused (this file)
    with residual     read 4, write h 2, y 2; cast: read 2,   read 4, write 2 + 1 + 1 = 8
                      write 1 + 1                    = 12
    no residual       read 2, write 2; cast: read 2,          read 2, write 1 + 1 = 4
                      write 1 + 1                    = 8

At llama-7b (16,384 tokens, d = 4096) that is 0.27 GB a norm, two norms a layer.
Dynamic scaling needs amax(y) before the cast: the kernel's amax-only mode reads x (and
the residual) once more and writes nothing else (`rms_norm_fp8_amax`); the unfused path
reads y for it instead, after writing it.

**Tiles.** A program covers BLOCK_T tokens, in one of two ways: the cast runs two
passes (`CAST_TILES`), the amax pass, which stores no fp8, one (`AMAX_TILES`); each is
autotuned over its tiles.

*Two passes* (BLOCK_T = 16 or 32) keep no row in registers::

    pass 1, per row tile of the norm kernel (ROWS rows: one for d > 2048):
        read x (and the residual), store h and r          the norm kernel's own tile
    pass 2, per (BLOCK_T, BLOCK_C) tile of columns:
        re-read h (x without a residual), y = h · r · w, store q and qᵀ

Pass 1 is the norm kernel's computation on the norm kernel's tile shape, with its warps
and vector widths, so a row's sum has its layout by construction; pass 2 is element by
element (and a max), its bits independent of its tile. yᵀ is written in runs of BLOCK_T
bytes, half or all of a 32-byte sector. The re-read costs 2 bytes an element of bf16 h
(d · BLOCK_T · 2 bytes a program, 256 KB at d = 4096 and 32 tokens) of L2 traffic, and
none of DRAM's as long as h stays in L2: 50 MB on an H100 hold the h of about 200 such
programs, 1.5 per SM, so whether it stays depends on how many programs run at once,
which the autotuner's timing settles.

*One pass* holds the BLOCK_T whole rows in registers, as up to three power-of-two pieces
(`_norm_common.row_pieces`), as the norm kernel (`kernels.rms_norm`) holds its row tile
(one row at d = 4096), and keeps of y only max |y|: the amax pass reads x (and the
residual) once and stores nothing else. On a GPU the order in which a row's squares are
added follows how the tile is laid out over a thread's registers, the lanes and the
warps. So this kernel runs with the norm kernel's warps (`_norm_common.launch_config`)
and caps its loads at the norm kernel's vector width (`_vectors`): a row is then laid
out as in the norm kernel, the extra rows repeating each thread's share, and summed in
the same order, so r, y and the amax keep the norm kernel's bits. A thread holds
BLOCK_T · d / (32 · warps) fp32 values of h: at d = 4096 in bf16 with the norm kernel's
8 warps, ptxas (Triton 3.7.1) gives the amax pass 48 registers a thread at BLOCK_T = 2,
90 at 4 and 162 at 8, and spills at 16. A cast in one pass would store yᵀ in runs of
those BLOCK_T bytes, a 32-byte sector shared by 32 / BLOCK_T programs: on an H100 (d =
4096, bf16) such a cast moves 27–60% of the copy rate, against 71% for two passes at
(32, 128).

`sm90_compile.row_reduction_layouts` reads the layouts from the kernels compiled for
sm_90 (a CPU test compares them, a GPU test the bits). Both families lay a row out as the
norm kernel does at the hidden sizes of the LLaMA models (1024 to 8192 checked, in
several pieces too). Below 1024 Triton may lay out a small tile otherwise: one pass at
tiles of fewer rows than the norm kernel's (the autotuner never picks those: `_prune`),
two passes at rows of several small pieces (d = 48 or 208 in bf16, where no tile keeps
the norm kernel's order and r can differ from its in the last bit).
Under the interpreter a row's sum does not depend on the tile.

**Rounding.** y is rounded to the norm's output dtype (that of x + residual) before it
is scaled, as the unfused path rounds it when it writes y, so both paths quantise the
same numbers and write the same fp8 bits; scale, saturation and the zero padding of the
transposed copy are `kernels.fp8_cast`'s.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from colossal_lab.kernels import INTERPRET
from colossal_lab.kernels._norm_common import (
    SMALL_ROWS,
    _row_tile,
    _to_dtype,
    check_input,
    check_param,
    launch_config,
)
from colossal_lab.kernels.fp8_cast import (
    EPS,
    _cast_torch,
    _format,
    _quantize,
    _scale,
    _store_both,
    _use_triton,
    fp8_amax,
    padded,
)
from colossal_lab.kernels.rms_norm import _rms_norm_forward_kernel, _rms_norm_forward_piece

CAST_TILES = ((16, 64), (32, 64), (16, 128), (32, 128))
"""(BLOCK_T, BLOCK_C) the cast (q, qᵀ or both written) is autotuned over, for each
(tokens, hidden, residual, outputs written): the first call of a shape times each and
keeps the fastest. All run two passes, the second in tiles of BLOCK_T tokens by BLOCK_C
columns (module docstring): yᵀ is stored in runs of BLOCK_T bytes."""
AMAX_TILES = ((8, 0), (4, 0), (2, 0), (16, 0))
"""(BLOCK_T, 0): the amax pass's tiles, one pass over BLOCK_T whole rows held in
registers (16 only pays at small hidden sizes; it spills at 4096). It stores no yᵀ, so
the short runs that keep the cast off one pass cost it nothing, and it reads x once."""
TILES = AMAX_TILES + CAST_TILES
"""Every tile: the amax pass is autotuned over all, `_prune` keeping the one-pass tiles
where it may and the two-pass ones where none is left. The warps are the norm kernel's
and each row's sum is laid out as in it, so the outputs do not depend on the tile, bit
for bit. Under the interpreter each autotuner has only its first tile: `CAST_TILES[0]`
for the cast, `TILES[0]` (one pass) for the amax pass."""
_TUNE_KEY = ["n_rows", "n_cols", "HAS_RESIDUAL", "WRITE_Q", "WRITE_QT", "WRITE_AMAX"]


# ------------------------------------------------------------------------------ kernel


@triton.jit
def _rms_norm_rows(X, RES, HOUT, rows, row_ok, stride_x, stride_res, n_cols, eps,
                   HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr, P0: tl.constexpr,
                   P1: tl.constexpr, P2: tl.constexpr, VEC0: tl.constexpr,
                   VEC1: tl.constexpr, VEC2: tl.constexpr):
    """r = (mean(h²) + eps)^-1/2 of each row of the tile, read (and h stored) piece by
    piece as the norm kernel reads them and summed in its order; returns r and the
    pieces x0, x1, x2 (h with a residual; fp32; an absent piece repeats x0, unused)."""
    x0 = _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res, n_cols,
                                 0, P0, HAS_RESIDUAL, STORE_H, VEC0)
    sum_sq = tl.sum(x0 * x0, axis=1)  # (rows,)
    x1 = x0
    x2 = x0
    if P1 > 0:
        x1 = _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res,
                                     n_cols, P0, P1, HAS_RESIDUAL, STORE_H, VEC1)
        sum_sq += tl.sum(x1 * x1, axis=1)
    if P2 > 0:
        x2 = _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res,
                                     n_cols, P0 + P1, P2, HAS_RESIDUAL, STORE_H, VEC2)
        sum_sq += tl.sum(x2 * x2, axis=1)
    return tl.rsqrt(sum_sq / n_cols + eps), x0, x1, x2


@triton.jit
def _normed(x, rstd, w, row_ok, dtype: tl.constexpr):
    """y = x · r · w (the norm kernel's formula) rounded to `dtype` (what the unfused
    norm writes), fp32; rows past the tokens (yᵀ's padding) are +0."""
    y = x * rstd[:, None] * w[None, :]
    return tl.where(row_ok[:, None], _to_dtype(y, dtype).to(tl.float32), 0.0)


@triton.constexpr_function
def _shared_width(rows, cols, ROWS, P0, P1, P2, VEC0, VEC1, VEC2):
    """Widest vector (elements along its last axis) a pass-2 access of a (rows, cols)
    tile may take: the piece's VEC where a pass-1 tile (ROWS, P) has that very shape,
    else `cols`. Triton's coalescing gives all accesses of one shape in a kernel the
    widest vector any of them allows; the fp8 stores of an equal-shaped pass-2 tile (at
    d <= 128) would widen the pass-1 rows past the norm kernel's layout."""
    for p, vec in ((P0, VEC0), (P1, VEC1), (P2, VEC2)):
        if p and (rows, cols) == (ROWS, p):
            return vec
    return cols


@triton.jit
def _piece_amax(W, x, rstd, row_ok, n_cols, dtype: tl.constexpr, OFF: tl.constexpr,
                P: tl.constexpr):
    """One pass: max |y| over columns OFF .. OFF + P - 1 of the tile, whose h is `x`
    (fp32, zero past n_cols)."""
    cols = OFF + tl.arange(0, P)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)  # (P,)
    y = _normed(x, rstd, w, row_ok, dtype)
    return tl.max(tl.max(tl.abs(y), axis=1), axis=0)


@triton.jit
def _rms_norm_fp8_kernel(
    X,  # (n_rows, n_cols) input x, row stride stride_x, unit column stride
    RES,  # (n_rows, n_cols) residual, row stride stride_res (HAS_RESIDUAL only)
    W,  # (n_cols,) norm weight, any float dtype (upcast)
    HOUT,  # (n_rows, n_cols) output h = x + residual, contiguous (stored with the cast);
    #        without a residual, any tensor of y's dtype (its dtype is all that is read)
    RSTD,  # (n_rows,) fp32 output r, for the norm's backward: stored by pass 1 and re-read
    #        by pass 2 (the amax pass's to a scratch buffer); one pass leaves it alone
    Q,  # (n_rows, n_cols) fp8 output q(y · scale), contiguous (WRITE_Q)
    QT,  # (n_cols, ld_qt) fp8 output, Q transposed, columns n_rows..ld_qt-1 zero (WRITE_QT)
    AMAX_SRC,  # (n_src,) fp32: the scale is fp8_max / max(AMAX_SRC) (WRITE_Q or WRITE_QT)
    INV_SCALE,  # (1,) fp32 output: 1 / scale, written by program 0
    AMAX_OUT,  # (1,) fp32, zero-initialised: max |y| by atomic max (WRITE_AMAX)
    stride_x,  # elements between rows of X
    stride_res,  # elements between rows of RES
    n_rows,  # T, tokens
    n_cols,  # d, the normalised length
    ld_qt,  # row length of QT (n_rows padded to a multiple of 16)
    n_src,  # entries of AMAX_SRC
    eps,  # added to mean(h²) before the square root
    FP8_MAX: tl.constexpr,  # largest finite value of the fp8 format
    MANT_BITS: tl.constexpr,  # mantissa bits of the format (interpreter rounding only)
    MIN_EXP: tl.constexpr,  # exponent of its smallest normal (interpreter rounding only)
    EPS: tl.constexpr,  # floor of the amax the scale is computed from
    HAS_RESIDUAL: tl.constexpr,  # fuse h = x + residual in front of the norm
    WRITE_Q: tl.constexpr,  # write the row-major copy
    WRITE_QT: tl.constexpr,  # write the transposed copy
    WRITE_AMAX: tl.constexpr,  # reduce max |y| into AMAX_OUT (alone: the amax pass)
    ROUND_IN_FP32: tl.constexpr,  # pre-round to the fp8 grid (the interpreter's casts)
    BLOCK_SRC: tl.constexpr,  # next_power_of_2(n_src)
    P0: tl.constexpr,  # the row's power-of-two pieces (`row_pieces`); P1, P2 may be 0
    P1: tl.constexpr,
    P2: tl.constexpr,
    VEC0: tl.constexpr,  # vector width of each piece's accesses: the norm kernel's
    VEC1: tl.constexpr,  # (`_vectors`), so that a row is laid out as it lays it out
    VEC2: tl.constexpr,
    ROWS: tl.constexpr,  # the norm kernel's rows per tile: the row tile of pass 1
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_C: tl.constexpr,  # 0: one pass (the amax pass only); else two, pass 2 in
    #                         tiles of BLOCK_C columns
):
    """BLOCK_T rows: h (stored), r = (mean(h²) + eps)^-1/2 (stored), y = h · r · w rounded
    to HOUT's dtype, cast to fp8 and stored as is and transposed. Programs past n_rows
    (up to ld_qt) store the zero padding of QT. Without WRITE_Q and WRITE_QT (the amax
    pass) nothing is stored but the amax (and, in two passes, r); one pass
    (BLOCK_C = 0) runs only that."""
    CAST: tl.constexpr = WRITE_Q or WRITE_QT
    if BLOCK_C == 0:  # one pass, the amax pass: the BLOCK_T rows in registers, whole
        tl.static_assert(not CAST, "one pass computes the amax only")
        rows, row_ok = _row_tile(tl.program_id(0), n_rows, BLOCK_T)
        rstd, x0, x1, x2 = _rms_norm_rows(X, RES, HOUT, rows, row_ok, stride_x,
                                          stride_res, n_cols, eps, HAS_RESIDUAL, False,
                                          P0, P1, P2, VEC0, VEC1, VEC2)  # (BLOCK_T,) r
        dtype: tl.constexpr = HOUT.dtype.element_ty
        amax = _piece_amax(W, x0, rstd, row_ok, n_cols, dtype, 0, P0)
        if P1 > 0:
            amax = tl.maximum(amax, _piece_amax(W, x1, rstd, row_ok, n_cols, dtype, P0, P1))
        if P2 > 0:
            amax = tl.maximum(amax, _piece_amax(W, x2, rstd, row_ok, n_cols, dtype,
                                                P0 + P1, P2))
    else:
        # pass 1: the norm kernel's own row tiles (ROWS rows, one for d > 2048;
        # past BLOCK_T masked off), h and r stored
        first = tl.program_id(0).to(tl.int64) * BLOCK_T
        for r0 in range(0, BLOCK_T, ROWS):
            sub = r0 + tl.arange(0, ROWS)
            rows = first + sub  # (ROWS,) int64
            row_ok = (rows < n_rows) & (sub < BLOCK_T)
            rstd, _, _, _ = _rms_norm_rows(X, RES, HOUT, rows, row_ok, stride_x,
                                           stride_res, n_cols, eps, HAS_RESIDUAL, CAST,
                                           P0, P1, P2, VEC0, VEC1, VEC2)
            tl.store(RSTD + rows, rstd, mask=row_ok)
        tl.debug_barrier()  # pass 2 reads h and r other threads of the program stored
        # pass 2: (BLOCK_T, BLOCK_C) tiles of h, re-read (from L2), normalised and cast
        rows, row_ok = _row_tile(tl.program_id(0), n_rows, BLOCK_T)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (BLOCK_T,) r
        scale = 1.0
        if CAST:
            scale = _scale(AMAX_SRC, INV_SCALE, n_src, FP8_MAX, EPS, BLOCK_SRC)
        VEC_C: tl.constexpr = _shared_width(BLOCK_T, BLOCK_C, ROWS, P0, P1, P2, VEC0,
                                            VEC1, VEC2)
        VEC_T: tl.constexpr = _shared_width(BLOCK_C, BLOCK_T, ROWS, P0, P1, P2, VEC0,
                                            VEC1, VEC2)  # of yᵀ's (BLOCK_C, BLOCK_T)
        rows_t = tl.max_contiguous(rows, [VEC_T])
        peak = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)  # running max |y|
        for c0 in range(0, n_cols, BLOCK_C):
            cols = tl.max_contiguous(c0 + tl.arange(0, BLOCK_C), [VEC_C])
            col_ok = cols < n_cols
            mask = row_ok[:, None] & col_ok[None, :]
            if HAS_RESIDUAL and CAST:  # h as pass 1 stored it
                x = tl.load(HOUT + rows[:, None] * n_cols + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
            else:
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                if HAS_RESIDUAL:  # the amax pass stores no h: pass 1's sum, again
                    res = tl.load(RES + rows[:, None] * stride_res + cols[None, :],
                                  mask=mask, other=0.0).to(tl.float32)
                    x = _to_dtype(x + res, HOUT.dtype.element_ty).to(tl.float32)
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK_C,)
            y = _normed(x, rstd, w, row_ok, HOUT.dtype.element_ty)  # (BLOCK_T, BLOCK_C)
            peak = tl.maximum(peak, tl.abs(y))
            if CAST:
                q = _quantize(y, scale, QT.dtype.element_ty, FP8_MAX, MANT_BITS, MIN_EXP,
                              ROUND_IN_FP32)
                _store_both(Q, QT, q, rows_t, cols, mask, n_cols, n_cols, ld_qt, WRITE_Q,
                            WRITE_QT)
        amax = tl.max(tl.max(peak, axis=1), axis=0)
    if WRITE_AMAX:
        tl.atomic_max(AMAX_OUT, amax)


def _vectors(cfg, dtype: torch.dtype) -> dict[str, int]:
    """VEC0..2: the vector width (elements) of each piece's loads and stores in the norm
    kernel launched with `cfg`: 16 bytes, fewer where its (rows, P) tile gives a thread
    fewer elements. Capping this kernel's accesses at the same width gives its
    (BLOCK_T, P) tiles the norm kernel's layout along the row."""
    vec = 16 // dtype.itemsize
    return {f"VEC{i}": max(1, min(vec, cfg.rows * p // (32 * cfg.num_warps))) if p else 1
            for i, p in enumerate(cfg.pieces)}


def _prune(configs, named_args, **kwargs):
    """The autotuner's prune. A cast takes the two-pass tiles, whose yᵀ runs (BLOCK_T
    bytes) are longer than the registers let one pass's be (module docstring). The amax
    pass (no fp8 written) takes the one-pass tiles, which read x once, but not those of
    fewer rows than the norm kernel's row tile (ROWS): such a tile spreads a row over
    more lanes or warps than the norm kernel does, so on a GPU it adds a row's squares
    in another order (r may differ in its last bit, and with it the amax; the offline
    layout test shows it at d = 64 to 1,024). Where no one-pass tile is left it takes
    the two-pass ones, whose pass 1 runs on the norm kernel's own row tile. Under the
    interpreter a row's sum does not depend on the tile."""
    two = [c for c in configs if c.kwargs["BLOCK_C"]]
    if kwargs["WRITE_Q"] or kwargs["WRITE_QT"]:
        return two
    return [c for c in configs if c.kwargs["BLOCK_C"] == 0
            and (INTERPRET or c.kwargs["BLOCK_T"] >= kwargs["ROWS"])] or two


@functools.cache
def _autotuned(num_warps: int, cast: bool):
    """The kernel at `num_warps` (the norm kernel's) autotuned for a cast over
    `CAST_TILES`, for the amax pass over `TILES` (`_prune` picks among them); under the
    interpreter at the first of those only."""
    tiles = CAST_TILES if cast else TILES
    configs = [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=num_warps)
               for t, c in (tiles[:1] if INTERPRET else tiles)]
    return triton.autotune(configs=configs, key=_TUNE_KEY,
                           prune_configs_by={"early_config_prune": _prune}
                           )(_rms_norm_fp8_kernel)


# ---------------------------------------------------------------------------- launchers


def _check(x2d, residual2d, w):
    """Checks as the norm's; returns w contiguous."""
    check_input(x2d)
    if x2d.dim() != 2 or x2d.stride(1) != 1:
        raise ValueError(f"x must be 2-D (T, d) with unit column stride, got shape "
                         f"{tuple(x2d.shape)}, strides {x2d.stride()}")
    if residual2d is not None:
        check_input(residual2d)
        if residual2d.shape != x2d.shape or residual2d.stride(1) != 1 \
                or residual2d.device != x2d.device:
            raise ValueError(f"residual {tuple(residual2d.shape)} must have x's shape "
                             f"{tuple(x2d.shape)}, unit column stride and x's device")
    return check_param(w, x2d.shape[1], x2d, "weight")


def _check_tile(tile, cast: bool) -> None:
    """A cast runs two passes: a one-pass tile (BLOCK_C = 0) is refused for it."""
    if cast and tile is not None and not tile[1]:
        raise ValueError(f"tile {tuple(tile)} runs one pass, which computes the amax only: "
                         f"a cast takes a two-pass tile (BLOCK_C > 0), one of {CAST_TILES}")


def _launch(x2d, residual2d, w, eps, dtype, amax_src, amax_out, write_q, write_qt, ld,
            tile=None):
    """Run the kernel over token tiles; returns (q, qt, inv_scale, h, rstd), h None
    without a residual. `tile`, (BLOCK_T, BLOCK_C) or (BLOCK_T, BLOCK_C, num_warps),
    bypasses the autotuner (tests, probes; num_warps None or absent: the norm kernel's):
    for a cast one of `CAST_TILES` (two passes), for the amax pass one of `TILES`."""
    T, d = x2d.shape
    fp8_max, mant, min_exp = _format(dtype)
    dev = x2d.device
    cast = write_q or write_qt
    y_dtype = x2d.dtype if residual2d is None else torch.result_type(x2d, residual2d)
    q = torch.empty(T, d, dtype=dtype, device=dev) if write_q else None
    qt = torch.empty(d, ld, dtype=dtype, device=dev) if write_qt else None
    h = torch.empty(T, d, dtype=y_dtype, device=dev) \
        if cast and residual2d is not None else None
    rstd = torch.empty(T, dtype=torch.float32, device=dev) if cast else None
    inv = torch.empty(1, dtype=torch.float32, device=dev)
    block_t, block_c, warps = (*tile, None)[:3] if tile is not None else (0, None, None)
    r_out = rstd  # the cast stores r for the norm's backward
    if rstd is None:  # the amax pass: two passes store r and re-read it, here to scratch;
        # one pass stores none (the autotuner may take either)
        r_out = inv if block_c == 0 else torch.empty(T, dtype=torch.float32, device=dev)
    dummy = q if q is not None else qt if qt is not None else \
        torch.empty(1, dtype=dtype, device=dev)
    src = amax_src.reshape(-1) if amax_src is not None else inv
    n_tiled = ld if write_qt else T
    if n_tiled == 0:
        return q, qt, inv, h, rstd
    res = residual2d if residual2d is not None else x2d
    hout = h if h is not None else x2d if residual2d is None else \
        torch.empty(1, dtype=y_dtype, device=dev)  # the amax pass: h's dtype only
    cfg = launch_config(d, x2d.dtype, small=T <= SMALL_ROWS and residual2d is None)
    warps = warps or cfg.num_warps
    run = _autotuned(warps, cast) if tile is None else _rms_norm_fp8_kernel
    fixed = {} if tile is None else {"BLOCK_T": block_t, "BLOCK_C": block_c,
                                     "num_warps": warps}

    def grid(meta):
        return (triton.cdiv(n_tiled, meta["BLOCK_T"]),)

    run[grid](
        x2d, res, w, hout, r_out,
        dummy if q is None else q, dummy if qt is None else qt, src, inv,
        amax_out if amax_out is not None else inv,
        x2d.stride(0), res.stride(0), T, d, ld, src.numel(), eps,
        FP8_MAX=fp8_max, MANT_BITS=mant, MIN_EXP=min_exp, EPS=EPS,
        HAS_RESIDUAL=residual2d is not None, WRITE_Q=write_q, WRITE_QT=write_qt,
        WRITE_AMAX=amax_out is not None, ROUND_IN_FP32=INTERPRET or not x2d.is_cuda,
        BLOCK_SRC=triton.next_power_of_2(max(src.numel(), 2)), P0=cfg.pieces[0],
        P1=cfg.pieces[1], P2=cfg.pieces[2], **_vectors(cfg, x2d.dtype), ROWS=cfg.rows,
        **fixed)
    return q, qt, inv, h, rstd


def rms_norm_fp8(x2d: torch.Tensor, residual2d: torch.Tensor | None, w: torch.Tensor,
                 eps: float, dtype: torch.dtype, amax_src: torch.Tensor, *,
                 write_q: bool = True, write_qt: bool = True, pad_to: int = 16,
                 amax_out: torch.Tensor | None = None, use_triton: bool | None = None,
                 tile=None):
    """y = RMSNorm(x + residual) · w (residual None: of x) cast to fp8 `dtype` with
    scale = fp8_max / max(amax_src), without writing y.

    Args:
        x2d, residual2d: (T, d), unit column stride; residual None: no add.
        w: (d,) norm weight, any float dtype; eps: added to mean(h²).
    Returns `(q, qt, inv_scale, h, rstd)`: q (T, d) or None, qt (d, T_pad) (columns T..
    zero) or None and inv_scale (1,) fp32, as `fp8_cast_transpose(y)` returns them; h =
    x + residual (T, d) in the dtype of x + residual (None without a residual) and rstd
    (T,) fp32, as `add_rms_norm_forward` / `rms_norm_forward` return them. With
    `amax_out` (a zeroed (1,) fp32 tensor), max |y| is reduced into it. Kernel on CUDA
    (`use_triton=None`), torch ops elsewhere; True forces the kernel. `tile` (one of
    `CAST_TILES`, or with the warps appended: (BLOCK_T, BLOCK_C, num_warps)) runs that
    tile instead of the autotuner's choice; a one-pass tile (BLOCK_C = 0) raises
    ValueError (with write_q or write_qt)."""
    w = _check(x2d, residual2d, w)
    _check_tile(tile, write_q or write_qt)
    ld = padded(x2d.shape[0], pad_to)
    if not _use_triton(x2d, use_triton):
        y, h, rstd = rms_norm_torch(x2d, residual2d, w, eps)
        return (*_cast_torch(y, dtype, _format(dtype)[0], amax_src, write_q, write_qt, ld,
                             amax_out), h, rstd)
    return _launch(x2d, residual2d, w, eps, dtype, amax_src, amax_out, write_q, write_qt,
                   ld, tile)


def rms_norm_fp8_amax(x2d: torch.Tensor, residual2d: torch.Tensor | None, w: torch.Tensor,
                      eps: float, *, use_triton: bool | None = None,
                      tile=None) -> torch.Tensor:
    """max |y| of y = RMSNorm(x + residual) · w (rounded to its dtype) as a (1,) fp32
    tensor: dynamic scaling's first pass (reads x and the residual, writes nothing
    else). `tile`, one of `TILES` (one pass or two; two also write r to a scratch
    buffer) or with the warps appended, runs that tile instead of the autotuner's
    choice."""
    w = _check(x2d, residual2d, w)
    if not _use_triton(x2d, use_triton):
        return fp8_amax(rms_norm_torch(x2d, residual2d, w, eps)[0], use_triton=False)
    amax = torch.zeros(1, dtype=torch.float32, device=x2d.device)
    _launch(x2d, residual2d, w, eps, torch.float8_e4m3fn, None, amax, False, False,
            x2d.shape[0], tile)
    return amax


def aot_arguments(hidden: int, dtype: torch.dtype, residual_dtype: torch.dtype | None,
                  tile: tuple[int, int], tokens: int = 16384) -> tuple[tuple, tuple]:
    """(fn, signature, constexprs, num_warps, divisible) of the norm kernel's forward
    (`kernels.rms_norm`) and of this kernel at `tile` = (BLOCK_T, BLOCK_C) (one of
    `TILES`), for `tokens` rows of `hidden` in `dtype` (and a residual), to compile both
    for sm_90 without a GPU (`sm90_compile.compile_sm90`) and compare how they lay out
    a row. This kernel is compiled in the mode the tile runs: a two-pass tile writes
    both fp8 copies and the amax, a one-pass tile the amax alone (the amax pass)."""
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
    y_dtype = dtype if residual_dtype is None else torch.promote_types(dtype, residual_dtype)
    cfg = launch_config(hidden, dtype, small=tokens <= SMALL_ROWS and residual_dtype is None)
    x, res, y = ptr[dtype], ptr[residual_dtype or dtype], ptr[y_dtype]
    pieces = dict(P0=cfg.pieces[0], P1=cfg.pieces[1], P2=cfg.pieces[2])
    ints = ("stride_x", "stride_res", "n_rows", "n_cols")
    norm_sig = dict(X=x, RES=res, W="*bf16", Y=y, HOUT=y, RSTD="*fp32",
                    **dict.fromkeys(ints, "i32"), eps="fp32")
    norm = (_rms_norm_forward_kernel, norm_sig,
            dict(HAS_RESIDUAL=residual_dtype is not None, ALIGN=16, ROWS=cfg.rows, **pieces),
            cfg.num_warps, (*list(norm_sig)[:6], *ints))  # H, strides: multiples of 256
    sig = dict(X=x, RES=res, W="*bf16", HOUT=y, RSTD="*fp32", Q="*fp8e4nv", QT="*fp8e4nv",
               AMAX_SRC="*fp32", INV_SCALE="*fp32", AMAX_OUT="*fp32",
               **dict.fromkeys((*ints, "ld_qt", "n_src"), "i32"), eps="fp32")
    fmax, mant, min_exp = _format(torch.float8_e4m3fn)
    cast = tile[1] > 0
    fused = (_rms_norm_fp8_kernel, sig,
             dict(FP8_MAX=fmax, MANT_BITS=mant, MIN_EXP=min_exp, EPS=EPS,
                  HAS_RESIDUAL=residual_dtype is not None, WRITE_Q=cast, WRITE_QT=cast,
                  WRITE_AMAX=True, ROUND_IN_FP32=False, BLOCK_SRC=16, **pieces,
                  **_vectors(cfg, dtype), ROWS=cfg.rows, BLOCK_T=tile[0],
                  BLOCK_C=tile[1]),
             cfg.num_warps, (*list(sig)[:10], *ints, "ld_qt", "n_src"))
    return norm, fused


# ------------------------------------------------------------------- torch reference


def rms_norm_torch(x2d: torch.Tensor, residual2d: torch.Tensor | None, w: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h, rstd) by the kernel's formulas in torch ops: h = x + residual rounded to
    its dtype, r = (mean(h²) + eps)^-1/2 in fp32, y = h · r · w rounded to h's dtype (x's
    without a residual). torch sums the squares in another order than the kernel, so r
    may differ in its last bit."""
    h = None
    xf = x2d.float()
    if residual2d is not None:
        h = (xf + residual2d.float()).to(torch.result_type(x2d, residual2d))
        xf = h.float()
    rstd = torch.rsqrt((xf * xf).sum(1) / x2d.shape[1] + eps)
    y = (xf * rstd[:, None] * w.float()).to(x2d.dtype if h is None else h.dtype)
    return y, h, rstd
