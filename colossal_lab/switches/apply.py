"""`apply_switches`: the one path from a plain model and a `Switches` to a model that trains.

    model = apply_switches(build_model(cfg, "cuda"), Switches(enable_flash_attention=True))

Each switch is applied by its own module's `apply(model, value)`, in place, in this
order (the shape of torchtitan's `parallelize_llama`):

    1. attention kernel        switches.attention.apply       (switch 1)
    2. rotary embedding        switches.rope.apply            (finale: our RoPE kernel)
    3. norm kernel             switches.norm.apply            (switch 2)
    4. fused projections       switches.projections.apply     (switch 3)
    5. head + loss             switches.loss.apply            (finale: fused cross-entropy)
    6. activation checkpoints  switches.checkpointing.apply   (switch 4)
    7. precision and fp8       switches.precision.apply       (switch 6)
    later, on a device mesh:   tensor/sequence parallelism (5), pipeline stages (7),
                               data parallelism (8) last

Why this order: the kernel switches (1, 2, 3, 5) and 6 only set attributes and
commute. 4 restacks `nn.Linear` children, so it runs before 7, which swaps linears for
fp8 ones (and fp8 linears left by an earlier application are turned back into plain
ones first). 6 runs before 7 so that the checkpointed forward sees the fp8 linears it
recomputes. Precision comes last
on one device because it changes what parameters are (dtype, fp8 wrappers), which is
what tensor parallelism then shards and data parallelism reduces; those come after it,
data parallelism last, as in torchtitan, because it wraps whatever the others built.

Applying again swaps switches on the same model with no rebuild: weights keep their
values (fused projections are new Parameters: make the optimizer afterwards; fp8
amax histories restart). `model.switches` records what was applied; the precision in
it is what every step asks (`switches.precision.of`).
"""

from __future__ import annotations

import torch

from colossal_lab.config import Switches
from colossal_lab.switches import (
    attention,
    checkpointing,
    fp8,
    loss,
    norm,
    precision,
    projections,
    rope,
)

ORDER = ("enable_flash_attention", "enable_fused_rope", "enable_fused_normalization",
         "enable_fused_projections", "enable_fused_cross_entropy",
         "gradient_checkpoint_config", "precision")
"""The `Switches` fields in the order `apply_switches` applies them."""

_APPLY = {"enable_flash_attention": attention.apply,
          "enable_fused_rope": rope.apply,
          "enable_fused_normalization": norm.apply,
          "enable_fused_projections": projections.apply,
          "enable_fused_cross_entropy": loss.apply,
          "gradient_checkpoint_config": checkpointing.apply}


def check(switches: Switches, device: torch.device | str | None = None) -> None:
    """Refuse, before anything is built or changed, what cannot work: fp8 without fp8
    tensor cores, fp8 delayed scaling with a selective recompute, a bad checkpoint
    config, an unknown backend name."""
    if not isinstance(switches, Switches):
        raise TypeError(f"expected a Switches, not {type(switches).__name__}")
    checkpointing.resolve(switches.gradient_checkpoint_config)
    projections.is_fused(switches.enable_fused_projections)
    for value, names, field in ((switches.enable_flash_attention, attention.BACKENDS,
                                 "enable_flash_attention"),
                                (switches.enable_fused_normalization, norm.BACKENDS,
                                 "enable_fused_normalization"),
                                (switches.enable_fused_rope, rope.BACKENDS,
                                 "enable_fused_rope"),
                                (switches.enable_fused_cross_entropy, loss.BACKENDS,
                                 "enable_fused_cross_entropy")):
        if not (isinstance(value, bool) or value is None or value in names):
            raise ValueError(f"{field}={value!r}; choose True, False or one of {names}")
    if precision.policy(switches.precision).fp8:
        if device is not None:
            fp8.check_fp8_supported(device)
        fp8.check_with_checkpointing(switches.extra, switches.gradient_checkpoint_config)


def apply_switches(model: torch.nn.Module, switches: Switches,
                   mesh=None) -> torch.nn.Module:
    """Apply every switch of `switches` to `model` in `ORDER`, in place; returns the
    model. A switch turned on that no module of the model takes (a model without our
    attention modules asked for a flash-attention backend) is an error, not a no-op.

    `mesh` (a `DeviceMesh`) is for the distributed switches, which arrive with their
    issues; until then only None is accepted."""
    if mesh is not None:
        raise NotImplementedError(
            "apply_switches(..., mesh=...) applies tensor, pipeline and data parallelism; "
            "those switches are not built yet: pass mesh=None")
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its module
    device = next(inner.parameters()).device
    check(switches, device)
    fp8.revert(inner)  # plain linears for the structural switches; precision redoes it
    for field in ORDER[:-1]:
        value = getattr(switches, field)
        count = _APPLY[field](inner, value)
        if count == 0 and value not in (False, None) and field != "gradient_checkpoint_config":
            raise ValueError(f"{field}={value!r}, but no module of this "
                             f"{type(inner).__name__} takes it (our model.LlamaForCausalLM "
                             "does)")
        if field == "gradient_checkpoint_config" and value is not None \
                and not checkpointing.layer_lists(inner):
            raise ValueError(f"gradient_checkpoint_config is set, but this "
                             f"{type(inner).__name__} has no `layers` list to checkpoint")
    precision.apply(inner, switches.precision, switches.extra)
    inner.switches = switches
    return model
