"""The finale's loss curves: the naive model against every switch, on real text.

The ~55M-parameter LLaMA of chapter 06's curves (`precision.CURVE_CFG`, every width a
multiple of 16 so that fp8 applies to every linear), trained 300 steps on the corpus
from the same seed and batches: every switch off in fp32 ("naive"), the naive model
again from three other seeds ("naive-seed1" .. "naive-seed3": how far equally good runs
land apart, the noise), switches 1-3 in fp32 ("s123-fp32": the kernels of chapters 01-03
without a change of precision), every switch in bf16 ("best", AdamW's moments in bf16),
the same with fp32 moments ("best-m32", `composed.BEST_M32`), and in fp8 ("best-fp8").
The switches change the arithmetic, not the model: their final losses should differ
from the naive one's by no more than the naive runs differ from each other.

    python -m colossal_lab bench composed_curves         # -> composed_curves.json
    python -m colossal_lab bench composed_curves --quick # tiny model, 6 steps
"""

from __future__ import annotations

from colossal_lab.benchmarks.composed import BEST_M32, S123
from colossal_lab.benchmarks.curves import FINAL_WINDOW, Curve, run_curves
from colossal_lab.benchmarks.harness import Benchmark
from colossal_lab.benchmarks.precision import CURVE_CFG, CURVE_RUN
from colossal_lab.config import SWITCH_SETS, tiny

NAME = "composed_curves"
NAIVE_SEEDS = (1, 2, 3)
"""The naive model's other seeds: the noise is the largest of their distances to naive."""
CURVES = (Curve("naive", SWITCH_SETS["naive"]),
          *(Curve(f"naive-seed{s}", SWITCH_SETS["naive"], seed=s) for s in NAIVE_SEEDS),
          Curve("s123-fp32", S123.replace(precision="fp32")),
          Curve("best", SWITCH_SETS["best"]),
          Curve("best-m32", BEST_M32),
          Curve("best-fp8", SWITCH_SETS["best-fp8"]))


QUICK = ("naive", "naive-seed1", "best")


def run(quick: bool = False) -> list[dict]:
    if quick:  # the CPU: no fp8 tensor cores, and torch's AdamW (fp32 moments, as
        # best-m32's), so the fp8 and fp32-moment curves are left out, and one other
        # seed is enough to exercise the noise
        run_args = dict(batch=4, seq_len=32, steps=6, lr=3e-3, max_files=20, log_every=3,
                        eval_batches=1)
        return run_curves([c for c in CURVES if c.name in QUICK],
                          tiny().replace(intermediate_size=176), run_args,
                          reference="naive")
    return run_curves(CURVES, CURVE_CFG, CURVE_RUN, reference="naive")


def config_of() -> dict:
    return {"model": {k: getattr(CURVE_CFG, k) for k in
                      ("vocab_size", "hidden_size", "intermediate_size",
                       "num_hidden_layers", "num_attention_heads")},
            "run": CURVE_RUN, "data": "corpus (Python standard library source)",
            "final_window": FINAL_WINDOW,
            "curves": {c.name: {"switches": repr(c.switches), "seed": c.seed}
                       for c in CURVES}}


BENCH = Benchmark(NAME, __doc__, quick_help="tiny model, 6 steps, not saved",
                  run=lambda a: run(a.quick), config=lambda a: config_of())
main = BENCH.main


if __name__ == "__main__":
    main()
