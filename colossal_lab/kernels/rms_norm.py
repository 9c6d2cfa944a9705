"""Fused RMSNorm, and residual-add + RMSNorm, in Triton.

Math (per row x of length H; Zhang & Sennrich, "Root Mean Square Layer Normalization",
2019)::

    r  = (mean(x²) + eps)^(-1/2)          one scalar per row, saved (fp32) as `rstd`
    x̂  = x · r
    y  = x̂ · w

Backward, from y_j = w_j x_j r and ∂r/∂x_i = -r³ x_i / H::

    dx = r · (dy·w − x̂ · c),    c = mean(dy · w · x̂)       (one scalar per row)
    dw = Σ_rows dy · x̂

Fused residual add (the pre-norm block's `h = x + residual; y = norm(h)`)::

    h  = x + residual          stored in the dtype of x + residual; normalised as stored
    y  = rms_norm(h)
    dh_total = dh_from_norm + dh_in,     dx = dresidual = dh_total

where dh_in is the gradient reaching h from its other use (the next residual add).

Bytes moved per element of x (N = rows·H elements; bf16 in and out; the eager column
counted op by op by `colossal_lab.benchmarks.fused_norm.traffic_bytes`)::

                          eager (rms_norm_ref)       fused (this file)
    forward               36 N  8 kernels            4 N  read x; write y
    backward              92 N  16 kernels           6 N  read x, dy; write dx
    add + norm, forward   42 N  (the add: 6 N)       8 N  read x, res; write h, y
    add + norm, backward  98 N  (dh sum: 6 N)        8 N  read dy, h, dh_in; write dh

(fp32: eager 28 N / 92 N against fused 8 N / 12 N.) The weight, rstd and the dweight
partials are O(H + rows), negligible beside these. Eager normalisation is a chain of
element-wise kernels each of which streams the whole activation through memory, with
fp32 intermediates twice the size of the bf16 input; the fused kernel keeps a row in
registers between reading and writing it.

Design (see `_norm_common`): forward, one program per tile of whole rows, 16-byte loads;
backward, a persistent grid of a few programs per SM looping over row tiles, each
accumulating Σ dy·x̂ in registers and writing one (H,) fp32 partial, summed by
`sum_partials` (one launch, in fp32, rounded once to w's dtype).

Numerics differ from the LLaMA reference in one place: the reference rounds x̂ to x's
dtype before multiplying by w; we multiply in fp32 and round once. The output is x's
dtype also when w is fp32 (autocast keeps fp32 weights): the reference would promote.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from colossal_lab.kernels import native
from colossal_lab.kernels._norm_common import (
    DEFAULTS,
    SMALL_ROWS,
    LaunchConfig,
    _piece,
    _rms_norm_partials_sum_kernel,
    _row_tile,
    _to_dtype,
    alignment,
    as_rows,
    cdiv,
    check_input,
    check_param,
    launch_config,
    persistent_programs,
    sum_partials,
)
from colossal_lab.kernels.launch import launch, plan_key, runner_for


@triton.jit
def _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res, n_cols,
                            OFF: tl.constexpr, P: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr = True,
                            VEC: tl.constexpr = 0):
    """Columns OFF .. OFF + P - 1 of the tile: x (or h = x + residual, stored unless
    STORE_H is False), fp32. VEC > 0 caps the accesses' vector width at VEC elements
    (`rms_norm_fp8` lays its wider tile out as this kernel's)."""
    cols, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    cols = cols[None, :]  # (1, P)
    if VEC > 0:
        cols = tl.max_contiguous(cols, [1, VEC])
    x = tl.load(X + rows[:, None] * stride_x + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)  # (ROWS, P)
    if HAS_RESIDUAL:
        res = tl.load(RES + rows[:, None] * stride_res + cols, mask=mask, other=0.0)
        # h is rounded to its dtype, stored, and normalised *as stored*, so that the
        # backward, which re-reads h, differentiates what the forward computed.
        h = _to_dtype(x + res.to(tl.float32), HOUT.dtype.element_ty)
        if STORE_H:
            tl.store(HOUT + rows[:, None] * n_cols + cols, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _rms_norm_store_piece(Y, W, x, rstd, rows, row_ok, n_cols,
                          OFF: tl.constexpr, P: tl.constexpr):
    """y = x · r · w for columns OFF .. OFF + P - 1 of the tile."""
    cols, col_ok, mask = _piece(rows, row_ok, n_cols, OFF, P)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)  # (P,)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], _to_dtype(y, Y.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_norm_forward_kernel(
    X,  # (n_rows, n_cols) input x, row stride stride_x
    RES,  # (n_rows, n_cols) residual, row stride stride_res (HAS_RESIDUAL only)
    W,  # (n_cols,) weight, any float dtype (upcast)
    Y,  # (n_rows, n_cols) output y in x's dtype (fused add: h's), contiguous
    HOUT,  # (n_rows, n_cols) output h = x + residual, contiguous (HAS_RESIDUAL only)
    RSTD,  # (n_rows,) fp32 output r, saved for the backward
    stride_x,  # elements between rows of X, / ALIGN
    stride_res,  # elements between rows of RES, / ALIGN
    n_rows,  # rows
    n_cols,  # H, the normalised length, / ALIGN
    eps,  # added to mean(x²) before the square root
    HAS_RESIDUAL: tl.constexpr,  # fuse h = x + residual in front of the norm
    ALIGN: tl.constexpr,  # power of two dividing H and the row strides (`alignment`)
    ROWS: tl.constexpr,  # rows per program
    P0: tl.constexpr,  # the row's power-of-two pieces (`row_pieces`); P1, P2 may be 0
    P1: tl.constexpr,
    P2: tl.constexpr,
):
    """y = x · r · w with r = (mean(x²) + eps)^-1/2, one tile of ROWS rows held in
    registers as up to three pieces of P0, P1 and P2 columns."""
    stride_x, stride_res, n_cols = stride_x * ALIGN, stride_res * ALIGN, n_cols * ALIGN
    rows, row_ok = _row_tile(tl.program_id(0), n_rows, ROWS)
    x0 = _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res, n_cols,
                                 0, P0, HAS_RESIDUAL)
    sum_sq = tl.sum(x0 * x0, axis=1)  # (ROWS,)
    if P1 > 0:
        x1 = _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res,
                                     n_cols, P0, P1, HAS_RESIDUAL)
        sum_sq += tl.sum(x1 * x1, axis=1)
    if P2 > 0:
        x2 = _rms_norm_forward_piece(X, RES, HOUT, rows, row_ok, stride_x, stride_res,
                                     n_cols, P0 + P1, P2, HAS_RESIDUAL)
        sum_sq += tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(sum_sq / n_cols + eps)  # (ROWS,) r
    _rms_norm_store_piece(Y, W, x0, rstd, rows, row_ok, n_cols, 0, P0)
    if P1 > 0:
        _rms_norm_store_piece(Y, W, x1, rstd, rows, row_ok, n_cols, P0, P1)
    if P2 > 0:
        _rms_norm_store_piece(Y, W, x2, rstd, rows, row_ok, n_cols, P0 + P1, P2)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_load_piece(DY, X, rows, row_ok, stride_dy, stride_x, n_cols,
                         OFF: tl.constexpr, P: tl.constexpr):
    """x and dy of columns OFF .. OFF + P - 1 of a row tile, as stored (not upcast: a
    prefetched tile waits in registers at half the size)."""
    cols, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _rms_norm_load_tile(DY, X, RSTD, tile, n_rows, stride_dy, stride_x, n_cols,
                        ROWS: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                        P2: tl.constexpr):
    """r, and x and dy of each piece, of row tile `tile` (rows past the end masked off);
    an absent piece (P1 or P2 = 0) repeats the first one's, never used."""
    rows, row_ok = _row_tile(tile, n_rows, ROWS)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,) r
    x0, dy0 = _rms_norm_load_piece(DY, X, rows, row_ok, stride_dy, stride_x, n_cols, 0, P0)
    x1, dy1 = x0, dy0
    x2, dy2 = x0, dy0
    if P1 > 0:
        x1, dy1 = _rms_norm_load_piece(DY, X, rows, row_ok, stride_dy, stride_x, n_cols,
                                       P0, P1)
    if P2 > 0:
        x2, dy2 = _rms_norm_load_piece(DY, X, rows, row_ok, stride_dy, stride_x, n_cols,
                                       P0 + P1, P2)
    return rstd, x0, dy0, x1, dy1, x2, dy2


