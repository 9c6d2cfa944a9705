"""The fp8 SwiGLU MLP with the activation's casts fused in: y = down(swiglu(gate_up(x))).

With fused projections (switch 3) and fp8 linears (switch 6) the MLP is two
`Fp8Linear`s around the SwiGLU. Composed from the parts, the SwiGLU writes h (T, i) in
the activation dtype, and the down projection's cast reads it back to write its e4m3
copies (row-major for the forward GEMM, transposed for dW_down); in the backward the
SwiGLU writes d(gate_up) (T, 2i), which the gate/up projection's cast reads back for
its e5m2 copies. Neither bf16 tensor has another reader. `Fp8SwiGLUMLPFunction` runs
the five GEMMs of the two linears as `Fp8LinearFunction` does, with the SwiGLU and the
two casts in one kernel each way (`kernels.swiglu_fp8`)::

    forward   x, W_gu, W_down -> e4m3 (fp8_cast_transpose, as Fp8Linear)
              gu = x_q @ W_guᵀ                       (T, 2i), activation dtype, saved
              h_q, h_qᵀ = e4m3(swiglu(gu))           one kernel, h never written
              y  = h_q @ W_downᵀ
    backward  dy -> e5m2 (fp8_cast_transpose)
              dW_down = dyᵀ @ h_q,  dh = dy @ W_down
              dgu_q, dgu_qᵀ = e5m2(swiglu'(dh, gu))  one kernel, d(gu) never written
              dW_gu = dguᵀ @ x_q,   dx = dgu @ W_gu

Saved for the backward: x_qᵀ and both W_qᵀ (fp8), gu (the SwiGLU backward's input),
h_qᵀ (fp8), what the composed path saves.

**Scaling.** Every cast goes through its module's `_Scaler` (`ops.fp8`): h is the down
projection's "x" role, d(gu) the gate/up projection's "grad" role, so histories,
replays under checkpointing and evaluation (`update=False`: histories stay) behave as
in the composed path. Delayed scaling casts in one pass. Dynamic scaling first runs
the kernel in its amax-only mode (reads gu, or dh and gu, once more; still less traffic
than the composed path's write, reduce and cast of the bf16 tensor).

**Numerics.** The kernels round h and d(gu) to the activation dtype before the cast,
as the composed path does when it materialises them, so the two paths quantise the same
values: the same fp8 bits, outputs, gradients and amax histories wherever the SwiGLU's
fp32 math agrees (on one device, the same kernels' formulas).

**The norm in front.** With `norm=` (the layer's `post_attention_layernorm`,
`ops.fp8_norm`) the node also takes the RMSNorm: its kernel writes x_q and x_qᵀ of
norm(x + residual), the node returns the stream h = x + residual beside y, and its
backward runs the norm's backward on dx.

**When.** `MLP.forward` calls `fusable` first: fused projections, the activation
resolved to "triton", both projections `Fp8Linear` without bias or module hooks, and
`Fp8Config.fuse_mlp` (`Switches.extra["fp8_fuse_mlp"]`, default True) on both; with
`norm=` also `fp8_norm.fusable` (`MLP.fuses_norm`, which the decoder layer asks). Both
GEMM backends (`scaled_mm`, `emulate`) run here, as in `Fp8Linear`.
"""

from __future__ import annotations

import torch

from colossal_lab.kernels.swiglu_fp8 import (
    swiglu_fp8_backward,
    swiglu_fp8_backward_amax,
    swiglu_fp8_forward,
    swiglu_fp8_forward_amax,
)
from colossal_lab.ops import autocast_state, fp8_norm
from colossal_lab.ops.fp8 import Fp8Linear, fusable_linear, scaled_mm
from colossal_lab.ops.swiglu import resolve_activation


def fusable(gate_up_proj, down_proj, activation, device, norm=None) -> bool:
    """Can `fp8_swiglu_mlp` replace down_proj(swiglu(gate_up_proj(x), activation))? With
    `norm`: ...(gate_up_proj(norm(x))), the norm inside (`fp8_norm.fusable`)."""
    if not all(fusable_linear(m, "fuse_mlp") for m in (gate_up_proj, down_proj)):
        return False
    if norm is not None and not fp8_norm.fusable(norm, gate_up_proj, device):
        return False
    return resolve_activation(activation, device) == "triton"


