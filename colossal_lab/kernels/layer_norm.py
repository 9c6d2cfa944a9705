"""Fused LayerNorm in Triton.

Math (per row x of length H; Ba, Kiros & Hinton, "Layer Normalization", 2016)::

    μ  = mean(x)                          saved (fp32) as `mean`
    r  = (mean((x − μ)²) + eps)^(-1/2)    biased variance; saved (fp32) as `rstd`
    x̂  = (x − μ) · r
    y  = x̂ · w + b

Backward (the derivation of the Triton tutorial `05-layer-norm`): with wdy = dy·w,
c1 = mean(x̂ · wdy) and c2 = mean(wdy), one scalar each per row::

    dx = r · (wdy − (x̂ · c1 + c2))
    dw = Σ_rows dy · x̂
    db = Σ_rows dy

Bytes per element of x, bf16 (N = rows·H): eager `layer_norm_ref` (fp32 statistics,
cast back) moves 52 N forward in 11 kernels and 122 N backward in 21 (counted by
`benchmarks.fused_norm.traffic_bytes`); fused: 4 N forward (read x, write y) and 6 N
backward (read x, dy; write dx), plus O(H + rows) for w, b, mean, rstd and the
partials. The layout is the one of `rms_norm.py`; shared helpers are in `_norm_common`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import (
    DEFAULTS,
    LaunchConfig,
    _piece,
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
from colossal_lab.kernels.launch import launch, plan_key


@triton.jit
def _layer_norm_load_piece(X, rows, row_ok, stride_x, n_cols, OFF: tl.constexpr,
                           P: tl.constexpr):
    """x (fp32) of columns OFF .. OFF + P - 1 of the tile, and their row sums."""
    cols, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    return x, tl.sum(x, axis=1)


@triton.jit
def _layer_norm_center_piece(x, mean, rows, row_ok, n_cols, OFF: tl.constexpr,
                             P: tl.constexpr):
    """x − μ, zero in the padding (which must not enter the variance), and Σ (x − μ)²."""
    _, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    xc = tl.where(mask, x - mean[:, None], 0.0)
    return xc, tl.sum(xc * xc, axis=1)


@triton.jit
def _layer_norm_store_piece(Y, W, B, xc, rstd, rows, row_ok, n_cols, OFF: tl.constexpr,
                            P: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = (x − μ) · r · w + b for columns OFF .. OFF + P - 1."""
    cols, col_ok, mask = _piece(rows, row_ok, n_cols, OFF, P)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        y += b[None, :]
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], _to_dtype(y, Y.dtype.element_ty),
             mask=mask)


@triton.jit
def _layer_norm_forward_kernel(
    X,  # (n_rows, n_cols) input x, row stride stride_x
    W,  # (n_cols,) weight, any float dtype (upcast)
    B,  # (n_cols,) bias (HAS_BIAS only)
    Y,  # (n_rows, n_cols) output y, x's dtype, contiguous
    MEAN,  # (n_rows,) fp32 output μ
    RSTD,  # (n_rows,) fp32 output r
    stride_x,  # elements between rows of X, / ALIGN
    n_rows,  # rows
    n_cols,  # H, / ALIGN
    eps,  # added to the variance
    HAS_BIAS: tl.constexpr,  # add b
    ALIGN: tl.constexpr,  # power of two dividing H and the row stride (`alignment`)
    ROWS: tl.constexpr,  # rows per program
    P0: tl.constexpr,  # the row's power-of-two pieces (`row_pieces`); P1, P2 may be 0
    P1: tl.constexpr,
    P2: tl.constexpr,
):
    """y = (x − μ) · r · w + b for one tile of ROWS rows, held as up to three pieces."""
    stride_x, n_cols = stride_x * ALIGN, n_cols * ALIGN
    rows, row_ok = _row_tile(tl.program_id(0), n_rows, ROWS)
    x0, total = _layer_norm_load_piece(X, rows, row_ok, stride_x, n_cols, 0, P0)
    if P1 > 0:
        x1, s1 = _layer_norm_load_piece(X, rows, row_ok, stride_x, n_cols, P0, P1)
        total += s1
    if P2 > 0:
        x2, s2 = _layer_norm_load_piece(X, rows, row_ok, stride_x, n_cols, P0 + P1, P2)
        total += s2
    mean = total / n_cols  # (ROWS,) μ
    xc0, var = _layer_norm_center_piece(x0, mean, rows, row_ok, n_cols, 0, P0)
    if P1 > 0:
        xc1, v1 = _layer_norm_center_piece(x1, mean, rows, row_ok, n_cols, P0, P1)
        var += v1
    if P2 > 0:
        xc2, v2 = _layer_norm_center_piece(x2, mean, rows, row_ok, n_cols, P0 + P1, P2)
        var += v2
    rstd = tl.rsqrt(var / n_cols + eps)  # (ROWS,) r
    _layer_norm_store_piece(Y, W, B, xc0, rstd, rows, row_ok, n_cols, 0, P0, HAS_BIAS)
    if P1 > 0:
        _layer_norm_store_piece(Y, W, B, xc1, rstd, rows, row_ok, n_cols, P0, P1, HAS_BIAS)
    if P2 > 0:
        _layer_norm_store_piece(Y, W, B, xc2, rstd, rows, row_ok, n_cols, P0 + P1, P2,
                                HAS_BIAS)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_backward_piece(DY, X, w, mean, rstd, rows, row_ok, stride_dy, stride_x,
                               n_cols, OFF: tl.constexpr, P: tl.constexpr):
    """x̂, dy (fp32) and dy·w of columns OFF .. OFF + P - 1 (x̂ zero in the padding),
    and their shares of Σ x̂·wdy and Σ wdy per row."""
    cols, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    x_hat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
    dy = dy.to(tl.float32)
    wdy = dy * w[None, :]
    return x_hat, dy, wdy, tl.sum(x_hat * wdy, axis=1), tl.sum(wdy, axis=1)


