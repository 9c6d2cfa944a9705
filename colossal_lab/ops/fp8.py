"""fp8 linear layers (part of switch 6, `precision="fp8"`): a linear's three GEMMs in 8 bits.

**Formats** (Micikevicius et al., "FP8 Formats for Deep Learning", 2022; OCP FP8 spec):
E4M3 (`torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa, largest 448, no infinities)
keeps more precision and is used for activations and weights in the forward; E5M2
(`torch.float8_e5m2`: largest 57344) keeps more range and is used for gradients, whose
magnitudes spread wider. Neither covers the range of bf16, so every tensor is
multiplied by a **per-tensor scale** before the cast and the GEMM multiplies the result
by the inverse scales::

    s_x = 448 / amax(x)      s_w = 448 / amax(W)      s_g = 57344 / amax(dy)
    y  = (q(x·s_x) @ q(W·s_w)ᵀ) / (s_x s_w)                    e4m3 × e4m3
    dx = (q(dy·s_g) @ q(W·s_w)) / (s_g s_w)                    e5m2 × e4m3
    dW = (q(dy·s_g)ᵀ @ q(x·s_x)) / (s_g s_x)                   e5m2 × e4m3

**Scaling.** *Dynamic*: amax of the tensor being cast (one extra read of it; what
torchao's "tensorwise" recipe does). *Delayed* (Transformer Engine's default): the
largest amax over a short history of previous casts, so the cast is one pass and
writes this tensor's amax for the next step; an outlier larger than the history
saturates once. Choose with `Fp8Config.scaling` or `Switches.extra["fp8_scaling"]`.
The history is a ring on the device, its write position a device tensor advanced by a
kernel (`_Scaler`), so a step replayed as a CUDA graph (`switches.step_graph`) fills the
next slot on every replay, as eager steps do.

**Layouts.** `torch._scaled_mm` takes A row-major and B column-major; the cast kernel
(`kernels.fp8_cast`) writes each tensor and its transpose in one pass, so the backward
keeps fp8 Wᵀ and xᵀ (half a bf16 linear's activation memory). y and dx come out in the
autocast dtype, dW in the weight's. Fast accumulation is on for the forward GEMM and off
for the backward ones, as in torchao: dW sums over every token, where Hopper's fp8
accumulator loses bits (DeepSeek-V3 report, §3.3.2).

**Where it does not run.** fp8 tensor cores need compute capability 8.9 or more (a clear
error elsewhere). `_scaled_mm` needs multiples of 16: a linear whose features are not
stays a plain `nn.Linear`, with one warning (ColossalAI's FP8 path crashes there,
hpcaitech/ColossalAI#6390); a token count that is not is zero-padded. On a CPU the GEMMs
are *emulated* (quantise, dequantise, fp32 matmul), so every scaling rule runs in CI.
`switches.fp8` swaps a model's linears for `Fp8Linear`.

References: Micikevicius et al. 2022 (arXiv:2209.05433); NVIDIA Transformer Engine
(delayed scaling); torchao.float8 (tensorwise dynamic scaling); `torch._scaled_mm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from colossal_lab.kernels.fp8_cast import (
    EPS,
    advance_history,
    fp8_amax,
    fp8_cast_transpose,
    padded,
)
from colossal_lab.ops import autocast_state
from colossal_lab.ops.replay import current_replay


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit float format: its torch dtype and the constants scaling needs."""

    name: str
    dtype: torch.dtype
    max: float
    """Largest finite value: the scale maps amax here."""


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, torch.finfo(torch.float8_e5m2).max)

SCALINGS = ("dynamic", "delayed")
BACKENDS = ("auto", "scaled_mm", "emulate")


