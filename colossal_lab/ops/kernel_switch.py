"""The one rule by which a switch whose fast path is our Triton kernel picks its backend.

Used by SwiGLU, RoPE, the fused loss, the embedding and the optimizer:

    False / None  -> `off` (the eager reference)
    True          -> "triton" on a CUDA device, `cpu` elsewhere
    "triton"      -> "triton" where our kernels run (a GPU, or CPU tensors under
                     Triton's interpreter); elsewhere `cpu`, through `fallback`
                     (one warning, or `BackendUnavailable` under COLOSSAL_LAB_STRICT=1)
    another name  -> itself, when it is in `names`
"""

from __future__ import annotations

import torch

from colossal_lab import kernels
from colossal_lab.fallback import fallback


def check_value(value, names: tuple[str, ...], field: str) -> None:
    """A clear ValueError unless `value` is True, False, None or one of `names`."""
    if not (value is True or value is False or value is None or value in names):
        raise ValueError(f"{field}={value!r}; choose False (off), True (best available) "
                         f"or one of {names}")


def resolve(value, device, *, names: tuple[str, ...], field: str, what: str,
            off: str = "eager", cpu: str = "eager") -> str:
    """The backend `value` picks on `device` (see the module docstring); `what` names
    the kernel in the fallback message."""
    check_value(value, names, field)
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if value is False or value is None:
        return off
    if value is True:
        return "triton" if dev.type == "cuda" else cpu
    if value == "triton" and not kernels.runs_on(dev):
        fallback(f"{what} backend 'triton' needs a CUDA device or TRITON_INTERPRET=1", cpu)
        return cpu
    return value


def set_on_modules(model, attribute: str, value) -> int:
    """Set `attribute` to `value` on every module of `model` whose class declares it
    (the model's `Attention.attention_backend`, `Attention.rope_backend`,
    `LlamaForCausalLM.loss_backend`); returns how many modules were set. How the
    kernel switches reach the model without the switch modules importing it."""
    count = 0
    for m in model.modules():
        if hasattr(type(m), attribute):
            setattr(m, attribute, value)
            count += 1
    return count
