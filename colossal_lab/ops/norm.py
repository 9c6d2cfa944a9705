"""RMSNorm and LayerNorm, the ops of switch 2 (`enable_fused_normalization`), one kernel each.

RMSNorm (LLaMA; Zhang & Sennrich 2019) and LayerNorm (Ba et al. 2016) over the last
dimension H::

    RMSNorm:    y = x · r · w,            r = (mean(x²) + eps)^(-1/2)
    LayerNorm:  y = (x − μ) · r · w + b,  μ = mean(x),  r = (mean((x − μ)²) + eps)^(-1/2)

**Why eager normalisation is memory-bound.** Per element these do a handful of FLOPs,
while an H200 does ~200 bf16 FLOPs in the time it moves one byte, so the cost is the
bytes moved. Eager `rms_norm_ref` is eight kernels, six of them full passes, several
over fp32 intermediates. Bytes per element of a bf16 x (N elements;
`benchmarks.fused_norm.traffic_bytes` counts them op by op)::

    version                          forward                  backward
    eager RMSNorm (rms_norm_ref)     36 N bytes, 8 kernels    92 N bytes, 16 kernels
    eager LayerNorm (layer_norm_ref) 52 N bytes, 11 kernels  122 N bytes, 21 kernels
    fused (one pass each way)         4 N bytes, 1 kernel      6 N bytes + dw partials

The fused residual add (`add_rms_norm`, "triton") also folds the pre-norm block's
`h = x + residual` into the same pass: 8 N bytes forward instead of 6 N + 4 N, and 8 N
backward instead of 6 N + 6 N (the two gradients of h are summed in the kernel).

Backends (`backend=`; `switches.norm` sets it on a model's norm modules):

- False / "eager": the references below (what Hugging Face LLaMA runs).
- "torch": `F.rms_norm` / `F.layer_norm` (fused kernels in recent PyTorch on CUDA).
- "compile": `torch.compile` of the reference (its backward may read x and dy twice).
- "triton": ours, `colossal_lab.kernels.rms_norm` / `layer_norm`.
- "liger": Liger-Kernel's Triton kernels; "apex": NVIDIA apex's (what ColossalAI uses).
- True: "triton" on a CUDA device, "torch" on the CPU.

A backend that is not installed (or needs a GPU) falls back to "torch" through
`colossal_lab.fallback`; ColossalAI instead crashes when apex is missing
(hpcaitech/ColossalAI#6260). Every backend returns x's dtype, also for an fp32 weight on a
bf16 x (autocast): there the eager reference rounds to x's dtype where Hugging Face's
would promote.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab import kernels
from colossal_lab.fallback import fallback
from colossal_lab.kernels.layer_norm import layer_norm_triton
from colossal_lab.kernels.rms_norm import add_rms_norm_triton, rms_norm_triton

BACKENDS = ("eager", "torch", "compile", "triton", "liger", "apex")
FUSES_ADD = (True, "triton", "compile")
"""Values whose `add_rms_norm` adds the residual in the norm's own pass; with these the
model also hands each layer's last residual add to the next norm (`LlamaModel`)."""


# ---------------------------------------------------------------------------- references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                 ) -> torch.Tensor:
    """Eager RMSNorm as LLaMA writes it: statistics in fp32, cast back, then scale.

    x: (..., H); weight: (H,). Returns x's dtype (see the module docstring)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype)).to(dtype)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Eager LayerNorm in the same style: mean and biased variance in fp32, cast back,
    then the affine map. x: (..., H); weight, bias: (H,). Returns x's dtype."""
    dtype = x.dtype
    xf = x.float()
    xc = xf - xf.mean(-1, keepdim=True)
    xf = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    if bias is not None:
        y = y + bias
    return y.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rms_norm_ref(h), h)."""
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


# ------------------------------------------------------------------------------ dispatch


@functools.cache
def _liger(op: str):
    """Liger's autograd Function for `op`, or None when Liger is not installed."""
    try:
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction as fn
        elif op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction as fn
        else:
            from liger_kernel.ops.fused_add_rms_norm import (
                LigerFusedAddRMSNormFunction as fn,
            )
    except ImportError:
        return None
    return fn


@functools.cache
def _apex():
    """apex's fused_layer_norm module, or None (also when apex was installed without
    its CUDA extension, which the module only imports on first use)."""
    try:
        import fused_layer_norm_cuda  # noqa: F401
        from apex.normalization import fused_layer_norm
    except ImportError:
        return None
    if not hasattr(fused_layer_norm, "fused_rms_norm_affine"):
        return None
    return fused_layer_norm


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def available_backends(device=None) -> list[str]:
    """Backends that run on `device` (default: CUDA when present, else CPU) without
    falling back. "triton" on the CPU runs under Triton's interpreter (slow, exact)."""
    on_gpu = _device_type(device) == "cuda"
    out = ["eager", "torch", "compile"]
    if kernels.runs_on(_device_type(device)):  # CPU tensors: only under the interpreter
        out.append("triton")
    if on_gpu and _liger("rms_norm") is not None:
        out.append("liger")
    if on_gpu and _apex() is not None:
        out.append("apex")
    return out


def resolve_backend(backend, device=None) -> str:
    """Map the switch value (False / None / True / a name in `BACKENDS`) to a backend
    that runs on `device`; one that cannot becomes "torch" through `colossal_lab.fallback`
    (one warning, or `BackendUnavailable` in strict mode)."""
    if backend is False or backend is None:
        return "eager"
    if backend is True:
        return "triton" if _device_type(device) == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown normalization backend {backend!r}; choose from "
                         f"{BACKENDS}, True (best available) or False (eager)")
    if backend in ("eager", "torch", "compile"):
        return backend
    if backend == "triton":  # every call asks: the one check, not the whole list
        if kernels.runs_on(_device_type(device)):
            return backend
    if backend in available_backends(device):
        return backend
    why = {"triton": "needs a CUDA device or TRITON_INTERPRET=1",
           "liger": "needs liger-kernel (pip install liger-kernel) and a CUDA device",
           "apex": "needs NVIDIA apex built with its CUDA extensions and a CUDA device"}
    fallback(f"normalization backend {backend!r} {why[backend]}", "torch")
    return "torch"


