"""The token embedding's backward in Triton: one sorted segment sum per vocabulary row.

The forward of an embedding is a gather, y[t] = W[ids[t]]; its gradient is the
scatter-add back, dW[v] = Σ_{t: ids[t] = v} dy[t], and zero for every row no token
used. PyTorch's CUDA `embedding_dense_backward` sorts the ids, sums each run of equal
ids in fp32 partial segments, scatters the sums and zero-fills the rest: eight launches,
at LLaMA-7B's shapes (16384 tokens, V 32000, d 4096, bf16) about nine times what its
bytes (read dy, write dW: 134 + 262 MB) take at the H200's copy rate.

Here:
1. `torch.sort` of the ids (stable: equal ids keep token order, so the sums are
   deterministic) gives `order`, the tokens grouped by id;
2. `torch.searchsorted` of 0..V in the sorted ids gives `starts`: row v's tokens are
   order[starts[v]:starts[v+1]] (an empty range for an unused row);
3. one launch over (V rows) × (d / BLOCK_D column blocks): each program sums its row's
   tokens' dy columns in fp32 and writes the row once, zeros included, rounded once to
   W's dtype. No zero-fill pass, no atomics, no fp32 buffer of dW.

Bytes: dy once (each token belongs to one row) and dW once, plus the ids and `order`
(8 B a token) and `starts` (8 B a row). A row used by many tokens is summed by one
program in a loop: skewed real text (a few ids in most positions) lengthens those
programs, not the others; the random-token benchmark gives each row about
tokens / V of them.

`padding_idx` rows get a zero gradient, as `nn.Embedding`'s do. `max_norm`,
`scale_grad_by_freq` and sparse gradients are not handled here (the switch keeps
torch's embedding for a module that sets them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import _to_dtype

MAX_BLOCK_D = 1024
"""Columns per program: 4 per thread at 8 warps; d = 4096 makes 4 programs a row."""


@triton.jit
def _embedding_backward_kernel(
    DY,  # (N, d) gradient of the lookup's output, rows stride_dy apart, unit columns
    ORDER,  # (N,) token indices grouped by id (a stable argsort of the ids)
    STARTS,  # (V + 1,) row v's tokens are ORDER[STARTS[v]:STARTS[v + 1]]
    DW,  # (V, d) contiguous output, W's dtype
    stride_dy,  # elements between rows of DY
    dim,  # d
    pad_row,  # a row whose gradient stays zero (padding_idx), or -1
    BLOCK_D: tl.constexpr,  # columns per program
):
    """dW[v, cols] = Σ dy[t, cols] over row v's tokens, in fp32; zeros for none."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < dim
    start = tl.load(STARTS + row)
    end = tl.load(STARTS + row + 1)
    if row == pad_row:
        end = start
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(start, end):
        tok = tl.load(ORDER + j).to(tl.int64)
        acc += tl.load(DY + tok * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DW + row.to(tl.int64) * dim + cols, _to_dtype(acc, DW.dtype.element_ty),
             mask=mask)


def _tiling(dim: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) for rows of `dim` columns."""
    block = min(triton.next_power_of_2(max(dim, 1)), MAX_BLOCK_D)
    return block, max(1, min(8, block // 128))


def embedding_backward(dy: torch.Tensor, ids: torch.Tensor, num_rows: int,
                       dtype: torch.dtype, padding_idx: int | None = None) -> torch.Tensor:
    """dW (num_rows, d) in `dtype` for the gradient `dy` (..., d) of W[ids].

    Args:
        dy: (..., d) the lookup output's gradient, ids.shape + (d,).
        ids: integer token ids in [0, num_rows) (not checked on the device: an id out
            of range is a row that never gets its gradient, as torch's lookup would
            have failed in the forward).
        num_rows: V, the embedding's rows.
        dtype: dW's dtype (the weight's).
        padding_idx: a row kept at zero gradient (nn.Embedding's), or None.
    """
    d = dy.shape[-1]
    dy2 = dy.reshape(-1, d)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    flat = ids.reshape(-1)
    if flat.numel() != dy2.shape[0]:
        raise ValueError(f"dy has {dy2.shape[0]} rows for {flat.numel()} ids")
    dw = torch.empty((num_rows, d), dtype=dtype, device=dy.device)
    if num_rows == 0 or d == 0:
        return dw
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(
        sorted_ids, torch.arange(num_rows + 1, device=flat.device, dtype=sorted_ids.dtype))
    block, warps = _tiling(d)
    pad = -1 if padding_idx is None else padding_idx % num_rows
    _embedding_backward_kernel[(num_rows, triton.cdiv(d, block))](
        dy2, order, starts, dw, dy2.stride(0), d, pad, BLOCK_D=block, num_warps=warps)
    return dw


class EmbeddingFunction(torch.autograd.Function):
    """y = weight[ids] (torch's gather) with `embedding_backward` as the gradient;
    saves only the ids."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.dtype, ctx.padding_idx = weight.shape[0], weight.dtype, padding_idx
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        dw = embedding_backward(dy, ids, ctx.rows, ctx.dtype, ctx.padding_idx)
        return None, dw, None


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor,
                     padding_idx: int | None = None) -> torch.Tensor:
    """weight[ids], (..., d), whose weight gradient is `embedding_backward`."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids are {ids.dtype}; expected an integer tensor (int64 or int32)")
    if weight.dim() != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (V, d)")
    return EmbeddingFunction.apply(ids, weight, padding_idx)
