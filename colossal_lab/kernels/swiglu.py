"""SwiGLU activation in Triton, reading and writing the fused gate/up layout.

Math (Shazeer 2020), per element of gate g and up u, with s = σ(g) = 1 / (1 + e^(−g))::

    h        = silu(g) · u = g · s · u
    dsilu/dg = s · (1 + g · (1 − s))
    du       = dh · g · s
    dg       = dh · u · s · (1 + g · (1 − s))

The input is the fused projection's output gu = [g | u] of shape (T, 2i): row t holds
the gate in columns [0, i) and up in [i, 2i). The kernels index both halves of the same
row, so no split is materialised, and the backward writes dgu in the same fused layout:
the one (T, 2i) gradient the gate/up GEMM's backward needs. (Eager SwiGLU on views makes
separate dg and du, which autograd then concatenates: one more copy of 2·T·i.)

Bytes moved per element of h (T·i elements; e the element size)::

                      eager on views (swiglu_fused_ref)        fused (this file)
    forward           silu: 2 e, mul: 3 e            = 5 e     read g, u; write h  = 3 e
    backward          mul: 2 × 3 e, silu': 3 e,
                      concatenate dg, du: 4 e        = 13 e    read g, u, dh;
                                                               write dg, du        = 5 e
    saved for bwd     g, u and silu(g): 3 e                    g, u: 2 e

s and silu(g) are recomputed in the backward from the saved gu instead of stored: a
few FLOPs per element against 2 bytes each (Liger-Kernel's SiLUMul does the same).

Launch: a 2-D grid, rows × column blocks of BLOCK columns (ROWS rows per program when
i is small), 16-byte loads when i and the row stride are divisible by 8 (Triton
specialises integer arguments divisible by 16, which i = 11008 and 5632 are).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import _to_dtype, cdiv, next_power_of_2
from colossal_lab.kernels.launch import launch

MAX_BLOCK = 1024
"""Columns per program: 1024 bf16 = 2 KB per tensor, 8 elements per thread at 4 warps."""
TILE_ELEMS = 1024
"""Elements per program; narrow rows get TILE_ELEMS // BLOCK rows per program."""