@dataclass(frozen=True)
class Fp8Config:
    """How the fp8 linears scale and compute. `Switches.extra` keys in brackets."""

    scaling: str = "dynamic"
    """"dynamic" (amax of the tensor itself) or "delayed" (amax history) [fp8_scaling]."""
    history_len: int = 16
    """Entries of the amax history under delayed scaling [fp8_history]."""
    fast_accum_forward: bool = True
    """Hopper's fast fp8 accumulation in the forward GEMM."""
    fast_accum_backward: bool = False
    """... and in the two backward GEMMs (long reductions) [fp8_fast_accum_backward]."""
    backend: str = "auto"
    """"scaled_mm" (the GPU), "emulate" (CPU arithmetic), "auto": by device [fp8_backend]."""
    use_triton: bool | None = None
    """Cast kernel: None = Triton on CUDA, torch elsewhere."""
    fuse_mlp: bool = True
    """A fused-projection MLP with the Triton SwiGLU casts h and d(gate_up) to fp8
    inside the SwiGLU kernels (`ops.fp8_mlp`) [fp8_fuse_mlp]."""
    fuse_rope: bool = True
    """A fused qkv projection followed by the Triton RoPE casts its output gradient to
    fp8 inside RoPE's backward kernel (`ops.fp8_qkv`) [fp8_fuse_rope]."""
    fuse_norm: bool = False
    """The Triton RMSNorm in front of a fused qkv (with RoPE) or gate/up projection
    writes that projection's fp8 input itself (`ops.fp8_norm`) [fp8_fuse_norm]. Off by
    default: it saves the bf16 write and read of y, but its kernel streams at ~71% of
    the copy rate where the norm and the cast reach ~94%, so at llama-7b the nodes run
    level with the composed path (H100)."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling={self.scaling!r}; choose one of {SCALINGS}")
        if self.backend not in BACKENDS:
            raise ValueError(f"fp8 backend={self.backend!r}; choose one of {BACKENDS}")
        if self.history_len < 1:
            raise ValueError(f"fp8 history_len={self.history_len} must be >= 1")

    @classmethod
    def from_extra(cls, extra: dict) -> Fp8Config:
        """The config named by `Switches.extra` (keys fp8_scaling, fp8_history,
        fp8_fast_accum_backward, fp8_backend, fp8_fuse_mlp, fp8_fuse_rope,
        fp8_fuse_norm)."""
        kw = {}
        for key, name in (("fp8_scaling", "scaling"), ("fp8_history", "history_len"),
                          ("fp8_fast_accum_backward", "fast_accum_backward"),
                          ("fp8_backend", "backend"), ("fp8_fuse_mlp", "fuse_mlp"),
                          ("fp8_fuse_rope", "fuse_rope"), ("fp8_fuse_norm", "fuse_norm")):
            if key in extra:
                kw[name] = extra[key]
        return cls(**kw)


# ------------------------------------------------------------------ scaling, reference


def amax_to_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """scale = fp8_max / max(amax, eps), fp32 (amax: any shape; its max is used)."""
    amax = amax.float().max().clamp(min=EPS)
    return torch.full_like(amax, fmt.max) / amax  # one IEEE division, as in the kernel


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """q = fp8(clamp(x · scale, ±max)): round to nearest even, saturating."""
    return (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ≈ q / scale."""
    return (q.float() * (torch.ones_like(scale) / scale)).to(dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor | None = None):
    """The fp8 linear's math in plain torch, from the module docstring: quantise with
    dynamic per-tensor scales, dequantise, multiply in fp32. x (..., K), weight (N, K).

    Returns y (..., N); with `dy` (..., N) also the gradients: (y, dx, dW)."""
    def fake(t, fmt):  # quantise and dequantise in fp32
        s = amax_to_scale(t.abs().amax(), fmt)
        return dequantize(quantize(t, s, fmt), s)

    xq, wq = fake(x.reshape(-1, x.shape[-1]), E4M3), fake(weight, E4M3)
    y = (xq @ wq.t()).view(*x.shape[:-1], weight.shape[0])
    if dy is None:
        return y
    gq = fake(dy.reshape(-1, dy.shape[-1]), E5M2)
    return y, (gq @ wq).view(x.shape), gq.t() @ xq


