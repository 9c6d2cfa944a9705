"""Attention, the op of switch 1 (`enable_flash_attention`): exact, without the S×S matrix.

Naive attention materialises the scores P = softmax(QKᵀ/√d) — an (S, S) matrix per head
— writes it to memory, reads it back for PV, and keeps it for the backward: O(S²) memory
and traffic. Flash attention tiles Q, K and V, keeps a running max and sum per row
(the online softmax) and never writes P; the backward recomputes it from Q, K and the
saved log-sum-exp. Same FLOPs, O(S) memory. Dao et al., FlashAttention (2022) and
FlashAttention-2 (2023).

Here: the reference, the backends and the dispatch between them; `switches.attention`
sets the backend on a model's attention modules.

Shapes: q (B, Hq, S, D); k, v (B, Hkv, S, D) with Hq a multiple of Hkv (grouped-query
attention); output (B, Hq, S, D).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from colossal_lab import kernels
from colossal_lab.fallback import fallback
from colossal_lab.kernels.flash_attention import (
    SUPPORTED_HEAD_DIMS,
    check_shapes,
    flash_attention,
)

BACKENDS = ("naive", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-math", "cudnn",
            "triton", "flash_attn")


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv*groups, S, D): each kv head copied for its query group."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  upcast: bool = False) -> torch.Tensor:
    """Naive attention: materialise the (S, S) scores. The reference for every backend.

    `upcast=True` computes in fp32 (and returns fp32): the high-precision reference."""
    groups = check_shapes(q, k, v)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    s_q, s_k = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, S, S)
    if causal:
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v


def _sdpa(q, k, v, causal, groups):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=groups > 1)
    except TypeError:  # torch < 2.5 has no enable_gqa
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                              is_causal=causal)


def _sdpa_with(backend_name: str):
    which = {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
             "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
             "sdpa-math": SDPBackend.MATH,
             "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    return sdpa_kernel([which])


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on `device` (default: the current one)."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    out = ["naive", "sdpa", "sdpa-math"]
    if dev.type == "cuda":
        out += ["sdpa-flash", "sdpa-efficient", "cudnn"]
    if kernels.runs_on(dev):
        out.append("triton")  # on the CPU under the interpreter: correct, slow
    if dev.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            out.append("flash_attn")
        except ImportError:
            pass
    return out


def _cudnn_attention_available() -> bool:
    """cuDNN's fused attention (SDPA's CUDNN_ATTENTION): needs torch >= 2.5 built with
    cuDNN >= 9 and an Ampere or newer GPU. On an H200 it is the fastest backend we measure
    (`results/h200/flash_attention.json`)."""
    if not (torch.cuda.is_available() and hasattr(SDPBackend, "CUDNN_ATTENTION")):
        return False
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return bool(version and version >= 90000
                and torch.cuda.get_device_capability() >= (8, 0)
                and torch.backends.cuda.cudnn_sdp_enabled())


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _why_not(backend: str, dev: torch.device, dtype, head_dim) -> str | None:
    """Why the named `backend` cannot run on `dev` for this dtype and head dim (None:
    it can, or what is unknown is not checked)."""
    if backend in ("sdpa-flash", "sdpa-efficient", "cudnn") and dev.type != "cuda":
        return "needs a CUDA GPU"
    if backend == "cudnn" and not _cudnn_attention_available():
        return "needs cuDNN >= 9 attention on an Ampere or newer GPU"
    if backend == "cudnn" and dtype is not None and dtype not in _LOW_PRECISION:
        return f"has no {dtype} kernel (bf16 and fp16 only)"
    if backend == "flash_attn" and "flash_attn" not in available_backends(dev):
        return "needs flash-attn installed and a CUDA GPU"
    if backend == "triton":
        if not kernels.runs_on(dev):
            return "needs a CUDA GPU or TRITON_INTERPRET=1"
        if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
            return f"supports head_dim in {SUPPORTED_HEAD_DIMS}, not {head_dim}"
        if dtype == torch.float32 and (head_dim or 0) > 128 and not kernels.INTERPRET:
            return f"does not fit fp32 with head_dim={head_dim} in shared memory"
    return None


def resolve_backend(backend, device: torch.device | str | None = None, *,
                    dtype: torch.dtype | None = None, head_dim: int | None = None
                    ) -> str:
    """Map the switch value (False / True / name) to the backend that runs on `device`
    for inputs of `dtype` and `head_dim` (either may be None: not checked).

    True picks the fastest backend we trust: cuDNN attention on a GPU that has it (for
    bf16/fp16), else PyTorch SDPA (its own choice of flash / memory-efficient / math
    kernel). A named backend that cannot run here becomes "sdpa" through
    `colossal_lab.fallback`: one warning, or `BackendUnavailable` in strict mode."""
    if backend is False or backend is None:
        return "naive"
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if backend is True:
        low = dtype is None or dtype in _LOW_PRECISION
        return "cudnn" if dev.type == "cuda" and low and _cudnn_attention_available() \
            else "sdpa"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    why = _why_not(backend, dev, dtype, head_dim)
    if why is not None:
        fallback(f"attention backend {backend!r} {why}", "sdpa")
        return "sdpa"
    return backend


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              backend=True) -> torch.Tensor:
    """Scaled dot-product attention with a selectable backend.

    Args:
        q: (B, Hq, S, D) queries.
        k: (B, Hkv, S, D) keys; Hq must be a multiple of Hkv.
        v: (B, Hkv, S, D) values.
        causal: mask future positions.
        backend: False or "naive" (materialised scores), True (best available), or one
            of `BACKENDS`; one that cannot run here falls back (`resolve_backend`).
    Returns:
        (B, Hq, S, D), in q's dtype.
    """
    groups = check_shapes(q, k, v)
    name = resolve_backend(backend, q.device, dtype=q.dtype, head_dim=q.shape[-1])
    if name == "naive":
        return attention_ref(q, k, v, causal)
    if name == "sdpa":
        return _sdpa(q, k, v, causal, groups)
    if name in ("sdpa-flash", "sdpa-efficient", "sdpa-math", "cudnn"):
        with _sdpa_with(name):  # resolve_backend kept only those that run here
            return _sdpa(q, k, v, causal, groups)
    if name == "triton":
        return flash_attention(q, k, v, causal=causal)
    if name == "flash_attn":
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=causal)  # (B, S, H, D) layout
        return out.transpose(1, 2)
    raise AssertionError(name)


