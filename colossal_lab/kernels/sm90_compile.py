"""Compile a Gluon kernel for sm_90 without a GPU, and read what ptxas says about it.

Gluon has no interpreter, so a machine without a Hopper GPU (CI, a laptop) cannot run
the Hopper kernels; it can still compile them. `compile_sm90` lowers a kernel for
compute capability 9.0 and assembles its PTX with the ptxas that ships with Triton, which
reports registers and spills: the checks that the kernel builds for its target at all
and that no change pushed it into local memory. Run it in a process where
TRITON_INTERPRET is unset (the tests start one).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4) -> dict:
    """Compile `fn` (a `gluon.jit` function) for sm_90a.

    Args:
        signature: argument name -> Triton type string ("*bf16", "i32", "fp32", a mangled
            tensor descriptor); constexprs are added as "constexpr".
        constexprs: the constexpr arguments' values.
    Returns:
        {"num_warps", "shared_bytes", "registers", "spill_bytes", "ptxas"} where
        spill_bytes counts spill stores and "ptxas" is its full report.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs, {}),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx),
                              "-o", str(ptx.with_suffix(".cubin"))],
                             capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"ptxas failed:\n{out.stderr}")
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    return {"num_warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared,
            "registers": int(regs[-1]) if regs else None,
            "spill_bytes": int(spills[-1]) if spills else 0, "ptxas": out.stderr}