def _in_dtype(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Parameters cast to x's dtype (a no-op unless autocast keeps them fp32): the
    library kernels then take their fast, single-dtype path and return x's dtype."""
    return p if p is None or p.dtype == x.dtype else p.to(x.dtype)


@functools.cache
def _compiled(name: str):
    """torch.compile of a reference, made once per process (dynamo caches per shape)."""
    fn = {"rms_norm": rms_norm_ref, "layer_norm": layer_norm_ref,
          "add_rms_norm": add_rms_norm_ref}[name]
    return torch.compile(fn)


def _run_compiled(name: str, torch_fn, *args):
    try:
        return _compiled(name)(*args)
    except Exception as e:  # no C++ compiler, an unsupported torch build, ...
        fallback(f"torch.compile of the {name} reference failed ({type(e).__name__}: "
                 f"{str(e)[:200]})", "torch")
        return torch_fn(*args)


def _rms_torch(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), _in_dtype(weight, x), eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend=True) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: (..., H), fp32 / fp16 / bf16.
        weight: (H,), fp32 or x's dtype.
        eps: added to mean(x²).
        backend: False (eager), True (best available) or a name in `BACKENDS`.
    Returns:
        (..., H) in x's dtype.
    """
    name = resolve_backend(backend, x.device)
    if name == "eager":
        return rms_norm_ref(x, weight, eps)
    if name == "triton":
        return rms_norm_triton(x, weight, eps)
    if name == "compile":
        return _run_compiled("rms_norm", _rms_torch, x, weight, eps)
    if name == "liger":
        return _liger_rms(x, _in_dtype(weight, x), eps)
    if name == "apex":
        return _apex().fused_rms_norm_affine(x, _in_dtype(weight, x), (x.shape[-1],), eps)
    return _rms_torch(x, weight, eps)


def _liger_rms(x, weight, eps):
    fn = _liger("rms_norm")
    try:  # offset 0, LLaMA casting, dx not written into dy (dy may be shared)
        return fn.apply(x, weight, eps, 0.0, "llama", False)
    except TypeError:  # older Liger: (X, W, eps) only
        return fn.apply(x, weight, eps)


def _layer_torch(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), _in_dtype(weight, x), _in_dtype(bias, x), eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5, backend=True) -> torch.Tensor:
    """LayerNorm over the last dimension.

    Args:
        x: (..., H), fp32 / fp16 / bf16.
        weight: (H,); bias: (H,) or None; fp32 or x's dtype.
        eps: added to the (biased) variance.
        backend: False (eager), True (best available) or a name in `BACKENDS`.
    Returns:
        (..., H) in x's dtype.
    """
    name = resolve_backend(backend, x.device)
    if name == "eager":
        return layer_norm_ref(x, weight, bias, eps)
    if name == "triton":
        return layer_norm_triton(x, weight, bias, eps)
    if name == "compile":
        return _run_compiled("layer_norm", _layer_torch, x, weight, bias, eps)
    if name == "liger":
        b = _in_dtype(bias, x) if bias is not None else x.new_zeros(x.shape[-1])
        return _liger("layer_norm").apply(x, _in_dtype(weight, x), b, eps)
    if name == "apex":
        w = _in_dtype(weight, x)
        if bias is None:
            return _apex().fused_layer_norm_affine(x, w, torch.zeros_like(w),
                                                   (x.shape[-1],), eps)
        return _apex().fused_layer_norm_affine(x, w, _in_dtype(bias, x), (x.shape[-1],),
                                               eps)
    return _layer_torch(x, weight, bias, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6, backend=True) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rms_norm(h), h).

    "triton" does both in one kernel (forward and backward), "liger" uses Liger's fused
    add when it has one, "compile" compiles the pair; the others add, then normalise.
    x, residual: (..., H) of one shape; weight: (H,). Both outputs in the dtype of
    `x + residual` (fp32 for a bf16 x on an fp32 residual stream under autocast).
    """
    name = resolve_backend(backend, x.device)
    if name == "triton" and residual.shape == x.shape:
        return add_rms_norm_triton(x, residual, weight, eps)
    if name == "compile":
        return _run_compiled("add_rms_norm", _add_then_torch, x, residual, weight, eps)
    same = residual.dtype == x.dtype and residual.shape == x.shape
    if name == "liger" and same and _liger("add_rms_norm") is not None:
        fn = _liger("add_rms_norm")
        return fn.apply(x, residual, _in_dtype(weight, x), eps, 0.0, "llama", False)
    h = x + residual
    return rms_norm(h, weight, eps, name), h


def _add_then_torch(x, residual, weight, eps):
    h = x + residual
    return _rms_torch(h, weight, eps), h


# -------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """RMSNorm whose kernel the switch picks; state dict: `weight` (Hugging Face layout),
    the same for every backend."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`, or with `residual`: h = x + residual, returns (norm(h), h) — the
        add that precedes every norm in a pre-norm block, fused when the backend can."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.backend)
        return add_rms_norm(x, residual, self.weight, self.eps, self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend!r}"


class LayerNorm(nn.Module):
    """LayerNorm whose kernel the switch picks; state dict `weight`, `bias` (the layout
    of `nn.LayerNorm`), the same for every backend."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True,
                 backend=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.backend)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}, "
                f"backend={self.backend!r}")