# ------------------------------------------------------------------------- the GEMMs


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_fp8_supported(device: torch.device | str) -> None:
    """Raise early, saying what to change, on a CUDA GPU without fp8 tensor cores."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    cap = _capability(device)
    if tuple(cap) < (8, 9):
        raise RuntimeError(
            f"precision='fp8' needs fp8 tensor cores (compute capability >= 8.9: "
            f"Ada, Hopper or newer); this GPU is sm_{cap[0]}{cap[1]}. Use precision="
            f"'bf16', or Fp8Config(backend='emulate') to test the scaling logic slowly.")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The GEMM path `backend` takes for tensors on `device`: "auto" is "scaled_mm" on
    CUDA and "emulate" elsewhere; the named ones run as asked ("scaled_mm" on a CPU is
    torch's CPU kernel; a GPU without fp8 tensor cores is refused when building)."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend={backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "scaled_mm" if torch.device(device).type == "cuda" else "emulate"
    return backend


def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_scale_a: torch.Tensor,
              inv_scale_b: torch.Tensor, out_dtype: torch.dtype, *,
              use_fast_accum: bool = False, backend: str = "auto") -> torch.Tensor:
    """out = (a · inv_scale_a) @ (b · inv_scale_b) in `out_dtype`, a (M, K) fp8
    row-major, b (K, N) fp8 column-major, inverse scales fp32 with one element.

    The layout and multiple-of-16 rules of `torch._scaled_mm` are checked on every
    backend, so a CPU test catches what would fail on the GPU. Handles both return
    conventions of `_scaled_mm` (a tuple (out, amax) before torch 2.4, a tensor since).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError(f"scaled_mm needs a row-major (strides {a.stride()}) and b "
                         f"column-major (strides {b.stride()})")
    if a.shape[1] % 16 or b.shape[1] % 16:
        raise ValueError(f"scaled_mm needs K={a.shape[1]} and N={b.shape[1]} to be "
                         "multiples of 16")
    if resolve_backend(backend, a.device) == "emulate":
        out = (a.float() @ b.float()) * (inv_scale_a.float() * inv_scale_b.float())
        return out.to(out_dtype)
    out = torch._scaled_mm(a, b, scale_a=inv_scale_a, scale_b=inv_scale_b,
                           out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------- scaling state


class _Scaler:
    """Scale bookkeeping of one tensor role ("x", "w" or "grad") of one layer.

    Dynamic: every cast reduces the amax first. Delayed: the scale comes from the
    module's amax-history buffer; the first cast (empty history) is dynamic; each
    cast (while training) writes its amax into the ring. Nothing here syncs the host.

    The ring is device state: the history, the slot the next amax goes to (`position`,
    a (1,) int64 tensor) and the (1,) fp32 `amax_out` the cast reduces into, all
    non-persistent buffers of the module (`.to()` moves them; a plain `nn.Linear` loads
    the state dict). A cast writes its amax into amax_out and one launch
    (`kernels.fp8_cast.advance_history`) files it at `position`, zeroes amax_out and
    advances the position, so a step replayed as a CUDA graph fills a new slot each
    replay. The one host-side flag, `seen`, changes once: at the first cast, which runs
    eagerly before any capture (a capture that meets it is refused).

    Under gradient checkpointing a layer's forward runs twice; the recompute takes the
    scale source the original forward used (`replay.Replay`), so it quantises
    bit for bit as the forward did and the history advances once per step."""

    def __init__(self, module: Fp8Linear, role: str, fmt: Fp8Format):
        self.module, self.role, self.fmt = module, role, fmt
        self.seen = False

    @property
    def history(self) -> torch.Tensor:
        return getattr(self.module, f"amax_history_{self.role}")

    @property
    def position(self) -> torch.Tensor:
        """(1,) int64 on the history's device: the slot the next amax is written to."""
        return getattr(self.module, f"amax_pos_{self.role}")

    @property
    def amax_out(self) -> torch.Tensor:
        """(1,) fp32, zero between casts: a delayed cast's amax, until filed."""
        return getattr(self.module, f"amax_out_{self.role}")

    @property
    def pos(self) -> int:
        """`position` read by the host (a synchronisation: checkpoints and tests only)."""
        return int(self.position.item())

    @pos.setter
    def pos(self, value: int) -> None:
        self.position.fill_(int(value) % self.history.numel())

    def cast(self, t: torch.Tensor, *, update: bool, write_y: bool = True,
             write_yt: bool = True):
        """`fp8_cast_transpose` of t in this role's format and scale: (y, yt, inv)."""
        use = self.module.fp8_config.use_triton
        return self.scaled(
            lambda src, amax_out: fp8_cast_transpose(
                t, self.fmt.dtype, src, write_y=write_y, write_yt=write_yt,
                use_triton=use, amax_out=amax_out),
            lambda: fp8_amax(t, use_triton=use), update=update, device=t.device)

    def scaled(self, cast, amax, *, update: bool, device):
        """Run one cast of this role with its scale source and history bookkeeping.

        `cast(src, amax_out)` must quantise with scale = fmt.max / max(src) and, when
        `amax_out` (a zeroed (1,) fp32 tensor) is given, reduce the tensor's amax into
        it; `amax()` returns that amax as a (1,) fp32 tensor (dynamic scaling's first
        pass). Whatever `cast` returns is returned. A fused kernel that casts a tensor it
        computes (`ops.fp8_mlp`) passes its own pair and shares the rest: dynamic or
        delayed source, the replay under checkpointing, the history ring."""
        delayed = self.module.fp8_config.scaling == "delayed"
        amax_out = None
        replay = current_replay()  # inside a checkpointed layer?
        recompute = replay is not None and replay.recomputing
        if recompute:  # the scale of the original forward; the history moves once
            src = replay.take(self)
        elif delayed and self.seen:
            src = self.history
            if update:
                amax_out = self.amax_out
        else:
            if delayed and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"fp8 delayed scaling: the first cast of {self.role!r} in "
                    f"{type(self.module).__name__} (dynamic, it starts the amax history) "
                    "would be captured into a CUDA graph and replayed forever; run one "
                    "step eagerly before capturing (`GraphedStep` does)")
            src = amax_out = amax()
        if replay is not None and not recompute:  # a snapshot: the history changes below
            replay.put(self, src.clone())
        out = cast(src, None if amax_out is src else amax_out)
        if delayed and not recompute and (update or not self.seen):
            # amax_out is the persistent buffer (zeroed for the next cast) or, at the
            # first cast, the dynamic amax, a temporary left as it is
            advance_history(self.history, amax_out, self.position,
                            reset=amax_out is not src,
                            use_triton=self.module.fp8_config.use_triton)
            self.seen = True
        return out


