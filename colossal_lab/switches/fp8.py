"""fp8 linears on a model (switch 6, `precision="fp8"`): swap each eligible `nn.Linear`.

`convert_to_fp8` and `revert` swap, in place, between `nn.Linear` and `ops.fp8.Fp8Linear`
sharing the same Parameters; the options come from `Switches.extra` ("fp8_scaling",
"fp8_history", "fp8_skip", "fp8_backend", ...). ColossalAI asks for fp8 linears with a
plugin flag of its own, `use_fp8`, beside `precision`.
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from colossal_lab.fallback import warn_once
from colossal_lab.ops.fp8 import Fp8Config, Fp8Linear, check_fp8_supported


def fp8_eligible(linear: nn.Linear) -> bool:
    """In and out features multiples of 16 (what `_scaled_mm` needs)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, config: Fp8Config | None = None, *,
                   skip: tuple[str, ...] = ()) -> list[str]:
    """Swap, in place, every module whose type is exactly `nn.Linear` for an
    `Fp8Linear` sharing its Parameters; returns the converted names.

    Linears whose shapes are not multiples of 16, or whose name contains one of `skip`
    (e.g. "lm_head"), stay as they are (one warning lists the first kind). Build the
    optimizer after converting (the Parameters are the same objects either way)."""
    config = config or Fp8Config()
    for p in model.parameters():
        check_fp8_supported(p.device)
        break
    converted, kept, done = [], [], {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or any(s in full for s in skip):
                continue
            if not fp8_eligible(child):
                kept.append(f"{full} ({child.in_features}->{child.out_features})")
                continue
            if id(child) not in done:  # a linear shared by two parents stays shared
                done[id(child)] = Fp8Linear.from_linear(child, config)
            setattr(parent, name, done[id(child)])
            converted.append(full)
    if kept:
        msg = ("fp8: these linears stay in bf16, their in/out features are not "
               f"multiples of 16: {', '.join(kept)}")
        warn_once(msg, stacklevel=3)
    return converted


def revert(model: nn.Module) -> int:
    """The inverse of `convert_to_fp8`, in place: every `Fp8Linear` becomes a plain
    `nn.Linear` holding the same Parameters (amax histories are dropped); returns how
    many modules were swapped."""
    done: dict[int, nn.Linear] = {}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Fp8Linear):
                continue
            if id(child) not in done:
                lin = nn.Linear(child.in_features, child.out_features,
                                bias=child.bias is not None, device="meta")
                lin.weight, lin.bias = child.weight, child.bias
                lin.train(child.training)
                done[id(child)] = lin
            setattr(parent, name, done[id(child)])
            count += 1
    return count


def check_with_checkpointing(extra: dict, checkpoint_config) -> None:
    """Delayed scaling updates its amax history inside the forward, so a selective
    recompute (which replays some ops and not others) cannot hand it back: refused."""
    if (extra.get("fp8_scaling") == "delayed"
            and getattr(checkpoint_config, "mode", "full") != "full"):
        raise ValueError(
            "fp8_scaling='delayed' updates its amax history inside the forward, so a "
            f"selective recompute (mode={checkpoint_config.mode!r}) replays different "
            "ops; use fp8_scaling='dynamic' or GradientCheckpointConfig(mode='full')")


def fp8_modules(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def histories_started(model: nn.Module) -> int:
    """How many roles of `model`'s delayed-scaling fp8 linears have started their amax
    history. A step that raises the count ran first casts: dynamic ones, with kernels
    (the amax pass, the ring's first filing) later steps do not run. A linear the step
    never calls (an output head whose weight the fused loss reads) never starts."""
    return sum(m.fp8_config.scaling == "delayed" and s.seen
               for m in fp8_modules(model) for s in m._scalers.values())


def with_config(model: nn.Module, **changes) -> None:
    """Change the config of every Fp8Linear of `model` (e.g. backend="emulate")."""
    for m in fp8_modules(model):
        m.fp8_config = replace(m.fp8_config, **changes)
