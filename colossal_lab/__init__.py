"""colossal_lab: ColossalAI's eight throughput switches, built from scratch and measured.

The library behind the book: the MFU meter (`mfu`), timing and recorded results
(`bench`, `results`), a compact LLaMA (`model`) whose parts the switches swap
(`switches`), Triton kernels (`kernels`), a real-text corpus (`data`) and a trainer
(`train`).
"""

__version__ = "0.1.0"

import os  # noqa: E402

import torch  # noqa: E402

# Triton's interpreter must be chosen before anything imports triton (torch may do so
# lazily, e.g. from the benchmark CLI), so the package root decides, not `kernels`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from colossal_lab.config import ModelConfig, Switches, preset  # noqa: E402,F401
