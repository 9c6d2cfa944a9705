"""Cross-entropy over rows of logits in Triton: the loss and, in place, its gradient.

Math, per row z of V logits with label y (Goodfellow et al., *Deep Learning*, §6.2.2.3)::

    lse     = log Σ_j e^(z_j)                    (logsumexp, computed stably)
    loss    = lse − z_y
    p_j     = e^(z_j − lse)                      (softmax)
    dz_j    = (p_j − [j = y]) · grad_scale       (∂loss/∂z_j, times the caller's scale)

A row whose label is `ignore_index` has loss 0 and gradient 0. The mean over the valid
rows is the caller's: it passes grad_scale = 1 / n_valid and sums the returned losses.

**Two passes over V, one program per row.** A row of LLaMA-3's V = 128256 logits does not
fit in registers, so the kernel walks it in BLOCK-wide chunks. Pass 1 keeps a running
maximum m and a running sum s = Σ e^(z_j − m) (flash attention's online softmax, Milakov
& Gimelshein 2018): a new chunk with maximum m' > m rescales s by e^(m − m') before
adding its own terms, so one read of the row gives lse = m + log s. Pass 2 reads the row
again and writes dz over it.

**In place.** The gradient has the logits' shape and dtype, and the logits have no
other reader once the loss is known (the linear layer's backward needs dz, never z). So
pass 2 overwrites z with dz: a forward+backward of the loss allocates no second (N, V)
tensor. The caller must not read the logits afterwards.

Bytes moved per logit (e: its element size, 2 for bf16; N·V logits)::

                                      eager, fp32 (the model's)       this kernel
    forward: cast to fp32               read e, write 4
             log_softmax, saved         read 4, write 4
    backward: nll grad (zeros+scatter)  write 4
             log_softmax backward       read 8, write 4
             cast back to bf16          read 4, write e
    total                               32 + 2e = 36 B (bf16)          3e = 6 B (bf16)

(pass 1 reads e, pass 2 reads e, often from L2, and writes e). At N = 16384 tokens and
V = 32000 that is 18.9 GB against 3.1 GB (`results/h200/cross_entropy.json` has the
times, with Liger-Kernel's beside them). The eager path also keeps the fp32
log-probabilities (N·V·4 bytes, 2.1 GB) from the forward to the backward and makes their
fp32 gradient (2.1 GB more) there.

Labels outside [0, V) other than `ignore_index` are not read (no out-of-bounds access):
their row's loss and gradient are NaN, which a checking caller sees without a
device-to-host synchronisation on every call.

`cross_entropy_loss_and_grad_` is the launcher (in place, hence the trailing
underscore); `TritonCrossEntropyFunction` wraps it as a loss on given logits.
`colossal_lab.ops.cross_entropy` runs it on chunks of logits it makes itself, so that the
(N, V) logits never exist at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import _to_dtype

MAX_BLOCK = 8192
"""Logits per chunk of the loop over V: 8192 = 16 per thread at 16 warps, 32 KB fp32."""


@triton.jit
def _cross_entropy_kernel(
    LOGITS,  # (n_rows, n_cols) logits z, unit column stride; overwritten with dz
    LABELS,  # (n_rows,) integer labels y, contiguous
    LOSS,  # (n_rows,) fp32 output: lse − z_y, 0 for ignored rows
    SCALE,  # (1,) fp32 grad_scale (a tensor: 1 / n_valid needs no host sync)
    stride_row,  # elements between rows of LOGITS
    n_cols,  # V
    ignore_index,  # label value that marks a row without loss
    WRITE_GRAD: tl.constexpr,  # pass 2: overwrite the logits with dz
    BLOCK: tl.constexpr,  # logits per chunk of the loop over V
):
    """loss = lse − z_y of one row (pass 1); z ← (softmax(z) − onehot(y)) · scale
    (pass 2)."""
    row = tl.program_id(0).to(tl.int64)  # int64: row · stride passes 2^31 at 16k × 256k
    base = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK)
    label = tl.load(LABELS + row).to(tl.int64)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                tl.store(base + offs, _to_dtype(zeros, LOGITS.dtype.element_ty),
                         mask=offs < n_cols)
    else:
        # pass 1: running max m and running Σ e^(z − m), rescaled when m grows
        m = tl.full([], float("-inf"), dtype=tl.float32)
        s = tl.full([], 0.0, dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            z = tl.load(base + offs, mask=offs < n_cols, other=float("-inf"))
            z = z.to(tl.float32)  # (BLOCK,) masked lanes -inf: e^(-inf − m) = 0
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)

        in_range = (label >= 0) & (label < n_cols)
        z_y = tl.load(base + label, mask=in_range, other=0.0).to(tl.float32)
        loss = tl.where(in_range, lse - z_y, float("nan"))
        tl.store(LOSS + row, loss)

        if WRITE_GRAD:
            # a label out of range poisons the row's gradient too: scale NaN
            scale = tl.where(in_range, tl.load(SCALE), float("nan"))
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                mask = offs < n_cols
                z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
                p = tl.exp(z - lse)  # softmax
                dz = tl.where(offs == label, p - 1.0, p) * scale
                tl.store(base + offs, _to_dtype(dz, LOGITS.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


def _launch_config(n_cols: int, block: int | None) -> tuple[int, int]:
    """BLOCK (a power of two, at most MAX_BLOCK) and warps for rows of n_cols logits."""
    if block is None:
        block = min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))
    elif block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16")
    return block, min(16, max(1, block // 256))  # 8 logits per thread, 16 warps at most


def check_logits_and_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Cheap checks (no device sync): shapes, dtypes, devices and strides."""
    if logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)} must be 2-D (rows, V); flatten "
                         "the batch and sequence dimensions first")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits dtype {logits.dtype} must be float32, float16 or "
                         "bfloat16")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be ({logits.shape[0]},): one "
                         f"per row of the logits {tuple(logits.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or \
            labels.dtype == torch.bool:
        raise ValueError(f"labels dtype {labels.dtype} must be an integer type")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device}, logits on {logits.device}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits need unit column stride (got strides {logits.stride()}):"
                         " the gradient is written in place, so no copy is made for you")


