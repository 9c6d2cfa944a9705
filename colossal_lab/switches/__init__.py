"""One module per throughput switch: reference, dispatch, autograd wiring, module.

A backend asked for by name that cannot run here (a library missing, no GPU, a shape the
kernel does not take) goes through `fallback`: one warning, then the next best backend.
With ``COLOSSAL_LAB_STRICT=1`` (set for the whole test session) it raises
`BackendUnavailable` instead, so that no measurement silently times another kernel than
the one its label names. `backends_in_use` says what a model's switches resolve to.
"""

from __future__ import annotations

import os
import warnings

import torch

STRICT_ENV = "COLOSSAL_LAB_STRICT"
"""Environment variable: "1" turns every fallback into a `BackendUnavailable` error."""

WARNED: set[str] = set()
"""Messages `warn_once` has shown in this process (clear it to see them again)."""


class BackendUnavailable(RuntimeError):
    """A backend requested by name cannot run here and strict mode forbids a fallback."""


def warn_once(msg: str, stacklevel: int = 4) -> None:
    """A fallback or a kept-as-is layer is worth one warning per process, not one per
    forward pass."""
    if msg not in WARNED:
        WARNED.add(msg)
        warnings.warn(msg, stacklevel=stacklevel)


def strict() -> bool:
    """Is strict mode on (``COLOSSAL_LAB_STRICT`` set to anything but "" or "0")?"""
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


def fallback(why: str, instead: str, stacklevel: int = 5) -> None:
    """A requested backend cannot run (`why` names it and says why) and `instead` will:
    warn once, or raise `BackendUnavailable` in strict mode. Every dispatcher calls
    this, never `warnings.warn` itself."""
    if strict():
        raise BackendUnavailable(f"{why}; {STRICT_ENV}=1 refuses the fallback to "
                                 f"{instead!r} (choose a backend that runs here, or "
                                 f"unset {STRICT_ENV})")
    warn_once(f"{why}; using {instead!r}", stacklevel)


def backends_in_use(model: torch.nn.Module) -> dict:
    """The backend each switch of `model` resolves to on its device and compute dtype,
    after any fallback: what a results row should record next to the switch values.

    Keys: "attention_backend" (`attention.BACKENDS`), "norm_backend"
    (`norm.BACKENDS`), "swiglu_backend" ("eager" also for unfused projections, which
    run silu(gate)·up eagerly), "fp8_backend" ("scaled_mm", "emulate", or None when no
    linear is fp8). Read from the modules themselves, so an in-place `set_switches` is
    seen; layers that disagree are listed joined by "+"."""
    from colossal_lab.model import MLP, Attention
    from colossal_lab.switches import attention, fp8, norm, projections
    from colossal_lab.switches.precision import AUTOCAST_DTYPE

    param = next(model.parameters())
    device = param.device
    precision = getattr(getattr(model, "switches", None), "precision", None)
    dtype = AUTOCAST_DTYPE.get(precision) or param.dtype  # what q, k, v arrive in
    head_dim = getattr(getattr(model, "cfg", None), "head_dim", None)
    found: dict[str, list[str]] = {k: [] for k in ("attention_backend", "norm_backend",
                                                   "swiglu_backend", "fp8_backend")}

    def add(key, name):
        if name not in found[key]:
            found[key].append(name)

    for m in model.modules():
        if isinstance(m, Attention):
            add("attention_backend", attention.resolve_backend(
                m.attention_backend, device, dtype=dtype, head_dim=head_dim))
        elif isinstance(m, (norm.RMSNorm, norm.LayerNorm)):
            add("norm_backend", norm.resolve_backend(m.backend, device))
        elif isinstance(m, MLP):
            fused = m.fused and projections.is_fused(m.activation)
            add("swiglu_backend", projections.resolve_activation(m.activation, device)
                if fused else "eager")
        elif isinstance(m, fp8.Fp8Linear):
            add("fp8_backend", fp8.resolve_backend(m.fp8_config.backend, device))
    return {k: "+".join(v) if v else None for k, v in found.items()}
