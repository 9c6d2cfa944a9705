"""Chapter 02's MFU delta: only the RMSNorm kernel changes in a `llama-7b-8l` step.

Switch 1 is on (the best attention backend on this device), bf16 autocast.

    python -m colossal_lab bench fused_norm_step
"""

from colossal_lab.benchmarks.steps import Setup, chapter_benchmark
from colossal_lab.config import Switches

SETUPS = tuple(
    Setup(f"norm-{b}", label, switches=Switches(enable_flash_attention=True,
                                                enable_fused_normalization=b))
    for b, label in (("eager", "eager RMSNorm (PyTorch ops)"),
                     ("torch", "F.rms_norm"),
                     ("liger", "Liger RMSNorm"),
                     ("triton", "ours: Triton RMSNorm + fused residual add"))
)


run, main = chapter_benchmark("fused_norm_step", SETUPS)

if __name__ == "__main__":
    main()