def cross_entropy_loss_and_grad_(logits: torch.Tensor, labels: torch.Tensor, *,
                                 grad_scale: float | torch.Tensor | None = 1.0,
                                 ignore_index: int = -100,
                                 block: int | None = None) -> torch.Tensor:
    """Per-row cross-entropy of `logits`, and its gradient written over them.

    Args:
        logits: (N, V) fp32/fp16/bf16, unit column stride, any row stride. Overwritten
            with dz = (softmax − onehot) · grad_scale unless grad_scale is None.
        labels: (N,) integers in [0, V), or `ignore_index`.
        grad_scale: a float or a 1-element tensor (e.g. 1 / n_valid, kept on the device);
            None computes the loss only and leaves the logits untouched.
        ignore_index: rows with this label get loss 0 and gradient 0.
        block: logits per chunk of the loop over V (tests use small ones).
    Returns:
        loss (N,) fp32: lse − z_y per row (0 for ignored rows, NaN for labels out of
        range).
    """
    check_logits_and_labels(logits, labels)
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss
    if n_cols == 0:
        raise ValueError("cannot take the cross-entropy over 0 classes")
    if grad_scale is None or isinstance(grad_scale, torch.Tensor):
        scale = grad_scale
    else:
        scale = torch.full((1,), float(grad_scale), dtype=torch.float32,
                           device=logits.device)
    if scale is not None:
        scale = scale.detach().reshape(1).to(device=logits.device, dtype=torch.float32)
    blk, warps = _launch_config(n_cols, block)
    _cross_entropy_kernel[(n_rows,)](
        logits, labels.contiguous(), loss, scale if scale is not None else loss,
        logits.stride(0), n_cols, ignore_index, WRITE_GRAD=scale is not None, BLOCK=blk,
        num_warps=warps)
    return loss


@triton.jit
def _scale_cast_kernel(
    X,  # (n,) contiguous input
    SCALE,  # (1,) the factor, read on the device (no host sync)
    Y,  # (n,) contiguous output, in its own dtype
    n,  # elements
    BLOCK: tl.constexpr,  # elements per program
):
    """y = x · scale, in fp32, rounded once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(SCALE).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, _to_dtype(x * s, Y.dtype.element_ty), mask=mask)


SCALE_BLOCK = 4096
"""Elements per program of `scale_cast`: 16 per thread at 8 warps."""


def scale_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor (x · scale) in `dtype`, one pass; `scale` a one-element tensor on
    x's device. The fused loss's backward scales its precomputed gradients by the
    incoming gradient with it: eager `(x * g).to(dtype)` reads and writes x twice, and
    its multiply by a 0-d tensor runs TensorIterator's strided kernel, well below the
    copy rate. Falls back to eager for a non-contiguous x."""
    if not x.is_contiguous() or x.numel() == 0:
        return (x * scale.to(x.dtype)).to(dtype)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = scale.detach().reshape(1).to(device=x.device, dtype=torch.float32)
    n = x.numel()
    _scale_cast_kernel[(triton.cdiv(n, SCALE_BLOCK),)](x, scale, y, n, BLOCK=SCALE_BLOCK,
                                                      num_warps=8)
    return y


# ------------------------------------------------------------------------------ autograd


class TritonCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy of given logits over the non-ignored rows; the gradient is
    computed in the forward, into the logits' own buffer (they are destroyed)."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        n_valid = (labels != ignore_index).sum()
        scale = 1.0 / n_valid.clamp(min=1).float()  # all rows ignored: loss 0, not NaN
        need_grad = ctx.needs_input_grad[0]
        loss = cross_entropy_loss_and_grad_(
            logits, labels, grad_scale=scale if need_grad else None,
            ignore_index=ignore_index).sum() * scale
        if need_grad:
            ctx.save_for_backward(logits)  # now dz for the mean loss
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        (dz,) = ctx.saved_tensors
        return scale_cast(dz, grad_out, dz.dtype), None, None


def cross_entropy_triton(logits: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over rows of `logits` (N, V) whose `labels` (N,) are not
    `ignore_index` (0 when every row is ignored), as a 0-d fp32 tensor.

    The logits' buffer is overwritten with the gradient when they require one: pass
    logits that nothing else reads (`logits.clone()` otherwise)."""
    return TritonCrossEntropyFunction.apply(logits, labels, ignore_index)
