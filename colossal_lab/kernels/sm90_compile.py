"""Compile a Gluon or Triton kernel for sm_90 without a GPU, and read what it became.

Gluon has no interpreter, so a machine without a Hopper GPU (CI, a laptop) cannot run
the Hopper kernels; it can still compile them. `compile_sm90` lowers a kernel for
compute capability 9.0 and assembles its PTX with the ptxas that ships with Triton, which
reports registers and spills: the checks that the kernel builds for its target at all
and that no change pushed it into local memory. For a Triton kernel the interpreter
runs the arithmetic but not the compiler's choices: `row_reduction_layouts` reads from
the TTGIR how each row sum is spread over a thread's registers, lanes and warps, which
decides the order a GPU adds in (two kernels that share it sum a row to the same bits).
Run it in a process where TRITON_INTERPRET is unset (the tests start one).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4,
                 divisible: tuple[str, ...] = ()) -> dict:
    """Compile `fn` (a `gluon.jit` or `triton.jit` function) for sm_90a.

    Args:
        signature: argument name -> Triton type string ("*bf16", "i32", "fp32", a mangled
            tensor descriptor); constexprs are added as "constexpr".
        constexprs: the constexpr arguments' values.
        divisible: arguments (pointers, integers) to treat as multiples of 16, as a launch
            specialises them.
    Returns:
        {"num_warps", "shared_bytes", "registers", "spill_bytes", "ptxas", "ttgir"}
        where spill_bytes counts spill stores and "ptxas" is its full report.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    kernel = triton.compile(source(fn, sig, constexprs, attrs),
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
            "spill_bytes": int(spills[-1]) if spills else 0, "ptxas": out.stderr,
            "ttgir": kernel.asm["ttgir"]}


def row_reduction_layouts(ttgir: str) -> list[dict]:
    """How each reduction along the last axis of a 2-D tile (`tl.sum(t, axis=1)`) in
    `ttgir` spreads a row, in program order: {"per_thread", "lanes", "warps"} along the
    row (a blocked layout's sizePerThread, threadsPerWarp and warpsPerCTA along it). A
    thread adds its per_thread elements (and their repeats along the row) in order, then
    the lanes combine, then the warps: kernels whose rows share the three numbers add a
    row in the same order, whatever the tile's other dimension (what `rms_norm_fp8`
    builds on; its GPU test checks the bits)."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{.*\}>)$", ttgir, re.M))
    out = []
    for operand in re.findall(r'"tt\.reduce"\(%[^)]*\) <\{axis = 1 : i32\}>.*?\}\) : '
                              r"\(tensor<\d+x\d+x\w+, (#\w+)>\)", ttgir, re.S):
        layout = layouts[operand]
        along = {key: int(re.search(rf"{key} = \[\d+, (\d+)\]", layout).group(1))
                 for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA")}
        out.append({"per_thread": along["sizePerThread"], "lanes": along["threadsPerWarp"],
                    "warps": along["warpsPerCTA"]})
    return out
