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
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.fallback import fallback
from colossal_lab.switches import kernel_switch

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


def _check_plain(lin: nn.Module, name: str) -> None:
    if type(lin) is not nn.Linear:
        raise TypeError(
            f"{name} is a {type(lin).__name__}, not a plain nn.Linear: convert the "
            "projections (enable_fused_projections) before swapping the linear layers "
            "(e.g. for fp8), not after; apply_switches does so in that order")


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool
                 ) -> nn.Linear:
    """An nn.Linear holding `weight` (and `bias`) itself: no fresh allocation."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=requires_grad)
    return lin


def _replace_children(module: nn.Module, old: list[str], new: dict[str, nn.Module]) -> None:
    """Swap the children named `old` for `new`, in the place of the first of `old`, so
    the state dict keeps its order."""
    items = []
    for name, child in module._modules.items():
        if name == old[0]:
            items.extend(new.items())
        elif name not in old:
            items.append((name, child))
    module._modules.clear()
    module._modules.update(OrderedDict(items))


@torch.no_grad()
def fuse_linears(module: nn.Module, parts: list[str], fused: str) -> None:
    """Replace the children `parts` (nn.Linear on one input) by one nn.Linear `fused`
    whose weight is theirs stacked by rows (values kept; the old ones are freed)."""
    lins = [getattr(module, p) for p in parts]
    for p, lin in zip(parts, lins):
        _check_plain(lin, p)
    w = torch.cat([lin.weight for lin in lins])
    b = None
    if lins[0].bias is not None:
        b = torch.cat([lin.bias for lin in lins])
    _replace_children(module, parts,
                      {fused: _linear_from(w, b, lins[0].weight.requires_grad)})


@torch.no_grad()
def split_linear(module: nn.Module, fused: str, parts: list[str], sizes: list[int]) -> None:
    """The inverse of `fuse_linears`: one child `fused` becomes `parts` of `sizes` rows
    (each its own contiguous copy, so freeing one frees its memory)."""
    lin = getattr(module, fused)
    _check_plain(lin, fused)
    ws = lin.weight.split(sizes)
    bs = lin.bias.split(sizes) if lin.bias is not None else [None] * len(sizes)
    rg = lin.weight.requires_grad
    _replace_children(module, [fused], {
        p: _linear_from(w.clone(), b.clone() if b is not None else None, rg)
        for p, w, b in zip(parts, ws, bs)})


# ------------------------------------------------------------------- state-dict hooks


def register_hf_layout(module: nn.Module, fused: str, parts: tuple[str, ...],
                       sizes: list[int]) -> None:
    """Make `module` save and load the separate layout (children `parts`) whether it
    holds them or one fused child `fused` of `sizes` rows each. Registered once per
    module and fused child (`apply` calls it when it fuses).

    Hooks sit on the parent, not in a Linear subclass, so the fused child stays a plain
    nn.Linear that other passes may swap."""
    known = module.__dict__.setdefault("_fused_sizes", {})
    first = fused not in known
    known[fused] = list(sizes)
    if not first:
        return

    def save(mod, state_dict, prefix, local_metadata):
        key = prefix + fused + "."
        if not any(k.startswith(key) for k in state_dict):
            return
        # keys after the fused child's belong to this module's later children: pop and
        # re-append them so the parts take the fused child's place in the order
        keys = list(state_dict)
        first = next(i for i, k in enumerate(keys) if k.startswith(key))
        tail = [(k, state_dict.pop(k)) for k in keys[first:]]
        sizes = mod._fused_sizes[fused]
        for k, v in tail:
            if k.startswith(key):
                with torch.no_grad():  # row views: no copy, no autograd history
                    for p, piece in zip(parts, v.split(sizes)):
                        state_dict[prefix + p + "." + k[len(key):]] = piece
        for k, v in tail:
            if not k.startswith(key):
                state_dict[k] = v

    def load(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        holds_fused = fused in mod._modules
        part_keys = sorted({k[len(prefix) + len(parts[0]) + 1:] for k in state_dict
                            if k.startswith(prefix + parts[0] + ".")})
        if holds_fused:  # separate keys -> one stacked tensor
            for suffix in part_keys:
                names = [prefix + p + "." + suffix for p in parts]
                if all(n in state_dict for n in names):
                    state_dict[prefix + fused + "." + suffix] = torch.cat(
                        [state_dict.pop(n) for n in names])
            return
        key = prefix + fused + "."
        for k in [k for k in state_dict if k.startswith(key)]:  # fused keys -> parts
            pieces = state_dict.pop(k).split(mod._fused_sizes[fused])
            for p, piece in zip(parts, pieces):
                state_dict[prefix + p + "." + k[len(key):]] = piece

    module._register_state_dict_hook(save)  # public alias: register_state_dict_post_hook
    module._register_load_state_dict_pre_hook(load, with_module=True)


# ---------------------------------------------------------------------------- the switch

FUSIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Each fused linear and Hugging Face's names of the projections it stacks, in row
order."""


def apply(model: nn.Module, value) -> int:
    """Switch 3 on `model`, in place: stack every q/k/v and gate/up trio or pair of
    plain `nn.Linear` children into one (values kept, new Parameters: make the optimizer
    afterwards), or split them back for False; modules with an `activation` (the MLP)
    run the SwiGLU kernel `value` picks. The state dict keeps the separate names.
    Returns how many fused linears the model holds afterwards."""
    fused = is_fused(value)  # validates
    count = 0
    for m in list(model.modules()):
        for name, parts in FUSIONS.items():
            if fused and all(p in m._modules for p in parts):
                sizes = [m._modules[p].out_features for p in parts]
                fuse_linears(m, list(parts), name)
                register_hf_layout(m, name, parts, sizes)
            elif not fused and name in m._modules:
                split_linear(m, name, list(parts), m._fused_sizes[name])
            count += name in m._modules
        if hasattr(type(m), "activation"):
            m.activation = value
    return count