@triton.jit
def _layer_norm_dx_piece(DX, x_hat, wdy, rstd, c1, c2, rows, row_ok, n_cols,
                         OFF: tl.constexpr, P: tl.constexpr):
    """dx = r · (wdy − (x̂·c1 + c2)) for columns OFF .. OFF + P - 1, stored."""
    cols, _, mask = _piece(rows, row_ok, n_cols, OFF, P)
    dx = rstd[:, None] * (wdy - (x_hat * c1[:, None] + c2[:, None]))
    tl.store(DX + rows[:, None] * n_cols + cols[None, :], _to_dtype(dx, DX.dtype.element_ty),
             mask=mask)


@triton.jit
def _layer_norm_store_partials(DW_PARTIAL, DB_PARTIAL, pid, n_cols, cols, dw, db,
                               HAS_BIAS: tl.constexpr):
    """This program's Σ dy·x̂ (and Σ dy) over its rows, for the columns `cols`."""
    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw, axis=0), mask=cols < n_cols)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * n_cols + cols, tl.sum(db, axis=0), mask=cols < n_cols)


@triton.jit
def _layer_norm_backward_kernel(
    DY,  # (n_rows, n_cols) gradient of y, row stride stride_dy
    X,  # (n_rows, n_cols) input x, row stride stride_x
    W,  # (n_cols,) weight
    MEAN,  # (n_rows,) fp32 μ from the forward
    RSTD,  # (n_rows,) fp32 r from the forward
    DX,  # (n_rows, n_cols) output dx, contiguous
    DW_PARTIAL,  # (n_programs, n_cols) fp32 output: this program's Σ dy·x̂
    DB_PARTIAL,  # (n_programs, n_cols) fp32 output: this program's Σ dy (HAS_BIAS)
    stride_dy,  # elements between rows of DY, / ALIGN
    stride_x,  # elements between rows of X, / ALIGN
    n_rows,  # rows
    n_cols,  # H, / ALIGN
    HAS_BIAS: tl.constexpr,  # also reduce db
    ALIGN: tl.constexpr,  # power of two dividing H and the row strides (`alignment`)
    ROWS: tl.constexpr,  # rows per tile
    P0: tl.constexpr,  # the row's power-of-two pieces (`row_pieces`); P1, P2 may be 0
    P1: tl.constexpr,
    P2: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the row loop
):
    """dx = r · (wdy − (x̂·c1 + c2)); this program's share of dw = Σ dy·x̂ and
    db = Σ dy, per piece. Persistent: program p handles tiles p, p + P, p + 2P, ..."""
    stride_dy, stride_x, n_cols = stride_dy * ALIGN, stride_x * ALIGN, n_cols * ALIGN
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, P0)
    w0 = tl.load(W + cols0, mask=cols0 < n_cols, other=0.0).to(tl.float32)
    dw0 = tl.zeros((ROWS, P0), dtype=tl.float32)
    db0 = tl.zeros((ROWS, P0), dtype=tl.float32)
    if P1 > 0:
        cols1 = P0 + tl.arange(0, P1)
        w1 = tl.load(W + cols1, mask=cols1 < n_cols, other=0.0).to(tl.float32)
        dw1 = tl.zeros((ROWS, P1), dtype=tl.float32)
        db1 = tl.zeros((ROWS, P1), dtype=tl.float32)
    if P2 > 0:
        cols2 = P0 + P1 + tl.arange(0, P2)
        w2 = tl.load(W + cols2, mask=cols2 < n_cols, other=0.0).to(tl.float32)
        dw2 = tl.zeros((ROWS, P2), dtype=tl.float32)
        db2 = tl.zeros((ROWS, P2), dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, ROWS)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows, row_ok = _row_tile(tile, n_rows, ROWS)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)  # (ROWS,) μ
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,) r
        xh0, dy0, wdy0, c1, c2 = _layer_norm_backward_piece(
            DY, X, w0, mean, rstd, rows, row_ok, stride_dy, stride_x, n_cols, 0, P0)
        if P1 > 0:
            xh1, dy1, wdy1, s1, t1 = _layer_norm_backward_piece(
                DY, X, w1, mean, rstd, rows, row_ok, stride_dy, stride_x, n_cols, P0, P1)
            c1 += s1
            c2 += t1
        if P2 > 0:
            xh2, dy2, wdy2, s2, t2 = _layer_norm_backward_piece(
                DY, X, w2, mean, rstd, rows, row_ok, stride_dy, stride_x, n_cols,
                P0 + P1, P2)
            c1 += s2
            c2 += t2
        c1 = c1 / n_cols  # (ROWS,) mean(x̂·wdy)
        c2 = c2 / n_cols  # (ROWS,) mean(wdy)
        _layer_norm_dx_piece(DX, xh0, wdy0, rstd, c1, c2, rows, row_ok, n_cols, 0, P0)
        dw0 += dy0 * xh0
        if HAS_BIAS:
            db0 += dy0
        if P1 > 0:
            _layer_norm_dx_piece(DX, xh1, wdy1, rstd, c1, c2, rows, row_ok, n_cols, P0, P1)
            dw1 += dy1 * xh1
            if HAS_BIAS:
                db1 += dy1
        if P2 > 0:
            _layer_norm_dx_piece(DX, xh2, wdy2, rstd, c1, c2, rows, row_ok, n_cols,
                                 P0 + P1, P2)
            dw2 += dy2 * xh2
            if HAS_BIAS:
                db2 += dy2
    _layer_norm_store_partials(DW_PARTIAL, DB_PARTIAL, pid, n_cols, cols0, dw0, db0, HAS_BIAS)
    if P1 > 0:
        _layer_norm_store_partials(DW_PARTIAL, DB_PARTIAL, pid, n_cols, cols1, dw1, db1,
                                   HAS_BIAS)
    if P2 > 0:
        _layer_norm_store_partials(DW_PARTIAL, DB_PARTIAL, pid, n_cols, cols2, dw2, db2,
                                   HAS_BIAS)