@triton.jit
def _rms_norm_backward_piece(x, dy, w, rstd):
    """x̂ and dy (fp32) of one piece of the tile, and its share of Σ dy·w·x̂ per row.
    dy·w is not kept: `_rms_norm_dx_piece` multiplies again, one FMA per element, so a
    wide row holds three fp32 tiles across the row sum, not four (at H = 13824 four
    spill)."""
    x_hat = x.to(tl.float32) * rstd[:, None]
    dy = dy.to(tl.float32)
    return x_hat, dy, tl.sum(dy * w[None, :] * x_hat, axis=1)


@triton.jit
def _rms_norm_dx_piece(DX, DH_IN, x_hat, dy, w, rstd, c, rows, row_ok, stride_dh, n_cols,
                       OFF: tl.constexpr, P: tl.constexpr, HAS_DH_IN: tl.constexpr):
    """dx = r · (dy·w − x̂·c) (+ dh_in) for columns OFF .. OFF + P - 1, stored."""
    cols, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    dx = rstd[:, None] * (dy * w[None, :] - x_hat * c[:, None])
    if HAS_DH_IN:
        dh_in = tl.load(DH_IN + rows[:, None] * stride_dh + cols[None, :], mask=mask,
                        other=0.0)
        dx += dh_in.to(tl.float32)
    tl.store(DX + rows[:, None] * n_cols + cols[None, :], _to_dtype(dx, DX.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    DY,  # (n_rows, n_cols) gradient of y, row stride stride_dy
    X,  # (n_rows, n_cols) what was normalised (x, or h for the fused add)
    W,  # (n_cols,) weight
    RSTD,  # (n_rows,) fp32 r from the forward
    DH_IN,  # (n_rows, n_cols) gradient reaching h from elsewhere (HAS_DH_IN only)
    DX,  # (n_rows, n_cols) output dx (dh_total for the fused add), contiguous
    DW_PARTIAL,  # (n_programs, n_cols) fp32 output: this program's Σ dy·x̂
    stride_dy,  # elements between rows of DY, / ALIGN
    stride_x,  # elements between rows of X, / ALIGN
    stride_dh,  # elements between rows of DH_IN, / ALIGN
    n_rows,  # rows
    n_cols,  # H, / ALIGN
    HAS_DH_IN: tl.constexpr,  # add dh_in to dx (fused add: dh_total)
    ALIGN: tl.constexpr,  # power of two dividing H and the row strides (`alignment`)
    ROWS: tl.constexpr,  # rows per tile
    P0: tl.constexpr,  # the row's power-of-two pieces (`row_pieces`); P1, P2 may be 0
    P1: tl.constexpr,
    P2: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the row loop
    PREFETCH: tl.constexpr,  # load tile t + P while tile t computes (in registers)
):
    """dx = r · (dy·w − x̂·c) with c = mean(dy·w·x̂); this program's share of
    dw = Σ dy·x̂, accumulated per piece. Persistent: program p handles tiles p, p + P,
    p + 2P, ...; with PREFETCH the loads of the next tile are issued before the
    current one is reduced (a register double buffer, our own pipelining where
    Triton's `num_stages` would stage the loads through shared memory)."""
    stride_dy, stride_x, stride_dh = stride_dy * ALIGN, stride_x * ALIGN, stride_dh * ALIGN
    n_cols = n_cols * ALIGN
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, P0)
    w0 = tl.load(W + cols0, mask=cols0 < n_cols, other=0.0).to(tl.float32)  # (P0,)
    dw0 = tl.zeros((ROWS, P0), dtype=tl.float32)  # rows summed once, at the end
    if P1 > 0:
        cols1 = P0 + tl.arange(0, P1)
        w1 = tl.load(W + cols1, mask=cols1 < n_cols, other=0.0).to(tl.float32)
        dw1 = tl.zeros((ROWS, P1), dtype=tl.float32)
    if P2 > 0:
        cols2 = P0 + P1 + tl.arange(0, P2)
        w2 = tl.load(W + cols2, mask=cols2 < n_cols, other=0.0).to(tl.float32)
        dw2 = tl.zeros((ROWS, P2), dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, ROWS)
    if PREFETCH:  # this program's first tile, loaded ahead of the loop
        rstd_n, x0_n, dy0_n, x1_n, dy1_n, x2_n, dy2_n = _rms_norm_load_tile(
            DY, X, RSTD, pid, n_rows, stride_dy, stride_x, n_cols, ROWS, P0, P1, P2)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows, row_ok = _row_tile(tile, n_rows, ROWS)
        if PREFETCH:
            # take the tile loaded last iteration and issue the next one's loads now,
            # so they are in flight while this tile is reduced and stored
            rstd, x0, dy0, x1, dy1, x2, dy2 = rstd_n, x0_n, dy0_n, x1_n, dy1_n, x2_n, dy2_n
            rstd_n, x0_n, dy0_n, x1_n, dy1_n, x2_n, dy2_n = _rms_norm_load_tile(
                DY, X, RSTD, tile + n_programs, n_rows, stride_dy, stride_x, n_cols, ROWS,
                P0, P1, P2)
        else:
            rstd, x0, dy0, x1, dy1, x2, dy2 = _rms_norm_load_tile(
                DY, X, RSTD, tile, n_rows, stride_dy, stride_x, n_cols, ROWS, P0, P1, P2)
        xh0, dy0, c = _rms_norm_backward_piece(x0, dy0, w0, rstd)
        if P1 > 0:
            xh1, dy1, c1 = _rms_norm_backward_piece(x1, dy1, w1, rstd)
            c += c1
        if P2 > 0:
            xh2, dy2, c2 = _rms_norm_backward_piece(x2, dy2, w2, rstd)
            c += c2
        c = c / n_cols  # (ROWS,) mean(dy·w·x̂)
        _rms_norm_dx_piece(DX, DH_IN, xh0, dy0, w0, rstd, c, rows, row_ok, stride_dh,
                           n_cols, 0, P0, HAS_DH_IN)
        dw0 += dy0 * xh0
        if P1 > 0:
            _rms_norm_dx_piece(DX, DH_IN, xh1, dy1, w1, rstd, c, rows, row_ok, stride_dh,
                               n_cols, P0, P1, HAS_DH_IN)
            dw1 += dy1 * xh1
        if P2 > 0:
            _rms_norm_dx_piece(DX, DH_IN, xh2, dy2, w2, rstd, c, rows, row_ok, stride_dh,
                               n_cols, P0 + P1, P2, HAS_DH_IN)
            dw2 += dy2 * xh2
    tl.store(DW_PARTIAL + pid * n_cols + cols0, tl.sum(dw0, axis=0), mask=cols0 < n_cols)
    if P1 > 0:
        tl.store(DW_PARTIAL + pid * n_cols + cols1, tl.sum(dw1, axis=0), mask=cols1 < n_cols)
    if P2 > 0:
        tl.store(DW_PARTIAL + pid * n_cols + cols2, tl.sum(dw2, axis=0), mask=cols2 < n_cols)


