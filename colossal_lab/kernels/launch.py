"""Launching a Triton kernel with less host work per call.

`kernel[grid](*args, **constexprs)` does tens of microseconds of Python before the
driver call: it binds the arguments, works out what to specialise on, builds and looks
up the cache key and checks the globals the kernel read. An RMSNorm forward + backward
makes three launches: at small shapes that host work is most of an eager call, and more
than the GPU time. `launch` does that work once per specialisation: the first call goes
through Triton's JIT, which compiles and returns the compiled kernel; later calls with
the same key go to the compiled kernel's launcher (`_Runner`), a third to a fifth of
the host time.

Even `CompiledKernel[grid](*args)`, Triton's own way back in, is slower: in Triton 3.5
and later the launch hooks are `HookChain`s, never None, so every launch builds the
hooks' metadata and calls two empty chains from C. `_Runner` passes no hooks while the
chains are empty and goes through `CompiledKernel[grid]` as soon as a profiler has
added one.

The key is at least as fine as Triton's specialisation (the current device; each
tensor's dtype and 16-byte alignment; each integer's divisibility by 16, whether it is
1 and whether it fits in 32 bits; the constexprs, warps and stages), so a cached kernel
is reused only where Triton would have picked the same one. Working that out from the
arguments (`_spec`) is itself a good part of that host time; a caller that already
holds what determines it (shapes, strides, dtypes, pointer alignments) passes it as
`key` instead. Under the interpreter, or if the compiled kernel's launcher does not
take the call (another Triton version), every launch goes through `kernel[grid]` as
usual; so does one that torch.compile is tracing (dynamo understands `kernel[grid]`
calls, not our cache).
"""

from __future__ import annotations

import torch
from triton import knobs

from colossal_lab.kernels import INTERPRET

CACHE: dict[tuple, _Runner] = {}
"""(kernel, device, specialisation) -> the compiled kernel's `_Runner`; the
specialisation is `key` when the caller gives one, else (`_spec(args)`, constexprs,
warps, stages)."""
_fast = not INTERPRET
"""False once the direct path failed: then every launch goes through the JIT."""


def int_spec(i: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: divisible by 16, equal to 1,
    fits in 32 bits."""
    return (i % 16 == 0, i == 1, -(1 << 31) <= i < (1 << 31))


def plan_key(dtypes: tuple, aligned: tuple, ints: tuple, constexprs: dict,
             num_warps: int, num_stages: int | None = None) -> tuple:
    """A caller's `key` for `launch`, from what decides Triton's specialisation: the
    dtypes and 16-byte alignment of every tensor argument that is not freshly allocated
    (fresh ones are aligned and of known dtype: the caller's plan fixes them), the
    runtime integers (`int_spec` of each), the constexprs, warps and stages."""
    return (dtypes, aligned, tuple(map(int_spec, ints)), tuple(constexprs.items()),
            num_warps, num_stages)


def _spec(args: tuple) -> tuple:
    """What Triton specialises a launch on, per runtime argument (or finer)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            out.append(("b", a))
        elif isinstance(a, int):
            out.append(int_spec(a))
        elif isinstance(a, float):
            out.append("f")
        else:
            out.append((type(a), a))
    return tuple(out)


def _no_hooks(chain) -> bool:
    """True for an absent or empty launch-hook chain (a plain callable counts as one)."""
    return chain is None or getattr(chain, "calls", True) == []


class _Runner:
    """One compiled specialisation, launched through its launcher with the arguments
    Triton's own `CompiledKernel[grid]` would pass, minus the work of empty hooks."""

    __slots__ = ("compiled", "tail", "device", "run", "function", "metadata")

    def __init__(self, compiled, tail: tuple, device: int):
        compiled._init_handles()
        self.compiled, self.tail, self.device = compiled, tail, device
        self.run, self.function = compiled.run, compiled.function
        self.metadata = compiled.packed_metadata

    def __call__(self, grid: tuple, args: tuple) -> None:
        g = (*grid, 1, 1)
        hooks = knobs.runtime
        if _no_hooks(hooks.launch_enter_hook) and _no_hooks(hooks.launch_exit_hook):
            self.run(g[0], g[1], g[2], _current_stream(self.device), self.function,
                     self.metadata, None, None, None, *args, *self.tail)
        else:  # a profiler listens: Triton's path builds what its hooks are given
            self.compiled[g[:3]](*args, *self.tail)


def _current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


if not INTERPRET and torch.cuda.is_available():  # the raw handle, ~10x cheaper
    _current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream)


def runner_for(kernel, key) -> _Runner | None:
    """The cached runner of `kernel` launched with caller key `key` on the current
    device (None before its first launch, or on the JIT path)."""
    if not _fast:
        return None
    return CACHE.get((kernel, torch.cuda.current_device(), key))


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, *, num_warps: int,
           num_stages: int | None = None, key=None) -> None:
    """`kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)`, through
    the compiled kernel when this specialisation was launched before.

    `args` are the kernel's runtime arguments, in order; `constexprs` the compile-time
    ones, all of which must follow them in the kernel's signature. `key`, if given,
    must be hashable and determine everything Triton specialises this launch on: the
    tensors' dtypes and 16-byte alignment, the integers' divisibility by 16 and
    equality to 1, the constexprs, warps and stages."""
    global _fast
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if not _fast or torch.compiler.is_compiling():  # dynamo traces `kernel[grid]` calls
        kernel[grid](*args, **constexprs, **options)
        return
    # the device too: a compiled kernel's handles belong to the device it was loaded on
    device = torch.cuda.current_device()
    if key is None:
        key = (_spec(args), tuple(constexprs.items()), num_warps, num_stages)
    runner = CACHE.get((kernel, device, key))
    if runner is None:
        compiled = kernel[grid](*args, **constexprs, **options)
        if compiled is not None:  # (a stand-in kernel returns nothing: nothing to keep)
            tail = tuple(constexprs[n] for n in kernel.arg_names[len(args):])
            try:
                CACHE[(kernel, device, key)] = _Runner(compiled, tail, device)
            except Exception:  # a compiled kernel of another shape: the JIT from now on
                _fast = False
        return
    try:
        runner(grid, args)
    except Exception:  # a launcher with another calling convention: the JIT from now on
        _fast = False
        CACHE.clear()
        kernel[grid](*args, **constexprs, **options)
