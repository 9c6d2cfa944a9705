"""The RMSNorm in front of an fp8 projection, run inside the projection's autograd node.

In the fp8 step each decoder layer's two RMSNorms feed fp8 projections:
`input_layernorm` the qkv projection (with RoPE, `ops.fp8_qkv`), `post_attention_layernorm`
the gate/up projection (with the SwiGLU MLP, `ops.fp8_mlp`). Composed from the parts, the
norm writes y (T, d) in the activation dtype and the projection's cast reads it back for
its e4m3 copies (row-major for the forward GEMM, transposed for dW); y has no other
reader. As in Transformer Engine's LayerNormLinear, the norm here runs inside the
projection's autograd Function, which takes the norm's inputs instead of its output,
has the norm's kernel write the e4m3 copies (`kernels.rms_norm_fp8`), and returns the
new residual stream h = x + residual beside its own outputs::

    forward   x_q, x_qᵀ = e4m3(RMSNorm(x + residual) · w_n)   one kernel; h, r saved
              the projection from x_q, x_qᵀ, as before
    backward  dy_n = the projection's input gradient (its dx GEMM), as before
              dx = dresidual = r · (dy_n·w_n − x̂·c) + dh,  dw_n = Σ dy_n·x̂

with x̂ = h · r and c = mean(dy_n · w_n · x̂): the norm's own backward (`kernels.rms_norm`),
which reads h and r, never y. At llama-7b (16,384 tokens, d = 4096, bf16) this saves
writing y and reading it back: 4 bytes an element, 0.27 GB a norm, two norms a layer.

This module holds what the two Functions share: `cast_input`, the first step of their
forward (the input's e4m3 copies, with or without a norm), and `input_grads`, the last
step of their backward; and `fusable`.

**Scaling.** The cast is the projection's "x" role, run through its `_Scaler`
(`ops.fp8`) with the kernel's cast and amax-only modes, so delayed and dynamic scaling,
the replay under gradient checkpointing and evaluation (`update=False`: histories stay)
behave as in the composed path. The kernel rounds y to the norm's output dtype before
the cast and reduces each row as the norm kernel does, so the fp8 bits, h, r, the
amaxes and every gradient are the composed path's.

**When.** `fusable`: the norm is an `RMSNorm` whose backend resolves to "triton" (our
kernel, which also fuses the residual add: `norm.FUSES_ADD`), without module hooks, and
the projection's `Fp8Config.fuse_norm` (`Switches.extra["fp8_fuse_norm"]`, off by
default: on a GPU it runs level with the composed path); the model asks through
`fp8_qkv.fusable` / `fp8_mlp.fusable` with `norm=`, so the projection's own path must be
fusable too.
"""

from __future__ import annotations

import torch

from colossal_lab.kernels._norm_common import as_rows
from colossal_lab.kernels.rms_norm import add_rms_norm_backward
from colossal_lab.kernels.rms_norm_fp8 import rms_norm_fp8, rms_norm_fp8_amax
from colossal_lab.ops.norm import RMSNorm
from colossal_lab.ops.norm import resolve_backend as resolve_norm


def fusable(norm, proj, device) -> bool:
    """Can `norm` write the fp8 input of `proj` (an `Fp8Linear`) inside its Function?"""
    if not isinstance(norm, RMSNorm) or not proj.fp8_config.fuse_norm:
        return False
    if norm._forward_hooks or norm._forward_pre_hooks:  # they would not run
        return False
    return resolve_norm(norm.backend, device) == "triton"


def normed_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype the norm returns y and h in: that of x + residual (x's without one)."""
    return x.dtype if residual is None else torch.result_type(x, residual)


def cast_input(scaler, x, residual, norm_weight, eps, *, update: bool, write_t: bool):
    """The first step of an fp8 projection's forward: its input's e4m3 copies in
    `scaler`'s format and scale. Returns ((q, qt, inv_scale), h, saved).

    Without a norm (`norm_weight` None) the input is x (…, d), cast by `_Scaler.cast`:
    h None, saved (). With one it is RMSNorm(x + residual) · norm_weight (residual None:
    of x) with `eps`, cast by the norm kernel as it normalises: h = x + residual (…, d)
    as the norm returns it (None without a residual), and `saved` what `input_grads`
    needs (h or x, the weight, r), for the Function's `save_for_backward`. q (T, d),
    qt (d, T_pad) (None unless `write_t`), inv_scale (1,) fp32 as `fp8_cast_transpose`
    returns them."""
    x2 = x.reshape(-1, x.shape[-1])  # (T, d)
    if norm_weight is None:
        return scaler.cast(x2, update=update, write_yt=write_t), None, ()
    res2 = None if residual is None else residual.reshape(-1, x.shape[-1])
    # The norm resolved to Triton (`fusable`), so its kernel runs here (a GPU, or the
    # interpreter); use_triton=False in the config asks for torch ops instead.
    use = scaler.module.fp8_config.use_triton
    use = True if use is None else use
    q, qt, inv, h, rstd = scaler.scaled(
        lambda src, amax_out: rms_norm_fp8(x2, res2, norm_weight, eps, scaler.fmt.dtype,
                                           src, write_qt=write_t, amax_out=amax_out,
                                           use_triton=use),
        lambda: rms_norm_fp8_amax(x2, res2, norm_weight, eps, use_triton=use),
        update=update, device=x.device)
    saved = (x2 if h is None else h, norm_weight.contiguous(), rstd)
    return (q, qt, inv), None if h is None else h.view(x.shape), saved


def input_grads(d_in: torch.Tensor | None, dh: torch.Tensor | None, saved: tuple,
                x_shape, needs) -> tuple:
    """The last step of the backward: (dx, dresidual, dnorm_weight) from d_in (T, d), the
    gradient of the projection's input (None when `needs` asks for none of the three),
    dh, that of h, and `cast_input`'s `saved`; a gradient `needs` (the Function's
    `needs_input_grad` of x, residual, norm weight) does not ask for is None.

    Without a norm d_in is dx. With one, the norm's backward (`kernels.rms_norm`) gives
    dx = dresidual, with dh added, and dw in the weight's dtype."""
    if d_in is None:
        return None, None, None
    if not saved:
        return d_in.view(x_shape), None, None
    xh, w, rstd = saved  # what was normalised (h, or x without a residual), w, r
    dh2 = None if dh is None else as_rows(dh, xh.shape[1])
    dx, dw = add_rms_norm_backward(d_in, xh, w, rstd, dh2)  # dh2 None: the plain norm's
    # x and residual get the same tensor, as the norm's own Function returns it
    grads = (dx.view(x_shape), dx.view(x_shape), dw)
    return tuple(g if need else None for g, need in zip(grads, needs))


def requires_grad(*tensors) -> bool:
    """Does any of `tensors` (None for an absent one) need a gradient?"""
    return any(t is not None and t.requires_grad for t in tensors)
