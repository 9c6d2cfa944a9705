"""Fused projections: stack `nn.Linear` children into one and split them back.

Hugging Face's separate names stay in the state dict (hooks on the parent), so a
checkpoint loads either way; `switches.projections` applies this to a model."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn


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


FUSIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Each fused linear and Hugging Face's names of the projections it stacks, in row
order."""
