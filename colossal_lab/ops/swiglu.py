"""Switch 3, `enable_fused_projections`: one GEMM for q/k/v, one for gate/up.

**What ColossalAI's flag does.** The seed ties this switch to `enable_jit_fused`. In
ColossalAI that flag fuses *element-wise* tails with TorchScript: bias + GeLU and
bias + dropout + residual add (`colossalai.kernel.jit`), swapped into the BERT, OPT, T5,
BLOOM, BLIP-2 … blocks by their shardformer policies; LLaMA has no biases and no
dropout, and its policy has no such branch. ColossalAI fuses QKV elsewhere: GPT-2's
`c_attn` is one (d, 3d) matrix, which tensor parallelism shards with
`GPT2FusedLinearConv1D_Col` (`n_fused=3`: each of q, k, v split on its own). Our switch
is the real thing for LLaMA, named honestly.

**The idea.** The three projections read the same normalised input x (T tokens × d)::

    q = x Wqᵀ   (T, Hq·D)        gate = x Wgᵀ  (T, i)
    k = x Wkᵀ   (T, Hkv·D)       up   = x Wuᵀ  (T, i)
    v = x Wvᵀ   (T, Hkv·D)

Stack the weights by rows and one GEMM gives all three: `qkv = x Wqkvᵀ` with
Wqkv = [Wq; Wk; Wv] of (Hq + 2·Hkv)·D rows, and q, k, v are column slices of the output
(views: no copy). The FLOPs are identical (2·T·d·N forward, N the summed output width);
what can change:

- launches: 1 kernel instead of 3 forward; backward dX = dqkv · Wqkv is one GEMM
  instead of three plus two additions (autograd accumulating dX), dW one instead of 3;
- the input x is read once instead of three times (from L2 or HBM);
- GEMM shape: N = 12288 instead of 3 × 4096 (LLaMA-7B), or N = 2560 instead of
  2048 + 512 + 512 (TinyLlama's GQA: small k/v GEMMs fill an H200's 132 SMs badly).

What it costs: the backward of the split. Autograd must hand the one dW/dX GEMM a
single (T, N) gradient, so it concatenates dq, dk, dv (a copy of T·N elements) unless
whoever produces them writes into one buffer. For gate/up our Triton SwiGLU does that:
it reads the fused (T, 2i) output and writes the fused (T, 2i) gradient, no split, no
concatenation, and it saves only its input for the backward (eager saves silu(gate)
too). A large GEMM already runs near the card's ceiling, so fusing three large GEMMs
buys little: `benchmarks.fused_qkv` measures how little.

**The GQA layout.** With Hq query heads and Hkv key/value heads of D dims the fused
weight is three row blocks (the layout of Hugging Face's Phi-3 `qkv_proj` and of
vLLM's `QKVParallelLinear`)::

    rows [0, Hq·D)                q heads 0 .. Hq−1
    rows [Hq·D, (Hq+Hkv)·D)       k heads 0 .. Hkv−1
    rows [(Hq+Hkv)·D, (Hq+2Hkv)·D) v heads 0 .. Hkv−1

Megatron-LM instead interleaves per key/value group ([q of group g; k_g; v_g] for each
g), so that a tensor-parallel column shard is one contiguous slice; with the block
layout a TP shard takes its slice of each block (what `apply_tensor_parallel` must do).
We keep the blocks because the Hugging Face mapping is then a plain concatenation, and
the split back is three views.

**Checkpoints.** The fused modules save and load the separate modules' state dict:
state-dict hooks on the parent (`Attention`, `MLP`) rename `qkv_proj.weight` to
`q_proj.weight`, `k_proj.weight`, `v_proj.weight` (row views of the fused weight) and
back (a concatenation). The fused projections stay plain `nn.Linear` children, so a pass
that swaps every `nn.Linear` (fp8 training) sees them like any other linear layer.

Switch values (`Switches.enable_fused_projections`); one field, because the Triton
SwiGLU needs the fused (T, 2i) layout and so cannot exist without the GEMM fusion:

- False: separate q/k/v and gate/up `nn.Linear`s, eager `silu(gate) * up` (Hugging
  Face's LlamaMLP).
- "eager": fused GEMMs; the activation on views of the fused output, eager.
- "compile": fused GEMMs; `torch.compile` of the eager activation.
- "triton": fused GEMMs; our Triton SwiGLU (`kernels.swiglu`), forward and backward.
- True: "triton" on a CUDA device, "eager" on the CPU.

References: N. Shazeer, *GLU Variants Improve Transformer*, 2020 (SwiGLU); J. Ainslie
et al., *GQA*, 2023; Hugging Face `Phi3Attention.qkv_proj` / `Phi3MLP.gate_up_proj`;
Megatron-LM `linear_qkv`; torchtitan's fused-QKV checkpoint conversion; Liger-Kernel's
`LigerSiLUMulFunction`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from colossal_lab.fallback import fallback
from colossal_lab.ops import kernel_switch

ACTIVATIONS = ("eager", "compile", "triton")


# ---------------------------------------------------------------------------- the switch


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
        from colossal_lab.kernels.swiglu import swiglu_triton

        return swiglu_triton(gate_up)
    if name == "compile":
        try:
            return _compiled()(gate_up)
        except Exception as e:  # no C++ compiler, an unsupported torch build, ...
            fallback(f"torch.compile of the SwiGLU failed ({type(e).__name__}: "
                     f"{str(e)[:200]})", "eager")
    return swiglu_fused_ref(gate_up)


# -------------------------------------------------- fusing and splitting nn.Linear children


# ------------------------------------------------------------------- state-dict hooks


# ---------------------------------------------------------------------------- the switch


