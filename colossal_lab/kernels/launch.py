"""Launching a Triton kernel with less host work per call.

`kernel[grid](*args, **constexprs)` does tens of microseconds of Python before the
driver call: it binds the arguments, works out what to specialise on, builds and looks
up the cache key and checks the globals the kernel read. Measured on the H200's host,
about 44 µs per launch, and an RMSNorm forward + backward makes three launches: at
small shapes that is most of an eager call, and more than the GPU time. `launch` does
that work once per specialisation: the first call goes through Triton's JIT, which
compiles and returns the compiled kernel; later calls with the same key call that
compiled kernel directly (`CompiledKernel[grid](*all_args)`, Triton's own launcher).

The key is at least as fine as Triton's specialisation (the current device; each
tensor's dtype and 16-byte alignment; each integer's divisibility by 16, whether it is
1 and whether it fits in 32 bits; the constexprs, warps and stages), so a cached kernel
is reused only where Triton would have picked the same one. Under the interpreter, or
if the compiled kernel's launcher does not take the call (another Triton version),
every launch goes through `kernel[grid]` as usual; so does one that torch.compile is
tracing (dynamo understands `kernel[grid]` calls, not our cache).
"""

from __future__ import annotations

import torch

from colossal_lab.kernels import INTERPRET

CACHE: dict[tuple, tuple] = {}
"""(kernel, device, specialisation, constexprs, warps, stages) -> (compiled kernel,
constexpr values in signature order)."""
_fast = not INTERPRET
"""False once the direct path failed: then every launch goes through the JIT."""


def _spec(args: tuple) -> tuple:
    """What Triton specialises a launch on, per runtime argument (or finer)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            out.append(("b", a))
        elif isinstance(a, int):
            out.append((a % 16 == 0, a == 1, -(1 << 31) <= a < (1 << 31)))
        elif isinstance(a, float):
            out.append("f")
        else:
            out.append((type(a), a))
    return tuple(out)


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, *, num_warps: int,
           num_stages: int | None = None) -> None:
    """`kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)`, through
    the compiled kernel when this specialisation was launched before.

    `args` are the kernel's runtime arguments, in order; `constexprs` the compile-time
    ones, all of which must follow them in the kernel's signature."""
    global _fast
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if not _fast or torch.compiler.is_compiling():  # dynamo traces `kernel[grid]` calls
        kernel[grid](*args, **constexprs, **options)
        return
    # the device too: a compiled kernel's handles belong to the device it was loaded on
    key = (kernel, torch.cuda.current_device(), _spec(args), tuple(constexprs.items()),
           num_warps, num_stages)
    hit = CACHE.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **constexprs, **options)
        if compiled is not None:  # (a stand-in kernel returns nothing: nothing to keep)
            CACHE[key] = (compiled, tuple(constexprs[n] for n in kernel.arg_names[len(args):]))
        return
    compiled, tail = hit
    try:  # the compiled kernel's launcher indexes all three grid dimensions
        compiled[(*grid, 1, 1)[:3]](*args, *tail)
    except Exception:  # a launcher with another calling convention: the JIT from now on
        _fast = False
        CACHE.clear()
        kernel[grid](*args, **constexprs, **options)
