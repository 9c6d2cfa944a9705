"""Chapter 01's MFU delta: the attention kernel alone changes in a `llama-7b-8l` step.

Norm stays eager (switch 2 off), bf16 autocast. Naive attention needs micro-batches of
one sequence to fit; the kernels that never store the S×S scores run the whole batch.

    python -m colossal_lab bench flash_attention_step
"""

from colossal_lab.benchmarks.steps import Setup, chapter_benchmark
from colossal_lab.config import Switches

SETUPS = (
    Setup("attn-naive", "naive attention (scores materialised)",
          switches=Switches(enable_flash_attention=False), micro_batch=1),
    Setup("attn-sdpa-flash", "PyTorch SDPA, flash backend (FA2)",
          switches=Switches(enable_flash_attention="sdpa-flash")),
    Setup("attn-cudnn", "PyTorch SDPA, cuDNN backend",
          switches=Switches(enable_flash_attention="cudnn")),
    Setup("attn-triton", "ours: Triton FlashAttention-2",
          switches=Switches(enable_flash_attention="triton")),
)


run, main = chapter_benchmark("flash_attention_step", SETUPS)

if __name__ == "__main__":
    main()
