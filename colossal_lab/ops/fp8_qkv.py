"""The fp8 qkv projection with RoPE in one autograd node, its gradient cast fused in.

With fused projections (switch 3), our RoPE kernel and fp8 linears (switch 6), the
attention's input side is an fp8 `qkv_proj` whose output is split into q, k, v and q, k
rotated (`kernels.rope.RotaryQKVFunction`). Composed from the parts, the backward
writes the qkv gradient dqkv (T, W) in the activation dtype, and the projection's cast
reads it back for its e5m2 copies; dqkv has no other reader. `Fp8QKVRopeFunction` runs
the projection's three GEMMs as `Fp8LinearFunction` does, with RoPE's backward and the
cast in one kernel (`kernels.rope_fp8`)::

    forward   x, W -> e4m3 (fp8_cast_transpose, as Fp8Linear)
              qkv = x_q @ Wᵀ                          (T, W), activation dtype
              q, k = rope(split(qkv));  v = a view of qkv
    backward  g_q, g_qᵀ = e5m2(rope⁻¹(dq, dk) | dv)   one kernel, dqkv never written
              dx = g @ W,  dW = gᵀ @ x_q

Saved for the backward: x_qᵀ and W_qᵀ (fp8) and RoPE's half tables, what the composed
path saves. At llama-7b (16,384 tokens, W = 12,288, bf16) the fusion saves 0.8 GB of
traffic a layer and step (`kernels.rope_fp8`).

**Scaling.** The casts go through the projection's `_Scaler`s (`ops.fp8`): dqkv is its
"grad" role, so histories, replays under checkpointing and evaluation (`update=False`)
behave as in the composed path, and the fp8 bits are the composed path's (the kernel
rounds dqkv to the activation dtype before the cast, as the composed path does when it
writes it).

**The norm in front.** With `norm=` (the layer's `input_layernorm`, `ops.fp8_norm`) the
node also takes the RMSNorm: its kernel writes x_q and x_qᵀ of norm(x + residual), the
node returns the stream h = x + residual beside q, k, v, and its backward runs the norm's
backward on dx.

**When.** `Attention.forward` calls `fusable` first: fused projections, RoPE resolved to
"triton", `qkv_proj` an `Fp8Linear` without bias or module hooks, and
`Fp8Config.fuse_rope` (`Switches.extra["fp8_fuse_rope"]`, default True); with `norm=`
also `fp8_norm.fusable` (`Attention.fuses_norm`, which the decoder layer asks).
"""

from __future__ import annotations

import torch

from colossal_lab.kernels.rope import check_qk, half_tables, rope_forward, split_heads
from colossal_lab.kernels.rope_fp8 import rope_fp8_backward, rope_fp8_backward_amax
from colossal_lab.ops import autocast_state, fp8_norm
from colossal_lab.ops.fp8 import Fp8Linear, fusable_linear, scaled_mm
from colossal_lab.ops.rope import resolve_backend as resolve_rope


def fusable(qkv_proj, rope_backend, device, norm=None) -> bool:
    """Can `fp8_qkv_rope` replace split_rotary(qkv_proj(x)) with `rope_backend`? With
    `norm`: split_rotary(qkv_proj(norm(x))), the norm inside (`fp8_norm.fusable`)."""
    if not fusable_linear(qkv_proj, "fuse_rope"):
        return False
    if norm is not None and not fp8_norm.fusable(norm, qkv_proj, device):
        return False
    return resolve_rope(rope_backend, device) == "triton"


