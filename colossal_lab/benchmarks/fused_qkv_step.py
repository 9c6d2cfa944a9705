"""Chapter 03's MFU delta: only the projections change in a `llama-7b-8l` step.

Switches 1 and 2 on, bf16 autocast; the q/k/v and gate/up projections separate, fused,
and fused with our Triton SwiGLU (`fused_qkv.SETUPS`).

    python -m colossal_lab bench fused_qkv_step
"""

from colossal_lab.benchmarks.fused_qkv import SETUPS
from colossal_lab.benchmarks.steps import chapter_benchmark

run, main = chapter_benchmark("fused_qkv_step", SETUPS)

if __name__ == "__main__":
    main()
