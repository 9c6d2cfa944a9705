"""`enable_compile` (no ColossalAI flag): `torch.compile` over the glue between our kernels.

**What it does.** What the kernel switches leave between their kernels (residual adds,
casts, reshapes, an eager SwiGLU, the loss's bookkeeping) runs one eager op at a time,
each a launch and a round trip through memory. `torch.compile` traces the forward
(Dynamo), derives the backward (AOTAutograd) and lets Inductor fuse those ops. Values:

* False: eager.
* ``"layers"`` (True): *regional compilation*, as torchtitan does it: each decoder layer
  compiled on its own; layers of one structure reuse the first one's graph, so compile
  time is one layer's whatever the depth. Embedding, final norm and head stay eager.
* ``"model"``: the whole forward in one graph, fused across layers; compile time grows
  with the depth.
* ``"graph"``: no `torch.compile`; the whole training step replayed as a CUDA graph
  (`switches.step_graph`).

On the model, `apply` compiles *in place* (`nn.Module.compile`): modules, state-dict keys,
hooks, optimizer parameters and switch 4's per-layer `forward` all stay; applying again
first removes earlier compilations (`revert`). The first step pays the compilation (every
benchmark row records `first_step_s`); a new input shape recompiles.

**With our Triton kernels.** Dynamo traces user-defined Triton kernels and autograd
Functions, so Inductor keeps each kernel as one opaque call and fuses the ops around it.
Under Triton's interpreter (no GPU) the kernels are Python Dynamo cannot trace: `check`
refuses that combination. `Switches.extra` knobs: "compile_backend" (default
"inductor"; "aot_eager" traces without generating code, what the CPU tests use) and
"compile_mode" (Inductor's "default", "reduce-overhead", "max-autotune", ...).
"""

from __future__ import annotations

import torch

from colossal_lab import kernels
from colossal_lab.model import layer_lists
from colossal_lab.switches import step_graph

MODES = ("layers", "model", "graph")
"""`Switches.enable_compile` values besides True (= "layers") and False."""
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune",
                  "max-autotune-no-cudagraphs")
"""`extra["compile_mode"]` values: Inductor's own `torch.compile(mode=...)`."""
DEFAULT_BACKEND = "inductor"
KERNEL_FIELDS = ("enable_flash_attention", "enable_fused_normalization",
                 "enable_fused_projections", "enable_fused_rope",
                 "enable_fused_cross_entropy", "enable_fused_embedding")
"""`Switches` fields whose "triton" value runs our kernels inside the model's forward."""


def resolve(value) -> str | None:
    """The granularity `enable_compile = value` picks: None (off), "layers", "model" or
    "graph" (the step replayed as a CUDA graph, `switches.step_graph`)."""
    if value is False or value is None:
        return None
    if value is True:
        return "layers"
    if isinstance(value, str) and value in MODES:
        return value
    raise ValueError(f"enable_compile={value!r}; choose False (off), True (= 'layers') "
                     f"or one of {MODES}")


def _backends() -> list[str]:
    """torch.compile's backends worth naming: its listed ones and the two eager ones
    (which it lists only among its debug backends)."""
    return sorted({*torch._dynamo.list_backends(), "aot_eager", "eager"})


def options(extra: dict | None) -> dict:
    """`torch.compile`'s keyword arguments from `Switches.extra`; a ValueError naming the
    key for a value that cannot work."""
    extra = extra or {}
    backend = extra.get("compile_backend", DEFAULT_BACKEND)
    mode = extra.get("compile_mode")
    if not (callable(backend) or (isinstance(backend, str)
                                  and backend in torch._dynamo.list_backends(exclude_tags=()))):
        raise ValueError(f"extra['compile_backend']={backend!r}; choose a torch.compile "
                         f"backend: {', '.join(_backends())}")
    if mode is not None:
        if mode not in INDUCTOR_MODES:
            raise ValueError(f"extra['compile_mode']={mode!r}; choose None or one of "
                             f"{INDUCTOR_MODES}")
        if backend != "inductor":
            raise ValueError(f"extra['compile_mode']={mode!r} is an Inductor mode, but "
                             f"extra['compile_backend']={backend!r}: drop one of them")
    return {"backend": backend, **({"mode": mode} if mode is not None else {})}


def check(switches, device=None) -> None:
    """Refuse, before anything changes, what cannot compile: a bad `enable_compile`, a
    bad backend or mode in `extra`, and our Triton kernels under Triton's interpreter
    (`device` a CPU without a GPU), which Dynamo cannot trace."""
    value = switches.enable_compile
    if resolve(value) is None:
        return
    if resolve(value) == "graph":
        step_graph.check(switches, device)
        return
    options(switches.extra)
    if device is None or torch.device(device).type == "cuda" or not kernels.INTERPRET:
        return
    if named := [f for f in KERNEL_FIELDS if getattr(switches, f) == "triton"]:
        raise ValueError(f"enable_compile={value!r} with our Triton kernels on the CPU "
                         f"({', '.join(f'{f}=triton' for f in named)}): they run under "
                         "Triton's interpreter there, which Dynamo cannot trace; use a GPU, "
                         "or the eager/torch backends, or turn enable_compile off")


def check_model(model: torch.nn.Module, value, pp: int = 1) -> None:
    """Refuse, before anything changes, what `apply` cannot do to `model`: "layers" on a
    model without a `layers` list, and compilation with `pp` > 1 pipeline stages (not
    composed yet: the zero-bubble schedules' `DeferredLinear`s file weight-gradient
    jobs into a Python store from inside the backward, which a compiled backward does
    not run; untested for the other schedules)."""
    mode = resolve(value)
    if mode is not None and pp > 1:
        raise NotImplementedError(f"enable_compile={value!r} with pipeline stages is not "
                                  "composed yet: make the mesh with pp=1 or turn "
                                  "enable_compile off")
    if mode == "layers" and not layer_lists(model):
        raise ValueError(f"enable_compile={value!r} compiles each layer, but this "
                         f"{type(model).__name__} has no `layers` list; use 'model'")


def compiled(model: torch.nn.Module) -> list[str]:
    """Names of the modules of `model` compiled in place ("" is `model` itself)."""
    return [name for name, m in model.named_modules()
            if m.__dict__.get("_compiled_call_impl") is not None]


def revert(model: torch.nn.Module) -> int:
    """Undo `apply`: every module of `model` calls its eager forward again; returns how
    many were compiled. (`nn.Module.compile` keeps the compiled callable in the
    instance; the class's default, None, means eager.)"""
    return sum(m.__dict__.pop("_compiled_call_impl", None) is not None
               for m in model.modules())


def apply(model: torch.nn.Module, value, extra: dict | None = None) -> int:
    """`enable_compile = value` on `model`, in place: each transformer layer
    ("layers", True) or the whole model ("model") compiled with `nn.Module.compile`,
    with the backend and mode of `extra` (`options`). Any earlier compilation is
    removed first, so applying twice compiles once. Returns how many modules are
    compiled (0 when off, or when "layers" finds no `layers` list)."""
    mode = resolve(value)
    kwargs = options(extra) if mode is not None else {}  # checked before any change
    revert(model)
    if mode in (None, "graph"):  # "graph" wraps the step (`train.make_step`), not modules
        return 0
    if mode == "model":
        model.compile(**kwargs)
        return 1
    layers = [layer for layer_list in layer_lists(model) for layer in layer_list]
    for layer in layers:
        layer.compile(**kwargs)
    return len(layers)
