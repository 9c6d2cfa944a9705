"""`enable_compile`: `torch.compile` over the glue our kernels leave between them.

**What it does.** Every switch before this one replaces an op with a kernel; what is
left between the kernels (residual adds, casts, reshapes, the SwiGLU when it is not
ours, the loss's bookkeeping) still runs as one eager PyTorch op at a time, each a
kernel launch and a round trip through memory. `torch.compile` traces the forward
(Dynamo), derives the backward from it (AOTAutograd) and lets Inductor fuse those ops
into a few generated Triton kernels. Two granularities:

* ``"layers"`` (True): *regional compilation*, as torchtitan does it: each decoder
  layer is compiled on its own. Dynamo inlines `nn.Module`s and passes their
  parameters as graph inputs, so every layer of the same structure reuses the first
  layer's graph: compile time is about that of one layer, whatever the depth. The
  embedding, the final norm and the head + loss stay eager.
* ``"model"``: the whole forward in one graph, embedding to loss: fusion across layer
  boundaries too, and a compile time that grows with the depth.
* ``"graph"``: no `torch.compile`: the whole training step (forward, backward, the
  optimizer) recorded once as a CUDA graph and replayed every step
  (`switches.step_graph`), so no kernel waits for the host that launches it.

Both compile *in place* (`nn.Module.compile`): the module stays the same object, so
its state-dict keys (no ``_orig_mod.`` prefix), its hooks, the optimizer's parameters
and switch 4's per-layer `forward` (`switches.checkpointing.apply`) all stay; Dynamo
traces `torch.utils.checkpoint` as a higher-order op. Applying the switches again
first removes every earlier compilation (`revert`), then compiles what is asked: never
a compiled module inside a compiled module.

**What it costs.** The compilation happens in the first call of each compiled module:
the first training step takes seconds to minutes, which is why every benchmark row
records `first_step_s` (`benchmarks.steps`) next to its steady-state step time. A new
input shape (another sequence length or batch, a short last batch) recompiles: after
the first recompile Dynamo makes that dimension dynamic (`automatic_dynamic_shapes`),
and past `torch._dynamo.config.recompile_limit` recompiles it runs that module eagerly.
Re-applying switches, or checkpointing other layers, changes what the guards check: the
next step compiles again.

**With our Triton kernels.** Each of our kernels is called from a
`torch.autograd.Function` whose forward and backward launch `@triton.jit` kernels.
Dynamo traces user-defined Triton kernels (as the `triton_kernel_wrapper_mutation`
higher-order op) and traces autograd Functions' forward and backward into the graph,
so Inductor keeps our kernel as one opaque call and fuses the eager ops around it.
Host-side code in a launcher that Dynamo cannot trace would break the graph there
(correct, just less fused). Under Triton's interpreter (no GPU, `TRITON_INTERPRET=1`)
the kernels are Python that Dynamo cannot trace (it fails on the interpreter's own
tensors): `check` refuses that combination, so on the CPU compile only the eager and
torch backends (as the tests do). Inductor also needs a C++ compiler on the CPU;
`Switches.extra["compile_backend"] = "aot_eager"` traces and splits forward and backward
without generating code (what the tests use).

`Switches.extra` knobs: "compile_backend" (default "inductor"; any `torch.compile`
backend name) and "compile_mode" (Inductor's "default", "reduce-overhead" (CUDA
graphs), "max-autotune", "max-autotune-no-cudagraphs"; None = torch's default).
"""

from __future__ import annotations

import torch

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
    from colossal_lab.kernels import INTERPRET

    value = switches.enable_compile
    if resolve(value) is None:
        return
    if resolve(value) == "graph":
        from colossal_lab.switches import step_graph

        step_graph.check(switches, device)
        return
    options(switches.extra)
    if device is None or torch.device(device).type == "cuda" or not INTERPRET:
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
    from colossal_lab.model import layer_lists

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
    from colossal_lab.model import layer_lists

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