def fusable_linear(m, flag: str) -> bool:
    """Is `m` an `Fp8Linear` a fused node may run in its place: no bias, no module hooks
    (they would not run), and its config's `flag` ("fuse_mlp", "fuse_rope") on?"""
    return (isinstance(m, Fp8Linear) and m.bias is None and getattr(m.fp8_config, flag)
            and not (m._forward_hooks or m._forward_pre_hooks))


# ----------------------------------------------------------------- autograd Function


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ Wᵀ with all three GEMMs in fp8 (module docstring); `module` holds the
    scaling state and config."""

    @staticmethod
    def forward(ctx, x, weight, module, out_dtype, update):
        cfg = module.fp8_config
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        # x: e4m3 row-major for this GEMM, xᵀ (K, M_pad) kept for dW
        xq, xq_t, x_inv = module._scalers["x"].cast(
            x2, update=update, write_yt=update and weight.requires_grad)
        # W: e4m3 (N, K) row-major, viewed as the column-major Wᵀ; Wᵀ (K, N) kept for dx
        wq, wq_t, w_inv = module._scalers["w"].cast(
            weight, update=update, write_yt=update and x.requires_grad)
        y = scaled_mm(xq, wq.t(), x_inv, w_inv, out_dtype,
                      use_fast_accum=cfg.fast_accum_forward, backend=cfg.backend)
        ctx.save_for_backward(xq_t, wq_t, x_inv, w_inv)
        ctx.module, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = module, x.shape, x.dtype, \
            weight.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xq_t, wq_t, x_inv, w_inv = ctx.saved_tensors
        module = ctx.module
        cfg = module.fp8_config
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
        # dy: e5m2 row-major for dx, dyᵀ (N, M_pad) row-major for dW, one pass
        gq, gq_t, g_inv = module._scalers["grad"].cast(dy2, update=True, write_y=need_dx,
                                                       write_yt=need_dw)
        dx = dw = None
        if need_dx:  # (M, N) @ (N, K): B = W column-major = (Wᵀ)ᵀ
            dx = scaled_mm(gq, wq_t.t(), g_inv, w_inv, ctx.x_dtype,
                           use_fast_accum=cfg.fast_accum_backward, backend=cfg.backend)
            dx = dx.view(ctx.x_shape)
        if need_dw:  # (N, M_pad) @ (M_pad, K): B = x column-major = (xᵀ)ᵀ; pads add 0
            dw = scaled_mm(gq_t, xq_t.t(), g_inv, x_inv, ctx.w_dtype,
                           use_fast_accum=cfg.fast_accum_backward, backend=cfg.backend)
        return dx, dw, None, None, None


def fp8_linear(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """The fp8 GEMMs of `module` applied to x (..., K) -> (..., N), without bias. Output
    in the autocast dtype when autocast is on, else in x's dtype."""
    out_dtype = autocast_state.current_dtype(x.device.type) or x.dtype
    update = torch.is_grad_enabled()  # evaluation does not move the amax histories
    with autocast_state.off(x.device.type):
        return Fp8LinearFunction.apply(x, module.weight, module, out_dtype, update)


