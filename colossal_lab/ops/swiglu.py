"""The SwiGLU of fused gate/up projections (switch 3, `enable_fused_projections`): three backends.

Switch 3 stacks the projections that read the same input into one GEMM each
(`ops.projections`): q/k/v into `qkv = x Wqkvᵀ` with Wqkv = [Wq; Wk; Wv], gate/up into
`gate_up`; the outputs are column slices (views). Same FLOPs; one launch instead of
three, x read once, a wider GEMM (TinyLlama's small GQA k/v GEMMs fill an H200 badly).
The cost is the backward of the split: autograd concatenates the slices' gradients unless
their producer writes one buffer, which our Triton SwiGLU does for gate/up (reads the
fused (T, 2i) output, writes the fused gradient, saves only its input).

The fused qkv weight is three row blocks, q heads, then k, then v (Hugging Face Phi-3's
`qkv_proj`, vLLM's `QKVParallelLinear`), so the Hugging Face mapping is a concatenation
and the split three views; Megatron-LM interleaves per kv group instead. The tutorial ties
switch 3 to ColossalAI's `enable_jit_fused`, which fuses bias + GeLU and bias + dropout +
add instead; ours is named for what it does.

Values of `Switches.enable_fused_projections` (applied by `switches.projections`):

- False: separate q/k/v and gate/up `nn.Linear`s, eager `silu(gate) * up`.
- "eager": fused GEMMs; the activation on views of the fused output, eager.
- "compile": fused GEMMs; `torch.compile` of the eager activation.
- "triton": fused GEMMs; our Triton SwiGLU (`kernels.swiglu`), forward and backward.
- True: "triton" on a CUDA device, "eager" on the CPU.

References: N. Shazeer, *GLU Variants Improve Transformer*, 2020; J. Ainslie et al.,
*GQA*, 2023; Liger-Kernel's `LigerSiLUMulFunction`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from colossal_lab.fallback import fallback
from colossal_lab.kernels.swiglu import swiglu_triton
from colossal_lab.ops import kernel_switch

ACTIVATIONS = ("eager", "compile", "triton")


# ---------------------------------------------------------------------------- the value


def is_fused(value) -> bool:
    """Does the switch value ask for fused GEMMs? (False / None: no.)"""
    if value is False or value is None:
        return False
    if value is True or value in ACTIVATIONS:
        return True
    raise ValueError(f"enable_fused_projections={value!r}; choose False (separate), True "
                     f"(best available) or one of {ACTIVATIONS}")


def resolve_activation(value, device=None) -> str:
    """The SwiGLU backend the switch value picks on `device`: "eager", "compile" or
    "triton" (`kernel_switch.resolve`: "triton" without a GPU or the interpreter falls
    back to "eager")."""
    is_fused(value)  # validates, with this switch's own message
    return kernel_switch.resolve(value, device, names=ACTIVATIONS,
                                 field="enable_fused_projections", what="SwiGLU")


def qkv_sizes(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Output widths of q, k, v: the row blocks of the fused weight."""
    return num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim


# ----------------------------------------------------------------------------- SwiGLU


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, eager: what Hugging Face's LlamaMLP runs (two kernels forward)."""
    return F.silu(gate) * up


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 2i) -> gate, up (..., i): views, the gate half first."""
    return gate_up.split(gate_up.shape[-1] // 2, dim=-1)


def swiglu_fused_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up from the fused (..., 2i) output, eager, on views of it."""
    return swiglu_ref(*split_gate_up(gate_up))


@functools.cache
def _compiled():
    return torch.compile(swiglu_fused_ref)


def swiglu(gate_up: torch.Tensor, backend="eager") -> torch.Tensor:
    """SwiGLU activation of the fused gate/up output.

    Args:
        gate_up: (..., 2i), the gate half first (the output of `gate_up_proj`).
        backend: "eager", "compile", "triton", or a switch value (True / False).
    Returns:
        silu(gate) · up, (..., i) in gate_up's dtype.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up has odd last dimension {gate_up.shape[-1]}; expected "
                         "[gate | up] of equal widths")
    name = resolve_activation(backend, gate_up.device)
    if name == "triton":
        return swiglu_triton(gate_up)
    if name == "compile":
        try:
            return _compiled()(gate_up)
        except Exception as e:  # no C++ compiler, an unsupported torch build, ...
            fallback(f"torch.compile of the SwiGLU failed ({type(e).__name__}: "
                     f"{str(e)[:200]})", "eager")
    return swiglu_fused_ref(gate_up)