@triton.jit
def _swiglu_forward_kernel(
    GU,  # (n_rows, 2·n_cols) input [gate | up], row stride stride_gu, unit column stride
    H,  # (n_rows, n_cols) output silu(gate) · up, contiguous
    stride_gu,  # elements between rows of GU
    n_rows,  # T
    n_cols,  # i, the width of each half
    ROWS: tl.constexpr,  # rows per program
    BLOCK: tl.constexpr,  # columns per program
):
    """h = silu(g) · u for one (ROWS, BLOCK) tile, computed in fp32."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: no overflow
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    gate_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))  # σ(g); exp overflows to inf for g < -88: s = 0
    h = g * s * u
    tl.store(H + rows[:, None] * n_cols + cols[None, :], _to_dtype(h, H.dtype.element_ty),
             mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    DH,  # (n_rows, n_cols) gradient of h, row stride stride_dh, unit column stride
    GU,  # (n_rows, 2·n_cols) the forward's input [gate | up], row stride stride_gu
    DGU,  # (n_rows, 2·n_cols) output [dgate | dup], contiguous
    stride_dh,  # elements between rows of DH
    stride_gu,  # elements between rows of GU
    n_rows,  # T
    n_cols,  # i
    ROWS: tl.constexpr,  # rows per program
    BLOCK: tl.constexpr,  # columns per program
):
    """dg = dh · u · s · (1 + g(1 − s)), du = dh · g · s, with s = σ(g) recomputed."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    gate_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))  # σ(g); exp overflows to inf for g < -88: s = 0
    silu = g * s
    dsilu = s * (1.0 + g * (1.0 - s))  # d silu(g) / dg
    dg = dh * u * dsilu
    du = dh * silu
    dgate_ptrs = DGU + rows[:, None] * (2 * n_cols) + cols[None, :]
    tl.store(dgate_ptrs, _to_dtype(dg, DGU.dtype.element_ty), mask=mask)
    tl.store(dgate_ptrs + n_cols, _to_dtype(du, DGU.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


@functools.cache
def _tiling(n_cols: int) -> tuple[int, int, int]:
    block = min(MAX_BLOCK, next_power_of_2(max(n_cols, 1)))
    rows = max(1, TILE_ELEMS // block)
    return block, rows, 4


def _grid(n_rows: int, n_cols: int, rows: int, block: int) -> tuple[int, int]:
    return cdiv(n_rows, rows), cdiv(n_cols, block)  # plain Python: see _norm_common.cdiv


def _rows_of(t: torch.Tensor, width: int) -> torch.Tensor:
    """(..., width) -> (rows, width) with unit column stride (copies only if needed)."""
    t2d = t.reshape(-1, width)
    if t2d.stride(-1) != 1 and t2d.numel() > 0:
        t2d = t2d.contiguous()
    return t2d


def _check(gu: torch.Tensor) -> int:
    if gu.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"SwiGLU takes float32, float16 or bfloat16; got {gu.dtype}")
    if gu.dim() == 0 or gu.shape[-1] % 2:
        raise ValueError(f"gate_up {tuple(gu.shape)} must end in an even dimension "
                         "[gate | up]")
    return gu.shape[-1] // 2


def swiglu_forward(gu2d: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of each row.

    Args:
        gu2d: (T, 2i) [gate | up], unit column stride, any row stride.
    Returns:
        h (T, i), contiguous, in gu2d's dtype.
    """
    n_rows, n_cols = gu2d.shape[0], gu2d.shape[1] // 2
    h = torch.empty((n_rows, n_cols), dtype=gu2d.dtype, device=gu2d.device)
    if h.numel():
        block, rows, warps = _tiling(n_cols)
        launch(_swiglu_forward_kernel, _grid(n_rows, n_cols, rows, block),
               (gu2d, h, gu2d.stride(0), n_rows, n_cols), dict(ROWS=rows, BLOCK=block),
               num_warps=warps)
    return h


def swiglu_backward(dh2d: torch.Tensor, gu2d: torch.Tensor) -> torch.Tensor:
    """Gradient of `swiglu_forward`.

    Args:
        dh2d: (T, i) gradient of h, unit column stride.
        gu2d: (T, 2i) the forward's input.
    Returns:
        dgu (T, 2i) = [dgate | dup], contiguous, in gu2d's dtype.
    """
    n_rows, n_cols = dh2d.shape
    dgu = torch.empty((n_rows, 2 * n_cols), dtype=gu2d.dtype, device=gu2d.device)
    if dgu.numel():
        block, rows, warps = _tiling(n_cols)
        launch(_swiglu_backward_kernel, _grid(n_rows, n_cols, rows, block),
               (dh2d, gu2d, dgu, dh2d.stride(0), gu2d.stride(0), n_rows, n_cols),
               dict(ROWS=rows, BLOCK=block), num_warps=warps)
    return dgu


# ------------------------------------------------------------------------------ autograd


class TritonSwiGLUFunction(torch.autograd.Function):
    """h = silu(gate) · up from the fused [gate | up]; saves only the input."""

    @staticmethod
    def forward(ctx, gate_up):
        n_cols = _check(gate_up)
        gu2d = _rows_of(gate_up, 2 * n_cols)  # (T, 2i)
        h = swiglu_forward(gu2d)
        ctx.save_for_backward(gu2d)
        ctx.shape = gate_up.shape
        return h.view(*gate_up.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, dh):
        (gu2d,) = ctx.saved_tensors
        dgu = swiglu_backward(_rows_of(dh, gu2d.shape[1] // 2), gu2d)
        return dgu.view(ctx.shape)


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of gate_up (..., 2i) = [gate | up]; returns (..., i) in its dtype.
    The gradient is one (..., 2i) tensor in the same layout."""
    return TritonSwiGLUFunction.apply(gate_up)