class Fp8QKVRopeFunction(torch.autograd.Function):
    """q_rot, k_rot, v = RoPE(split(x @ Wᵀ)) with the projection's GEMMs in fp8 and the
    cast of its output gradient fused into RoPE's backward (module docstring). `module`
    holds the scaling state and config."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, weight, module, n_q, n_kv, cos, sin, eps,
                out_dtype, update):
        cfg, sc = module.fp8_config, module._scalers
        need_x = fp8_norm.requires_grad(x, residual, norm_weight)  # the input's gradient
        # x, or the norm of x (+ residual) cast inside the norm kernel (`fp8_norm`)
        (xq, xq_t, x_inv), stream, norm_saved = fp8_norm.cast_input(
            sc["x"], x, residual, norm_weight, eps, update=update,
            write_t=update and weight.requires_grad)
        wq, wq_t, w_inv = sc["w"].cast(weight, update=update, write_yt=update and need_x)
        qkv = scaled_mm(xq, wq.t(), x_inv, w_inv, out_dtype,
                        use_fast_accum=cfg.fast_accum_forward, backend=cfg.backend)
        q, k, v = split_heads(qkv.view(*x.shape[:-1], qkv.shape[-1]), n_q, n_kv)
        check_qk(q, k)
        cos_h, sin_h = half_tables(cos, sin, q.shape[1], q.shape[3])
        q_rot, k_rot = rope_forward(q, k, cos_h, sin_h)
        ctx.save_for_backward(xq_t, wq_t, x_inv, w_inv, cos_h, sin_h, *norm_saved)
        ctx.module, ctx.x_shape = module, x.shape
        ctx.x_dtype = fp8_norm.normed_dtype(x, residual)  # the projection input's
        ctx.heads, ctx.out_dtype = (*q.shape[:3], n_kv, q.shape[3]), out_dtype
        return q_rot, k_rot, v, stream

    @staticmethod
    def backward(ctx, dq, dk, dv, dstream):
        xq_t, wq_t, x_inv, w_inv, cos_h, sin_h, *norm_saved = ctx.saved_tensors
        module = ctx.module
        cfg, sg = module.fp8_config, module._scalers["grad"]
        need_x = any(ctx.needs_input_grad[:3])  # x, residual, norm weight: through dx
        need_w = ctx.needs_input_grad[3]
        B, S, n_q, n_kv, D = ctx.heads
        dq, dk, dv = (g if g is not None else cos_h.new_zeros(B, S, h, D, dtype=ctx.out_dtype)
                      for g, h in ((dq, n_q), (dk, n_kv), (dv, n_kv)))  # an unused output
        # the kernel runs here whenever RoPE resolved to Triton (a GPU, or the
        # interpreter); use_triton=False in the config asks for torch ops instead
        use = True if cfg.use_triton is None else cfg.use_triton
        gq, gq_t, g_inv = sg.scaled(
            lambda src, amax_out: rope_fp8_backward(
                dq, dk, dv, cos_h, sin_h, sg.fmt.dtype, src, write_q=need_x,
                write_qt=need_w, amax_out=amax_out, use_triton=use),
            lambda: rope_fp8_backward_amax(dq, dk, dv, cos_h, sin_h, use_triton=use),
            update=True, device=dq.device)
        dx = dw = None
        if need_x:  # (T, W) @ (W, d): B = W column-major = (Wᵀ)ᵀ
            dx = scaled_mm(gq, wq_t.t(), g_inv, w_inv, ctx.x_dtype,
                           use_fast_accum=cfg.fast_accum_backward, backend=cfg.backend)
        if need_w:  # (W, T_pad) @ (T_pad, d): B = x column-major = (xᵀ)ᵀ; pads add 0
            dw = scaled_mm(gq_t, xq_t.t(), g_inv, x_inv, module.weight.dtype,
                           use_fast_accum=cfg.fast_accum_backward, backend=cfg.backend)
        # through the norm, when there is one: dx, dresidual, dnorm_weight
        grads_in = fp8_norm.input_grads(dx, dstream, norm_saved, ctx.x_shape,
                                        ctx.needs_input_grad[:3])
        return *grads_in, dw, None, None, None, None, None, None, None, None


def fp8_qkv_rope(x: torch.Tensor, qkv_proj: Fp8Linear, n_q: int, n_kv: int,
                 cos: torch.Tensor, sin: torch.Tensor, norm=None,
                 residual: torch.Tensor | None = None):
    """q_rot (B, S, n_q, D), k_rot (B, S, n_kv, D) and v (B, S, n_kv, D) of x (B, S, d)
    through `Fp8QKVRopeFunction`: `rope.split_rotary(qkv_proj(x), ...)` with the
    projection in fp8 and its gradient's cast fused into RoPE's backward. Outputs in the
    autocast dtype when autocast is on, else in x's dtype (as the composed path).

    With `norm` (an `RMSNorm`; `fusable(..., norm=norm)`) the projection's input is
    norm(x + residual) (residual None: norm(x)), written in fp8 by the norm kernel
    (`ops.fp8_norm`), and the stream x + residual (x without a residual) is returned
    too: (q_rot, k_rot, v, h)."""
    out_dtype = autocast_state.current_dtype(x.device.type) or \
        fp8_norm.normed_dtype(x, residual)
    update = torch.is_grad_enabled()  # evaluation does not move the amax histories
    norm_weight, eps = (None, None) if norm is None else (norm.weight, norm.eps)
    with autocast_state.off(x.device.type):
        q, k, v, stream = Fp8QKVRopeFunction.apply(x, residual, norm_weight,
                                                   qkv_proj.weight, qkv_proj, n_q, n_kv,
                                                   cos, sin, eps, out_dtype, update)
    if norm is None:
        return q, k, v
    return q, k, v, x if stream is None else stream
