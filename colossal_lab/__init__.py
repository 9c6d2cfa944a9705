"""colossal_lab: ColossalAI's eight throughput switches, built from scratch and measured.

The library behind the book: the MFU meter (`mfu`), timing and recorded results
(`bench`, `results`), a compact LLaMA (`model`) whose parts the switches swap
(`switches`), Triton kernels (`kernels`), a real-text corpus (`data`) and a trainer
(`train`).
"""

__version__ = "0.1.0"

from colossal_lab.config import ModelConfig, Switches, preset  # noqa: E402,F401
