"""colossal_lab: ColossalAI's eight throughput switches, built from scratch and measured.

    from colossal_lab import Switches, apply_switches, build_model, preset
    model = apply_switches(build_model(preset("llama-7b-8l"), "cuda"),
                           Switches(enable_flash_attention=True, precision="bf16"))

The library behind the book, in layers that import only downward: `kernels` (Triton),
`ops` (each op's reference, dispatch and autograd), `model` (a plain LLaMA), `switches`
(`apply_switches` and one `apply` per switch), `parallel`, `training`, `measure` (timing,
MFU, results) and the experiments behind each chapter (`benchmarks`).
"""

__version__ = "0.1.0"

import os  # noqa: E402

import torch  # noqa: E402

# Triton's interpreter must be chosen before anything imports triton (torch may do so
# lazily, e.g. from the benchmark CLI), so the package root decides, not `kernels`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from colossal_lab.config import ModelConfig, Switches, preset  # noqa: E402
from colossal_lab.model import build_model  # noqa: E402
from colossal_lab.switches.apply import apply_switches  # noqa: E402

__all__ = ["ModelConfig", "Switches", "apply_switches", "build_model", "preset"]
