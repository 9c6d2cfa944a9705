"""RMSNorm's forward and backward with no Python between the call and the GPU, in C++.

The C++ is `csrc/rms_norm_native.cpp`, built on first use with
`torch.utils.cpp_extension`. From Python each eager forward + backward pays for a Python
autograd `Function` and three calls into Triton's launcher: about twice the host time of
`F.rms_norm`, whose autograd node is C++, even with everything precomputed. Where the
GPU work is shorter than that, eager training waits on the host. The native path keeps
every decision in Python and moves only the per-call work to C++:

1. the first call of a shape goes through `rms_norm.TritonRMSNormFunction`:
   checks, tiles, compilation, launches;
2. `register_launch` (called from there) hands each launch to C++: the compiled kernel's
   function handle, grid, threads, shared memory, and where each kernel argument comes
   from (which tensor, which integer, the call's eps). The arguments are matched against
   the kernel's parameter list in its PTX, so a mismatch (another Triton's calling
   convention) registers nothing and that shape stays on the Python path;
3. later calls of that shape find the plan in C++ (`rms_norm`), which allocates, launches
   and records a C++ autograd node whose backward does the same.

On by default for CUDA tensors (the H200: one eager forward + backward then takes the
host time of `F.rms_norm`). `COLOSSAL_LAB_NATIVE=0` turns it off; it is off under the
interpreter, while torch.compile traces, and where the extension cannot be built (no C++
compiler: `why_not()` says why, and the Python path runs). The first use builds the
extension (about a minute) into a cache folder; later processes load it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from colossal_lab.kernels import INTERPRET

ENV = "COLOSSAL_LAB_NATIVE"
SOURCE = Path(__file__).parent / "csrc" / "rms_norm_native.cpp"
_state: dict = {}


OFF_VALUES = ("0", "off", "false", "no")


def requested() -> bool:
    """The native path applies here: on unless `COLOSSAL_LAB_NATIVE` is one of
    `OFF_VALUES` (a `forced()` / `disabled()` block overrides the environment), and
    never under the interpreter."""
    if INTERPRET:
        return False
    chosen = _state.get("chosen")
    if chosen is not None:
        return chosen
    return os.environ.get(ENV, "1").strip().lower() not in OFF_VALUES


@contextlib.contextmanager
def _choose(on: bool):
    before = _state.get("chosen")
    _state["chosen"] = on
    try:
        yield
    finally:
        _state["chosen"] = before


def forced():
    """The native path on within this block, whatever the environment says (the
    benchmark's "triton-native" provider)."""
    return _choose(True)


def disabled():
    """The Python path within this block, whatever the environment says (the
    benchmark's "triton" provider)."""
    return _choose(False)


def module(build: bool = True):
    """The built extension, or None (see `why_not`). Built once per process into a
    cache folder per torch version and source (about 45 s on a 2-core CPU), loaded
    from there by later processes."""
    if "module" not in _state and build:
        _state["module"], _state["why_not"] = _build()
        if _state["module"] is None:
            print(f"colossal_lab: RMSNorm's C++ path is unavailable ({_state['why_not']}); "
                  "the Python path runs", file=sys.stderr)
    return _state.get("module")


def why_not() -> str | None:
    """Why `module()` is None, after a build was tried."""
    return _state.get("why_not")


def _build():
    try:
        from torch.utils import cpp_extension

        # ninja may sit in this Python's environment without being on PATH
        bindir = str(Path(sys.executable).parent)
        if shutil.which("ninja") is None and (Path(bindir) / "ninja").exists():
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        cuda = _cuda_include()  # real launches need the current CUDA stream
        digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
        tag = f"{torch.__version__}-{'cuda' if cuda else 'cpu'}-{digest}"
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
        build_dir = Path(os.environ.get("COLOSSAL_LAB_NATIVE_DIR",
                                        Path.home() / ".cache" / "colossal_lab")) / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            print("colossal_lab: building RMSNorm's C++ path (once per torch version, "
                  f"about a minute) in {build_dir}", file=sys.stderr, flush=True)
        options = dict(extra_cflags=["-O2"])
        if cuda:
            options.update(extra_cflags=["-O2", "-DCOLOSSAL_LAB_WITH_CUDA"],
                           extra_include_paths=[cuda], extra_ldflags=["-lc10_cuda"])
        with _build_lock(build_dir):
            mod = cpp_extension.load(
                f"colossal_lab_rms_norm_native_{'cuda' if cuda else 'cpu'}", [str(SOURCE)],
                build_directory=str(build_dir), verbose=False, **options)
        return mod, None
    except Exception as e:  # no compiler, no ninja, a header missing ...
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an OS lock on build_dir while torch builds or loads the extension there.

    torch's own lock is a file that a builder creates and deletes; a build killed half
    way (a timeout, Ctrl-C) leaves it behind, and every later process then waits for it
    forever. The OS releases this lock when its holder dies, so whoever holds it knows
    that no live process is building here, and a torch lock file left over is stale."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(build_dir / "colossal_lab.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"colossal_lab: removing {stale}, left by a build that was "
                      "interrupted", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cuda_include() -> str | None:
    """CUDA's include folder, for a torch built with CUDA on a machine with a GPU (the
    CUDA toolkit's, the `nvidia-cuda-runtime` wheel's, or the one Triton ships for its
    own launcher); None otherwise: the extension is then built to record launches only
    (tests on a CPU)."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [Path(CUDA_HOME) / "include"] if CUDA_HOME else []
    try:
        import nvidia.cuda_runtime as runtime  # the pip wheel torch depends on

        candidates += [Path(p) / "include" for p in runtime.__path__]
    except ImportError:
        pass
    import triton

    candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "include")
    for c in candidates:
        if (c / "cuda_runtime_api.h").exists():
            return str(c)
    return None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """y through a registered plan, or None (no plan for this shape yet, or the native
    path is off): the caller then takes the Python path."""
    if torch.compiler.is_compiling() or not (requested() and x.is_cuda):
        return None  # (while dynamo traces, the Python path: it can trace that one)
    mod = module()
    return None if mod is None else mod.rms_norm(x, w, eps)


_PTX_ENTRY = re.compile(r"\.entry\s+\w+\s*\((.*?)\)", re.S)
_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)")


@functools.lru_cache(maxsize=256)
def ptx_params(ptx: str) -> tuple[str, ...]:
    """The kernel's parameter types as its PTX declares them ("u64", "u32", "f32", ...):
    the arguments that were not constexpr, then Triton's scratch pointers. Cached per
    PTX text: a shape whose plan cannot complete (a backward that never registers, e.g.
    on a strided upstream gradient) registers its forward on every call."""
    entry = _PTX_ENTRY.search(ptx)
    return tuple(_PTX_PARAM.findall(entry.group(1))) if entry else ()


_FITS = {"t": ("u64", "b64", "s64"), "n": ("u64", "b64", "s64"),
         "i": ("u32", "b32", "s32"), "l": ("u64", "b64", "s64"), "f": ("f32", "b32")}


def kernel_params(args: tuple, slots: tuple, ptx: str) -> list[tuple[str, int]] | None:
    """Where each kernel parameter comes from, for the C++ side: ("t", slot) for a tensor
    (`slots[i]`: the C++ slot of the tensor at argument i), ("i", v) / ("l", v) for a
    32 / 64-bit integer,
    ("f", 0) for the float (eps), ("n", 0) for a trailing null pointer (Triton's scratch
    arguments). Integers equal to 1 are left out: Triton compiles them in as constants.
    None when the list does not match the kernel's PTX parameters."""
    out: list[tuple[str, int]] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if i >= len(slots) or slots[i] is None:
                return None
            out.append(("t", slots[i]))
        elif isinstance(a, bool):
            return None  # no runtime bools in our kernels: a surprise, stay in Python
        elif isinstance(a, int):
            if a != 1:
                out.append(("i" if -(1 << 31) <= a < (1 << 31) else "l", a))
        elif isinstance(a, float):
            out.append(("f", 0))
        else:
            return None
    types = ptx_params(ptx)
    if len(types) < len(out) or len(types) - len(out) > 2:
        return None
    out += [("n", 0)] * (len(types) - len(out))
    if any(t not in _FITS[k] for (k, _), t in zip(out, types)):
        return None
    return out


FORWARD_SLOTS = ("x", "w", "y", "rstd")
BACKWARD_SLOTS = ("dy", "x", "w", "rstd", "dx", "partials", "dw")
"""The tensors the C++ forward and backward hand their launches, in this order (the
`slots` of `register_launch` index these)."""


def register_launch(which: str, x: torch.Tensor, w: torch.Tensor, runner, grid: tuple,
                    args: tuple, slots: tuple, programs: int = 0) -> bool:
    """Hand one launch the Python path just made for (x, w) to the C++ plan of that
    shape (`which`: "forward", "backward" or "sum"; `slots`: per argument, the index
    of that tensor in `FORWARD_SLOTS` or `BACKWARD_SLOTS`, None for the others). False
    (and nothing registered) where the launch cannot be replayed from C++."""
    mod = module()
    if mod is None or runner is None:
        return False
    compiled = runner.compiled
    meta = compiled.metadata
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False) or \
            getattr(meta, "launch_cooperative_grid", False):
        return False  # launched with attributes cuLaunchKernel does not take
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return False  # needs scratch memory that Triton's launcher allocates per launch
    params = kernel_params(args, slots, compiled.asm["ptx"])
    if params is None:
        return False
    g = (*grid, 1, 1)[:3]
    mod.set_launch(mod.key_of(x, w), which, int(runner.function), list(g),
                   32 * meta.num_warps, int(meta.shared), params, programs)
    return True