class Fp8SwiGLUMLPFunction(torch.autograd.Function):
    """y = down(silu(gate) · up) with gate | up = gate_up(x), every GEMM in fp8 and the
    SwiGLU's casts fused into its kernels (module docstring). `gate_up`, `down` hold
    the scaling state and configs."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, w_gu, w_down, gate_up, down, eps, out_dtype,
                update):
        cfg_gu, cfg_dn = gate_up.fp8_config, down.fp8_config
        need_x = fp8_norm.requires_grad(x, residual, norm_weight)  # the input's gradient
        need_wgu, need_wdn = w_gu.requires_grad, w_down.requires_grad
        need_h = need_x or need_wgu  # the gradient reaches h
        sgu, sdn = gate_up._scalers, down._scalers
        # x, or the norm of x (+ residual) cast inside the norm kernel (`fp8_norm`)
        (xq, xq_t, x_inv), stream, norm_saved = fp8_norm.cast_input(
            sgu["x"], x, residual, norm_weight, eps, update=update,
            write_t=update and need_wgu)
        wq, wq_t, w_inv = sgu["w"].cast(w_gu, update=update, write_yt=update and need_x)
        gu = scaled_mm(xq, wq.t(), x_inv, w_inv, out_dtype,
                       use_fast_accum=cfg_gu.fast_accum_forward, backend=cfg_gu.backend)
        # The activation resolved to Triton, so its kernel runs here (a GPU, or the
        # interpreter); use_triton=False in the config asks for torch ops instead.
        use = True if cfg_dn.use_triton is None else cfg_dn.use_triton
        hq, hq_t, h_inv = sdn["x"].scaled(
            lambda src, amax_out: swiglu_fp8_forward(
                gu, sdn["x"].fmt.dtype, src, write_qt=update and need_wdn,
                amax_out=amax_out, use_triton=use),
            lambda: swiglu_fp8_forward_amax(gu, use_triton=use),
            update=update, device=gu.device)
        vq, vq_t, v_inv = sdn["w"].cast(w_down, update=update, write_yt=update and need_h)
        y = scaled_mm(hq, vq.t(), h_inv, v_inv, out_dtype,
                      use_fast_accum=cfg_dn.fast_accum_forward, backend=cfg_dn.backend)
        ctx.save_for_backward(xq_t, wq_t, x_inv, w_inv, gu if need_h else None, hq_t,
                              h_inv, vq_t, v_inv, *norm_saved)
        ctx.gate_up, ctx.down, ctx.use_triton = gate_up, down, use
        ctx.x_shape = x.shape
        ctx.x_dtype = fp8_norm.normed_dtype(x, residual)  # the projection input's
        return y.view(*x.shape[:-1], y.shape[-1]), stream

    @staticmethod
    def backward(ctx, dy, dstream):
        xq_t, wq_t, x_inv, w_inv, gu, hq_t, h_inv, vq_t, v_inv, *norm_saved = \
            ctx.saved_tensors
        gate_up, down, use = ctx.gate_up, ctx.down, ctx.use_triton
        cfg_gu, cfg_dn = gate_up.fp8_config, down.fp8_config
        need_x = any(ctx.needs_input_grad[:3])  # x, residual, norm weight: through dx
        need_wgu, need_wdn = ctx.needs_input_grad[3:5]
        need_h = need_x or need_wgu
        dy2 = dy.reshape(-1, dy.shape[-1])  # (T, d)
        gq, gq_t, g_inv = down._scalers["grad"].cast(dy2, update=True, write_y=need_h,
                                                     write_yt=need_wdn)
        dx = dw_gu = dw_dn = None
        if need_wdn:  # (d, T_pad) @ (T_pad, i): B = h column-major = (hᵀ)ᵀ
            dw_dn = scaled_mm(gq_t, hq_t.t(), g_inv, h_inv, down.weight.dtype,
                              use_fast_accum=cfg_dn.fast_accum_backward,
                              backend=cfg_dn.backend)
        if need_h:
            # dh = dy @ W_down in gu's dtype (the dtype h had), then d(gu) straight to e5m2
            dh = scaled_mm(gq, vq_t.t(), g_inv, v_inv, gu.dtype,
                           use_fast_accum=cfg_dn.fast_accum_backward, backend=cfg_dn.backend)
            sg = gate_up._scalers["grad"]
            dq, dq_t, d_inv = sg.scaled(
                lambda src, amax_out: swiglu_fp8_backward(
                    dh, gu, sg.fmt.dtype, src, write_q=need_x, write_qt=need_wgu,
                    amax_out=amax_out, use_triton=use),
                lambda: swiglu_fp8_backward_amax(dh, gu, use_triton=use),
                update=True, device=gu.device)
            if need_x:  # (T, 2i) @ (2i, d)
                dx = scaled_mm(dq, wq_t.t(), d_inv, w_inv, ctx.x_dtype,
                               use_fast_accum=cfg_gu.fast_accum_backward,
                               backend=cfg_gu.backend)
            if need_wgu:  # (2i, T_pad) @ (T_pad, d)
                dw_gu = scaled_mm(dq_t, xq_t.t(), d_inv, x_inv, gate_up.weight.dtype,
                                  use_fast_accum=cfg_gu.fast_accum_backward,
                                  backend=cfg_gu.backend)
        # through the norm, when there is one: dx, dresidual, dnorm_weight
        grads_in = fp8_norm.input_grads(dx, dstream, norm_saved, ctx.x_shape,
                                        ctx.needs_input_grad[:3])
        return *grads_in, dw_gu, dw_dn, None, None, None, None, None


def fp8_swiglu_mlp(x: torch.Tensor, gate_up_proj: Fp8Linear, down_proj: Fp8Linear,
                   norm=None, residual: torch.Tensor | None = None):
    """down_proj(swiglu(gate_up_proj(x))) for x (..., d) -> (..., d) through
    `Fp8SwiGLUMLPFunction`; the output in the autocast dtype when autocast is on, else
    in x's dtype (as the composed path).

    With `norm` (an `RMSNorm`; `fusable(..., norm=norm)`) the MLP's input is
    norm(x + residual) (residual None: norm(x)), written in fp8 by the norm kernel
    (`ops.fp8_norm`), and the stream x + residual (x without a residual) is returned
    too: (y, h)."""
    out_dtype = autocast_state.current_dtype(x.device.type) or \
        fp8_norm.normed_dtype(x, residual)
    update = torch.is_grad_enabled()  # evaluation does not move the amax histories
    norm_weight, eps = (None, None) if norm is None else (norm.weight, norm.eps)
    with autocast_state.off(x.device.type):
        y, stream = Fp8SwiGLUMLPFunction.apply(x, residual, norm_weight, gate_up_proj.weight,
                                               down_proj.weight, gate_up_proj, down_proj,
                                               eps, out_dtype, update)
    if norm is None:
        return y
    return y, x if stream is None else stream