# ----------------------------------------------------------------------------- launchers


def layer_norm_forward(x2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       eps: float, *, config: LaunchConfig | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm of each row of x2d.

    Args:
        x2d: (rows, H), unit column stride, fp32/fp16/bf16.
        w: (H,) weight; b: (H,) bias or None; contiguous, any float dtype.
        eps: added to the variance.
        config: tiling override (tuning); default from `launch_config(H)`.
    Returns:
        y (rows, H) in x2d's dtype, mean and rstd (rows,) fp32.
    """
    n_rows, n_cols = x2d.shape
    y = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    mean = x2d.new_empty(n_rows, dtype=torch.float32)
    rstd = x2d.new_empty(n_rows, dtype=torch.float32)
    if n_rows:
        bias = b if b is not None else w
        grid, ints, constexprs, warps, key = _forward_plan(
            n_rows, n_cols, x2d.stride(0), b is not None, (x2d.dtype, w.dtype, bias.dtype),
            (x2d.data_ptr() % 16 == 0, w.data_ptr() % 16 == 0, bias.data_ptr() % 16 == 0),
            config)
        launch(_layer_norm_forward_kernel, grid, (x2d, w, bias, y, mean, rstd, *ints, eps),
               constexprs, num_warps=warps, key=key)
    return y, mean, rstd


@functools.lru_cache(maxsize=4096)
def _forward_plan(n_rows, n_cols, stride_x, has_bias, dtypes, aligned, config):
    """Grid, integer arguments, constexprs, warps and launch key of one forward shape,
    worked out once per shape, strides, dtypes and pointer alignments (as RMSNorm's,
    `rms_norm._forward_plan`)."""
    cfg = config or launch_config(n_cols, dtypes[0])
    a = alignment(n_cols, stride_x)
    ints = (stride_x // a, n_rows, n_cols // a)
    constexprs = dict(HAS_BIAS=has_bias, ALIGN=a, ROWS=cfg.rows, P0=cfg.pieces[0],
                      P1=cfg.pieces[1], P2=cfg.pieces[2])
    key = plan_key(dtypes, aligned, ints, constexprs, cfg.num_warps)
    return (cdiv(n_rows, cfg.rows),), ints, constexprs, cfg.num_warps, key


@functools.lru_cache(maxsize=4096)
def _backward_plan(n_rows, n_cols, strides, has_bias, dtypes, aligned, device, config,
                   programs_per_sm, num_stages):
    """Persistent grid, integer arguments, constexprs, warps and launch key of one
    backward shape (strides and dtypes of dy and x, w's dtype, pointer alignments),
    worked out once per shape."""
    cfg = config or launch_config(n_cols, dtypes[1], backward=True)
    programs = persistent_programs(n_rows, cfg.rows, cfg.num_warps, device,
                                   programs_per_sm or cfg.programs_per_sm,
                                   cfg.min_rows_per_program)
    a = alignment(n_cols, *strides)
    ints = (*(s // a for s in strides), n_rows, n_cols // a)
    constexprs = dict(HAS_BIAS=has_bias, ALIGN=a, ROWS=cfg.rows, P0=cfg.pieces[0],
                      P1=cfg.pieces[1], P2=cfg.pieces[2],
                      NUM_STAGES=num_stages or cfg.num_stages or DEFAULTS.bwd_stages)
    # the dbias partials start programs x H floats into the buffer: 16-byte aligned or
    # not, and Triton specialises on that
    db_aligned = not has_bias or programs * n_cols % 4 == 0
    key = plan_key(dtypes, (*aligned, db_aligned), ints, constexprs, cfg.num_warps)
    return programs, ints, constexprs, cfg.num_warps, key


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        b: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, *,
                        config: LaunchConfig | None = None,
                        programs_per_sm: int | None = None, num_stages: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of `layer_norm_forward`.

    Args:
        dy, x: (rows, H), unit column stride. w, b: as in the forward (b only says
            whether db is wanted). mean, rstd: (rows,) fp32 from the forward.
        config, programs_per_sm, num_stages: tuning overrides.
    Returns:
        dx (rows, H) in x's dtype; dw (H,) in w's dtype; db (H,) in b's dtype, or None.
    """
    n_rows, n_cols = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return dx, torch.zeros_like(w), None if b is None else torch.zeros_like(b)
    programs, ints, constexprs, warps, key = _backward_plan(
        n_rows, n_cols, (dy.stride(0), x.stride(0)), b is not None,
        (dy.dtype, x.dtype, w.dtype),
        tuple(t.data_ptr() % 16 == 0 for t in (dy, x, w, mean, rstd)), x.device, config,
        programs_per_sm, num_stages)
    partials = x.new_empty((2 if b is not None else 1, programs, n_cols),
                           dtype=torch.float32)
    launch(_layer_norm_backward_kernel, (programs,),
           (dy, x, w, mean, rstd, dx, partials[0], partials[-1], *ints), constexprs,
           num_warps=warps, key=key)
    # dw and db, each in its parameter's dtype, in one launch
    sums = sum_partials(partials, w, *([b] if b is not None else []))
    return dx, sums[0], sums[1] if b is not None else None


# ------------------------------------------------------------------------------ autograd


class TritonLayerNormFunction(torch.autograd.Function):
    """y = LayerNorm(x) · w + b over the last dimension; saves x, w, mean and rstd."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        check_input(x)
        n_cols = x.shape[-1]
        w_c = check_param(w, n_cols, x, "weight")
        b_c = check_param(b, n_cols, x, "bias")
        x2d = as_rows(x, n_cols)  # (rows, H)
        y, mean, rstd = layer_norm_forward(x2d, w_c, b_c, eps)
        ctx.save_for_backward(x2d, w_c, b_c, mean, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, w, b, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(as_rows(dy, x2d.shape[1]), x2d, w, b, mean, rstd)
        return (dx.view(ctx.shape), dw if ctx.needs_input_grad[1] else None,
                db if ctx.needs_input_grad[2] else None, None)


def layer_norm_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                      eps: float = 1e-5) -> torch.Tensor:
    """Fused LayerNorm of x (..., H) with weight w (H,) and optional bias b (H,);
    output in x's dtype."""
    return TritonLayerNormFunction.apply(x, w, b, eps)
