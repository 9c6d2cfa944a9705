"""Fused linear + cross-entropy (`enable_fused_cross_entropy`): the loss without (N, V) logits.

The eager head computes all logits z = h Wᵀ (N = B·S tokens, V vocabulary rows) and the
mean of lse(z_i) − z_i,y_i in fp32: about 36 bytes moved per logit where 6 suffice
(`kernels.cross_entropy`), and fp32 log-probabilities and their gradient, N·V·4 bytes
each, alive at the peak (2.1 GB each at N = 16384, V = 32000; four times that at
LLaMA-3's V = 128256). The loss needs only lse and z_y per token, and the linear's
backward only dz = (softmax(z) − onehot(y)) / n_valid, so the *forward* loops over
chunks of c tokens (Wijmans et al. 2024; Liger-Kernel's peer)::

    z_c   = h_c Wᵀ                              (c, V), the only logits alive
    loss += Σ (lse − z_y)   and   z_c ← dz_c    one kernel, in place
    dh_c  = dz_c W                              (c, d), into the (N, d) gradient
    dW   += dz_cᵀ h_c                           (V, d), fp32 across chunks

and the backward only scales dh and dW by the incoming scalar. Same GEMM FLOPs, issued
earlier. Chunks (`default_chunk_tokens`): the fewest equal ones whose logits stay under
`CHUNK_BYTES`. The matmuls run in autocast's dtype (else the inputs', which must agree);
dz is rounded once to the logits' dtype, as the eager backward does. With every label
ignored the loss is 0 (F.cross_entropy's mean gives NaN). Labels out of range raise on
CPU tensors; on a GPU (where a check would sync) the Triton kernel makes that row NaN.

Backends (the head's `loss_backend`, which `switches.loss` sets): "eager"
(`cross_entropy_ref` of the full logits), "chunked" (torch ops per chunk, runs anywhere),
"triton" (our kernel per chunk; on a CPU under the interpreter, else "chunked" through
`colossal_lab.fallback`); False / None = "eager", True = "triton" on a GPU, "chunked"
on a CPU. `results/h200/cross_entropy.json` measures them with Liger's.

References: Wijmans et al., *Cut Your Losses in Large-Vocabulary Language Models*,
arXiv:2411.09009; Hsu et al., *Liger Kernel*, arXiv:2410.10216; Milakov & Gimelshein,
*Online normalizer calculation for softmax*, 2018.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from colossal_lab.kernels import cross_entropy as ce_kernel
from colossal_lab.ops import autocast_state, kernel_switch

BACKENDS = ("eager", "chunked", "triton")
CHUNK_BYTES = 512 << 20
"""Target size of one chunk's logits (`default_chunk_tokens`)."""


# ----------------------------------------------------------------------------- reference


def cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy in fp32 over the labels that are not `ignore_index`: the
    model's current loss, `F.cross_entropy(logits.float(), labels)`.

    Args:
        logits: (..., V), any float dtype: upcast to fp32 (fp64 stays fp64, for tests).
        labels: (...), integers in [0, V) or `ignore_index`.
    Returns:
        0-d fp32 (fp64 for fp64 logits); 0 when every label is ignored (where the mean
        of F.cross_entropy is 0/0 = NaN).
    """
    z = logits.reshape(-1, logits.shape[-1])  # (N, V)
    z = z if z.dtype == torch.float64 else z.float()
    y = labels.reshape(-1).long()
    total = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")
    return total / (y != ignore_index).sum().clamp(min=1)


# ------------------------------------------------------------------------------ dispatch


def _validate(value) -> None:
    kernel_switch.check_value(value, BACKENDS, "loss_backend")


def resolve_backend(value, device: torch.device | str | None = None) -> str:
    """The loss backend the switch value picks on `device`: "eager", "chunked" or
    "triton" (`kernel_switch.resolve`: "triton" without a GPU or the interpreter falls
    back to "chunked")."""
    return kernel_switch.resolve(value, device, names=BACKENDS, field="loss_backend",
                                 what="loss", cpu="chunked")


def default_chunk_tokens(n_tokens: int, vocab: int, elem_size: int) -> int:
    """Tokens per chunk: the fewest equal chunks whose logits, (c, V) of `elem_size`
    bytes, stay under `CHUNK_BYTES` (module docstring)."""
    n_chunks = max(1, math.ceil(n_tokens * vocab * elem_size / CHUNK_BYTES))
    return max(1, math.ceil(n_tokens / n_chunks))


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


_FP32_OUT: dict[str, bool] = {}


def mm_fp32_out_supported(device: torch.device) -> bool:
    """Whether this device's GEMMs take bf16/fp16 operands and write (`mm`) or
    accumulate into (`addmm`) an fp32 result: `torch.mm(..., out_dtype=torch.float32)`,
    cuBLAS with an fp32 C/D on CUDA. Then dW needs neither the zeroed buffer nor a
    (V, d) bf16 partial per chunk added into it: one pass over 0.75 GB less per chunk at
    V = 32000. Probed once per device type with a tiny GEMM; the CPU has no such kernel
    (aten::mm.dtype is not registered there)."""
    key = device.type
    if key not in _FP32_OUT:
        try:
            a = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
            out = torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
            _FP32_OUT[key] = out.dtype == torch.float32 and bool((out == 4).all())
        except (NotImplementedError, RuntimeError, TypeError):
            _FP32_OUT[key] = False
    return _FP32_OUT[key]


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 ignore_index: int = -100) -> None:
    """Shapes, dtypes and devices (no device sync); labels in range on CPU tensors."""
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "must be (..., d) and (V, d): the lm_head weight, not its "
                         "transpose")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be {tuple(hidden.shape[:-1])}"
                         f": one per token of hidden {tuple(hidden.shape)}")
    if hidden.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must be "
                         "float32, float16 or bfloat16")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or \
            labels.dtype == torch.bool:
        raise ValueError(f"labels dtype {labels.dtype} must be an integer type")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden on {hidden.device}, weight on {weight.device}, labels "
                         f"on {labels.device}: put them on one device")
    if labels.device.type == "cpu" and labels.numel():  # free here; a GPU would sync
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bad.any():
            raise ValueError(f"label {labels[bad][0].item()} is outside [0, "
                             f"{weight.shape[0]}) and is not ignore_index={ignore_index}")


# ------------------------------------------------------------------------------ autograd


def _loss_and_grad_torch_(z: torch.Tensor, labels: torch.Tensor,
                          scale: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """What the Triton kernel does, with torch ops: per-row loss (fp32), and z ← dz
    unless `scale` is None. Works on an fp32 copy of z (z itself when fp32)."""
    x = z.float()  # (c, V)
    valid = labels != ignore_index
    y = torch.where(valid, labels, 0).long()
    lse = torch.logsumexp(x, dim=-1)  # (c,)
    loss = torch.where(valid, lse - x.gather(1, y[:, None]).squeeze(1), 0.0)
    if scale is not None:
        p = x.sub_(lse[:, None]).exp_()  # softmax, in place: x is no longer needed
        p[torch.arange(len(y), device=y.device), y] -= 1.0
        p.mul_((scale * valid)[:, None])  # ignored rows: 0
        if p is not z:
            z.copy_(p)
    return loss


def _scale_cast_torch(g: torch.Tensor, s: torch.Tensor, dtype) -> torch.Tensor:
    """g · s cast to `dtype`, with torch ops (what `kernels.cross_entropy.scale_cast`
    does in one pass)."""
    return (g * s.to(g.dtype)).to(dtype)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy of (hidden @ weightᵀ) over non-ignored labels, chunk by chunk;
    the gradients are computed in the forward and scaled in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, ignore_index, dtype,
                use_triton):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tokens, d = hidden.shape
        vocab = weight.shape[0]
        dev = hidden.device
        h = hidden.to(dtype)  # (N, d) in the matmul dtype (autocast's cast)
        w = weight.to(dtype)  # (V, d)
        n_valid = (labels != ignore_index).sum()
        scale = 1.0 / n_valid.clamp(min=1).float()  # on the device: no sync
        grad_scale = scale if need_h or need_w else None  # None: loss only

        grad_h = torch.empty((n_tokens, d), dtype=dtype, device=dev) if need_h else None
        n_chunks = math.ceil(n_tokens / chunk_tokens)
        direct_w = n_chunks == 1 and weight.dtype == dtype  # one GEMM: no buffer
        grad_w = None
        # bf16 chunks with an fp32 dW: the GEMM itself writes (first chunk) and then
        # accumulates (later chunks) into fp32 where the device has out_dtype GEMMs
        fp32_out = (need_w and not direct_w and dtype != torch.float32
                    and mm_fp32_out_supported(dev))
        if need_w and not direct_w and not fp32_out:
            grad_w = torch.zeros((vocab, d), dtype=torch.float32, device=dev)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        z_buf = torch.empty((min(chunk_tokens, n_tokens), vocab), dtype=dtype, device=dev)

        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            h_c = h[start:end]  # (c, d)
            z = torch.mm(h_c, w.t(), out=z_buf[:end - start])  # (c, V) logits
            if use_triton:
                rows = ce_kernel.cross_entropy_loss_and_grad_(
                    z, labels[start:end], grad_scale=grad_scale, ignore_index=ignore_index)
            else:
                rows = _loss_and_grad_torch_(z, labels[start:end], grad_scale, ignore_index)
            loss += rows.sum()
            # z now holds dz = (softmax − onehot) / n_valid
            if need_h:
                torch.mm(z, w, out=grad_h[start:end])  # (c, d)
            if need_w:
                if direct_w:
                    grad_w = z.t() @ h_c  # (V, d)
                elif fp32_out and grad_w is None:
                    grad_w = torch.mm(z.t(), h_c, out_dtype=torch.float32)
                elif fp32_out:
                    torch.addmm(grad_w, z.t(), h_c, out_dtype=torch.float32, out=grad_w)
                elif dtype == torch.float32:
                    grad_w.addmm_(z.t(), h_c)
                else:
                    grad_w += z.t() @ h_c  # (V, d) partial in the matmul dtype
        del z_buf
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros_like(weight)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.use_triton = use_triton
        return loss * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        cast = ce_kernel.scale_cast if ctx.use_triton else _scale_cast_torch  # one pass
        # out of place: a retained graph may run backward again
        dh = None if grad_h is None else cast(grad_h, grad_out, h_dtype)
        dw = None if grad_w is None else cast(grad_w, grad_out, w_dtype)
        return dh, dw, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               labels: torch.Tensor, *, chunk_tokens: int | None = None,
                               ignore_index: int = -100, backend="triton"
                               ) -> torch.Tensor:
    """Mean cross-entropy of the logits hidden @ weightᵀ over the labels that are not
    `ignore_index`, without making the (N, V) logits (except backend "eager").

    Args:
        hidden: (N, d) or (..., d) last hidden states, fp32/fp16/bf16.
        weight: (V, d) the output head's weight (`lm_head.weight`).
        labels: (N,) or (...) integer next-token labels in [0, V), or `ignore_index`.
        chunk_tokens: tokens per chunk; default `default_chunk_tokens` (logits of a
            chunk under 512 MiB).
        ignore_index: label of tokens without loss.
        backend: "eager", "chunked", "triton", or a switch value (True / False / None;
            `resolve_backend`).
    Returns:
        0-d fp32 loss (0 when every label is ignored). Under `torch.autocast` the
        matmuls run in the autocast dtype; otherwise hidden and weight must share a
        dtype. Gradients reach hidden and weight in their own dtypes.
    """
    check_inputs(hidden, weight, labels, ignore_index)
    name = resolve_backend(backend, hidden.device)
    if name == "eager":
        return cross_entropy_ref(hidden @ weight.t(), labels, ignore_index)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive integer or None")
    device_type = hidden.device.type
    dtype = autocast_state.current_dtype(device_type)
    if dtype is None:
        if hidden.dtype != weight.dtype:
            raise ValueError(f"hidden is {hidden.dtype} and weight {weight.dtype}: cast one, "
                             "or call under torch.autocast to pick the matmul dtype")
        dtype = hidden.dtype
    h2d = hidden.reshape(-1, hidden.shape[-1])  # (N, d)
    y = labels.reshape(-1)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(h2d.shape[0], weight.shape[0], dtype.itemsize)
    with autocast_state.off(device_type):  # dtype decided above, explicitly
        return FusedLinearCrossEntropyFunction.apply(
            h2d, weight, y, max(1, chunk_tokens), ignore_index, dtype, name == "triton")