# ----------------------------------------------------------------------------- module


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose matmuls run in fp8; same parameters, same state dict.

    Build with `Fp8Linear.from_linear(linear)` (shares the Parameter objects) or let
    `convert_to_fp8` swap every eligible linear of a model. The amax histories, their
    ring positions and the casts' amax outputs are non-persistent buffers: checkpoints
    stay loadable by plain `nn.Linear`s (`training.checkpoint` saves the histories and
    `scaling_state` beside the state dict)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, config: Fp8Config | None = None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if in_features % 16 or out_features % 16:
            raise ValueError(f"Fp8Linear({in_features}, {out_features}): fp8 GEMMs need "
                             "in and out features to be multiples of 16; keep nn.Linear")
        self.fp8_config = config or Fp8Config()
        hist_device = device if device is not None and torch.device(device).type != "meta" \
            else None
        self._init_state(hist_device or self.weight.device)

    def _init_state(self, device) -> None:
        """Per role: the amax history (n,) fp32, the ring's next slot (1,) int64 and the
        cast's amax (1,) fp32: 4n + 12 bytes, non-persistent buffers."""
        n = self.fp8_config.history_len
        for role in ("x", "w", "grad"):
            for name, shape, dtype in (("amax_history", n, torch.float32),
                                       ("amax_pos", 1, torch.int64),
                                       ("amax_out", 1, torch.float32)):
                self.register_buffer(f"{name}_{role}",
                                     torch.zeros(shape, dtype=dtype, device=device),
                                     persistent=False)
        self._scalers = {"x": _Scaler(self, "x", E4M3), "w": _Scaler(self, "w", E4M3),
                         "grad": _Scaler(self, "grad", E5M2)}

    def scaling_state(self) -> dict:
        """Where each delayed-scaling history writes next and whether it has started, as
        plain Python values a checkpoint keeps next to the amax histories (buffers). The
        positions live on the device: reading them synchronises, once per save."""
        return {role: {"pos": s.pos, "seen": s.seen} for role, s in self._scalers.items()}

    def load_scaling_state(self, state: dict) -> None:
        """Write `scaling_state()`'s values back: the positions into the device tensors
        in place, so a step already captured as a CUDA graph reads them too."""
        for role, st in state.items():
            self._scalers[role].pos, self._scalers[role].seen = st["pos"], st["seen"]

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config | None = None) -> Fp8Linear:
        """An Fp8Linear holding `linear`'s very Parameter objects (no copy)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device="meta", config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_state(linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config.scaling}"



__all__ = ["E4M3", "E5M2", "Fp8Config", "Fp8Format", "Fp8Linear", "Fp8LinearFunction",
           "amax_to_scale", "check_fp8_supported", "dequantize", "fp8_linear",
           "fp8_linear_ref", "padded", "quantize", "resolve_backend", "scaled_mm"]