# ----------------------------------------------------------------------------- launchers


@functools.lru_cache(maxsize=4096)
def _forward_plan(n_rows, n_cols, stride_x, stride_res, has_residual, dtypes, aligned,
                  config):
    """Grid, integer arguments, constexprs, warps and launch key of one forward shape.
    Worked out once per shape, strides, dtypes (x, residual, w, y) and pointer
    alignments (x, residual, w), not per call: at small shapes an eager call is host
    time, most of it Python (`kernels.launch`)."""
    cfg = config or launch_config(n_cols, dtypes[0],
                                  small=n_rows <= SMALL_ROWS and not has_residual)
    a = alignment(n_cols, stride_x, stride_res)
    ints = (stride_x // a, stride_res // a, n_rows, n_cols // a)
    constexprs = dict(HAS_RESIDUAL=has_residual, ALIGN=a, ROWS=cfg.rows,
                      P0=cfg.pieces[0], P1=cfg.pieces[1], P2=cfg.pieces[2])
    key = plan_key(dtypes, aligned, ints, constexprs, cfg.num_warps)
    return (cdiv(n_rows, cfg.rows),), ints, constexprs, cfg.num_warps, key


def _forward(x2d, residual2d, w, eps, config, on_launch=None):
    n_rows, n_cols = x2d.shape
    dtype = x2d.dtype  # of y and h: torch's promotion of x and residual, as for x + res
    if residual2d is not None:
        dtype = torch.result_type(x2d, residual2d)
    y = x2d.new_empty((n_rows, n_cols), dtype=dtype)
    h = torch.empty_like(y) if residual2d is not None else None
    rstd = x2d.new_empty(n_rows, dtype=torch.float32)
    if n_rows:
        res = residual2d if residual2d is not None else x2d
        grid, ints, constexprs, warps, key = _forward_plan(
            n_rows, n_cols, x2d.stride(0), res.stride(0), residual2d is not None,
            (x2d.dtype, res.dtype, w.dtype, dtype),
            (x2d.data_ptr() % 16 == 0, res.data_ptr() % 16 == 0, w.data_ptr() % 16 == 0),
            config)
        args = (x2d, res, w, y, h if h is not None else y, rstd, *ints, eps)
        launch(_rms_norm_forward_kernel, grid, args, constexprs, num_warps=warps, key=key)
        if on_launch is not None:
            on_launch(_rms_norm_forward_kernel, grid, args, key)
    return y, h, rstd


def rms_norm_forward(x2d: torch.Tensor, w: torch.Tensor, eps: float, *,
                     config: LaunchConfig | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of x2d.

    Args:
        x2d: (rows, H), unit column stride, fp32/fp16/bf16.
        w: (H,) contiguous, any float dtype (fp32 under autocast).
        eps: added to mean(x²).
        config: tiling override (tuning); default from `launch_config(H)`.
    Returns:
        y (rows, H) in x2d's dtype, rstd (rows,) fp32.
    """
    y, _, rstd = _forward(x2d, None, w, eps, config)
    return y, rstd


def add_rms_norm_forward(x2d: torch.Tensor, residual2d: torch.Tensor, w: torch.Tensor,
                         eps: float, *, config: LaunchConfig | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + residual, y = RMSNorm(h) in one pass. x2d, residual2d: (rows, H), unit
    column stride. Returns y, h (rows, H) in the promoted dtype of x and residual (that
    of `x + residual`) and rstd (rows,) fp32."""
    return _forward(x2d, residual2d, w, eps, config)


@functools.lru_cache(maxsize=4096)
def _backward_plan(n_rows, n_cols, strides, has_dh_in, dtypes, aligned, device, config,
                   programs_per_sm, num_stages, min_rows, prefetch):
    """Persistent grid, integer arguments, constexprs, warps and launch key of one
    backward shape (strides of dy, x, dh_in; dtypes of dy, x, w, dh_in; alignments of
    their pointers and rstd's): worked out once per shape, as `_forward_plan`."""
    cfg = config or launch_config(n_cols, dtypes[1], backward=True,
                                  small=n_rows <= SMALL_ROWS and not has_dh_in)
    programs = persistent_programs(n_rows, cfg.rows, cfg.num_warps, device,
                                   programs_per_sm or cfg.programs_per_sm,
                                   min_rows or cfg.min_rows_per_program)
    if prefetch is None:
        prefetch = DEFAULTS.bwd_prefetch if cfg.prefetch is None else cfg.prefetch
    a = alignment(n_cols, *strides)
    ints = (*(s // a for s in strides), n_rows, n_cols // a)
    constexprs = dict(HAS_DH_IN=has_dh_in, ALIGN=a, ROWS=cfg.rows, P0=cfg.pieces[0],
                      P1=cfg.pieces[1], P2=cfg.pieces[2],
                      NUM_STAGES=num_stages or cfg.num_stages or DEFAULTS.bwd_stages,
                      PREFETCH=prefetch)
    key = plan_key(dtypes, aligned, ints, constexprs, cfg.num_warps)
    return programs, ints, constexprs, cfg.num_warps, key


def _backward(dy2d, x2d, w, rstd, dh_in2d, config, programs_per_sm, num_stages,
              min_rows=None, prefetch=None, on_launch=None):
    n_rows, n_cols = x2d.shape
    dx = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return dx, torch.zeros_like(w)
    dh = dh_in2d if dh_in2d is not None else dy2d
    programs, ints, constexprs, warps, key = _backward_plan(
        n_rows, n_cols, (dy2d.stride(0), x2d.stride(0), dh.stride(0)), dh_in2d is not None,
        (dy2d.dtype, x2d.dtype, w.dtype, dh.dtype),
        tuple(t.data_ptr() % 16 == 0 for t in (dy2d, x2d, w, rstd, dh)), x2d.device,
        config, programs_per_sm, num_stages, min_rows, prefetch)
    dw_partial = x2d.new_empty((1, programs, n_cols), dtype=torch.float32)  # (1, P, H)
    args = (dy2d, x2d, w, rstd, dh, dx, dw_partial, *ints)
    launch(_rms_norm_backward_kernel, (programs,), args, constexprs, num_warps=warps,
           key=key)
    if on_launch is not None:
        on_launch(_rms_norm_backward_kernel, (programs,), args, key)
    (dw,) = sum_partials(dw_partial, w, on_launch=on_launch)  # (H,) in w's dtype
    return dx, dw


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      rstd: torch.Tensor, *, config: LaunchConfig | None = None,
                      programs_per_sm: int | None = None, num_stages: int | None = None,
                      min_rows: int | None = None, prefetch: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `rms_norm_forward`.

    Args:
        dy, x: (rows, H), unit column stride; x as given to the forward.
        w: (H,) weight; rstd: (rows,) fp32 from the forward.
        config, programs_per_sm, num_stages, min_rows, prefetch: tuning overrides
            (`persistent_programs`, `LaunchConfig`).
    Returns:
        dx (rows, H) in x's dtype, dw (H,) in w's dtype (reduced in fp32).
    """
    return _backward(dy, x, w, rstd, None, config, programs_per_sm, num_stages, min_rows,
                     prefetch)


def add_rms_norm_backward(dy: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor,
                          rstd: torch.Tensor, dh_in: torch.Tensor | None = None, *,
                          config: LaunchConfig | None = None,
                          programs_per_sm: int | None = None,
                          num_stages: int | None = None
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `add_rms_norm_forward`: dh_total = dh_from_norm + dh_in, which is
    both dx and dresidual, and dw. `dy` None (y unused) gives (dh_in, None)."""
    if dy is None:
        return dh_in, None
    return _backward(dy, h, w, rstd, dh_in, config, programs_per_sm, num_stages)


# ------------------------------------------------------------------------------ autograd


class TritonRMSNormFunction(torch.autograd.Function):
    """y = RMSNorm(x) · w over the last dimension; saves x, w and rstd (fp32). With
    `kernels.native` on, also registers its launches for the C++ path of this shape."""

    @staticmethod
    def forward(ctx, x, w, eps):
        check_input(x)
        n_cols = x.shape[-1]
        w_c = check_param(w, n_cols, x, "weight")
        x2d = as_rows(x, n_cols)  # (rows, H)
        hook = _native_hook(x2d, w_c) if x.is_contiguous() else None
        y, _, rstd = _forward(x2d, None, w_c, eps, None, hook)
        ctx.save_for_backward(x2d, w_c, rstd)
        ctx.shape = x.shape
        ctx.native = hook is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, w, rstd = ctx.saved_tensors
        dy2d = as_rows(dy, x2d.shape[1])
        hook = None
        if ctx.native and dy2d.is_contiguous() and dy2d.data_ptr() % 16 == 0:
            # what the C++ backward will hand its kernels (the forward decided: the
            # backward may run outside the block that chose the path)
            hook = _native_hook(x2d, w, decided=True)
        dx, dw = _backward(dy2d, x2d, w, rstd, None, None, None, None, on_launch=hook)
        return dx.view(ctx.shape), dw if ctx.needs_input_grad[1] else None, None


_NATIVE_SLOTS = {_rms_norm_forward_kernel: ("forward", (0, 0, 1, 2, 2, 3)),
                 _rms_norm_backward_kernel: ("backward", (0, 1, 2, 3, 0, 4, 5)),
                 _rms_norm_partials_sum_kernel: ("sum", (5, 6, 6))}
"""Per kernel: which launch of the C++ plan it is, and for each of its tensor arguments,
in order, that tensor's index in `native.FORWARD_SLOTS` / `BACKWARD_SLOTS` (the
forward's residual and h are x and y when there is no residual)."""


def _native_hook(x2d, w, decided: bool = False):
    """The `on_launch` that registers each launch with `kernels.native` (None when the
    native path is off, unless the forward already `decided` to register)."""
    if torch.compiler.is_compiling() or not x2d.is_cuda or not (decided or native.requested()):
        return None

    def hook(kernel, grid, args, key):
        which, where = _NATIVE_SLOTS[kernel]
        programs = grid[0] if which == "backward" else 0
        native.register_launch(which, x2d, w, runner_for(kernel, key), grid, args, where,
                               programs)

    return hook


class TritonAddRMSNormFunction(torch.autograd.Function):
    """(y, h) with h = x + residual, y = RMSNorm(h) · w; saves h, w and rstd."""

    @staticmethod
    def forward(ctx, x, residual, w, eps):
        check_input(x)
        check_input(residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must have x's shape "
                             f"{tuple(x.shape)} (no broadcasting); use the unfused "
                             "add_rms_norm")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")
        n_cols = x.shape[-1]
        w_c = check_param(w, n_cols, x, "weight")
        y, h, rstd = add_rms_norm_forward(as_rows(x, n_cols), as_rows(residual, n_cols),
                                          w_c, eps)
        ctx.save_for_backward(h, w_c, rstd)
        ctx.shape = x.shape
        ctx.set_materialize_grads(False)  # h unused downstream: no zero tensor made
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh):
        h, w, rstd = ctx.saved_tensors
        n_cols = h.shape[1]
        dy2d = as_rows(dy, n_cols) if dy is not None else None
        dh2d = as_rows(dh, n_cols) if dh is not None else None
        dh_total, dw = add_rms_norm_backward(dy2d, h, w, rstd, dh2d)
        if dh_total is not None:
            dh_total = dh_total.view(ctx.shape)
        dw = dw if ctx.needs_input_grad[2] else None
        # x and residual get the same tensor, as torch's own add does (autograd casts
        # it to the dtype of each, e.g. bf16 x with an fp32 residual stream).
        return dh_total, dh_total, dw, None


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused RMSNorm of x (..., H) with weight w (H,); output in x's dtype. Through the
    C++ path (`kernels.native`) when it is on and has a plan for this shape."""
    y = native.rms_norm(x, w, eps)
    return y if y is not None else TritonRMSNormFunction.apply(x, w, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                        eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual and y = RMSNorm(h) · w in one kernel; returns (y, h), both
    (..., H) in the dtype of `x + residual` (under autocast: bf16 x, fp32 residual
    stream, fp32 h). Gradients reach x and residual through h, from y and from any
    later use of h."""
    return TritonAddRMSNormFunction.apply(x, residual, w, eps)
