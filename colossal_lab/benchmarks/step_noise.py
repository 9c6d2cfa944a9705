"""Why some training steps take far longer than others: the garbage collector.

Steps timed with 6-8 iterations showed p90 up to 60% above the median for some setups
(gradient checkpointing, fp8 with dynamic scaling) and not for others. The noisiest
such setup is timed here for 30 steps twice, in its own process: with Python's automatic
garbage collection on, and with collection held between steps
(`train.gc_between_steps`, what every benchmark and `train` do). Each row keeps
every step's time (`step_ms_all`) and the collector's pause during it (`gc_ms_all`),
so a slow step can be matched with a pause.

    python -m colossal_lab bench step_noise
"""

from __future__ import annotations

import dataclasses

from colossal_lab.benchmarks.steps import Setup, chapter_benchmark
from colossal_lab.config import Switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig

_CKPT = Setup("ckpt-full", "full recomputation, switches 1-2",
              switches=Switches(enable_flash_attention=True,
                                enable_fused_normalization="triton",
                                gradient_checkpoint_config=GradientCheckpointConfig()),
              iters=30)
_GC = {"python": "automatic GC", "between_steps": "GC held between steps"}
SETUPS = tuple(dataclasses.replace(s, name=f"{s.name}-{p}", gc_policy=p,
                                   label=f"{s.label}; {_GC[p]}")
               for s in (_CKPT,) for p in _GC)
"""Full recomputation, the noisiest setup of the old runs, both ways (fp8 with dynamic
scaling, the other noisy one, is timed with the collector held in `precision`)."""


run, main = chapter_benchmark("step_noise", SETUPS)

if __name__ == "__main__":
    main()
