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

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import (
    DEFAULTS,
    LaunchConfig,
    _row_tile,
    _to_dtype,
    as_rows,
    cdiv,
    check_input,
    check_param,
    launch_config,
    persistent_programs,
    sum_partials,
)


@triton.jit
def _layer_norm_forward_kernel(
    X,  # (n_rows, n_cols) input x, row stride stride_x
    W,  # (n_cols,) weight, any float dtype (upcast)
    B,  # (n_cols,) bias (HAS_BIAS only)
    Y,  # (n_rows, n_cols) output y, x's dtype, contiguous
    MEAN,  # (n_rows,) fp32 output μ
    RSTD,  # (n_rows,) fp32 output r
    stride_x,  # elements between rows of X
    n_rows,  # rows
    n_cols,  # H
    eps,  # added to the variance
    HAS_BIAS: tl.constexpr,  # add b
    ROWS: tl.constexpr,  # rows per program
    BLOCK: tl.constexpr,  # next_power_of_2(n_cols)
):
    """y = (x − μ) · r · w + b for one tile of ROWS rows."""
    rows, row_ok = _row_tile(tl.program_id(0), n_rows, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # (ROWS, BLOCK)
    mean = tl.sum(x, axis=1) / n_cols  # (ROWS,) μ
    xc = tl.where(mask, x - mean[:, None], 0.0)  # padding must not enter the variance
    var = tl.sum(xc * xc, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)  # (ROWS,) r
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        y += b[None, :]
    y = _to_dtype(y, Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y, mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


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
    stride_dy,  # elements between rows of DY
    stride_x,  # elements between rows of X
    n_rows,  # rows
    n_cols,  # H
    HAS_BIAS: tl.constexpr,  # also reduce db
    ROWS: tl.constexpr,  # rows per tile
    BLOCK: tl.constexpr,  # next_power_of_2(n_cols)
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the row loop
):
    """dx = r · (wdy − (x̂·c1 + c2)); this program's share of dw = Σ dy·x̂ and
    db = Σ dy. Persistent: program p handles tiles p, p + P, p + 2P, ..."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK,)
    dw_acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    db_acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, ROWS)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows, row_ok = _row_tile(tile, n_rows, ROWS)
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)  # (ROWS,) μ
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,) r
        x_hat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dy = dy.to(tl.float32)
        wdy = dy * w[None, :]
        c1 = tl.sum(x_hat * wdy, axis=1) / n_cols  # (ROWS,) mean(x̂·wdy)
        c2 = tl.sum(wdy, axis=1) / n_cols  # (ROWS,) mean(wdy)
        dx = rstd[:, None] * (wdy - (x_hat * c1[:, None] + c2[:, None]))
        dx = _to_dtype(dx, DX.dtype.element_ty)
        tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx, mask=mask)
        dw_acc += dy * x_hat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_ok)


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
    cfg = config or launch_config(n_cols, x2d.dtype)
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows:
        _layer_norm_forward_kernel[(cdiv(n_rows, cfg.rows),)](
            x2d, w, b if b is not None else w, y, mean, rstd,
            x2d.stride(0), n_rows, n_cols, eps,
            HAS_BIAS=b is not None, ROWS=cfg.rows, BLOCK=cfg.block,
            num_warps=cfg.num_warps)
    return y, mean, rstd


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
    cfg = config or launch_config(n_cols, x.dtype, backward=True)
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, torch.zeros_like(w), None if b is None else torch.zeros_like(b)
    n_tiles = cdiv(n_rows, cfg.rows)
    programs = persistent_programs(n_tiles, cfg.num_warps, x.device,
                                   programs_per_sm or cfg.programs_per_sm)
    partials = torch.empty((2 if b is not None else 1, programs, n_cols),
                           dtype=torch.float32, device=x.device)
    _layer_norm_backward_kernel[(programs,)](
        dy, x, w, mean, rstd, dx, partials[0], partials[-1],
        dy.stride(0), x.stride(0), n_rows, n_cols,
        HAS_BIAS=b is not None, ROWS=cfg.rows, BLOCK=cfg.block,
        NUM_STAGES=num_stages or cfg.num_stages or DEFAULTS.bwd_stages,
        num_warps=cfg.num_warps)
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
