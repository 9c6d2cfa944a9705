"""GPU benchmarks, one module per experiment, found by name (`get`).

Each module has `run(quick=False) -> rows` and `main(argv)`, its `harness.Benchmark`'s
command line, which saves `results/<gpu>/<name>.json` with provenance;
`python -m colossal_lab bench NAME [--quick]` runs one. Providers are compared side by
side in one process (one run, ratios), never across runs.
"""

import importlib

BENCHMARKS = {
    "baseline": "colossal_lab.benchmarks.baseline",
    "checkpointing": "colossal_lab.benchmarks.checkpointing",
    "composed": "colossal_lab.benchmarks.composed",
    "collectives": "colossal_lab.benchmarks.collectives",
    "composed_curves": "colossal_lab.benchmarks.composed_curves",
    "composed_2x2": "colossal_lab.benchmarks.composed_2x2",
    "composed_parallel": "colossal_lab.benchmarks.composed_parallel",
    "cross_entropy": "colossal_lab.benchmarks.cross_entropy",
    "flash_attention": "colossal_lab.benchmarks.flash_attention",
    "flash_attention_step": "colossal_lab.benchmarks.flash_attention_step",
    "fused_norm": "colossal_lab.benchmarks.fused_norm",
    "fused_norm_step": "colossal_lab.benchmarks.fused_norm_step",
    "fused_qkv": "colossal_lab.benchmarks.fused_qkv",
    "fused_qkv_step": "colossal_lab.benchmarks.fused_qkv_step",
    "grad_overlap": "colossal_lab.benchmarks.grad_overlap",
    "grad_overlap_measured": "colossal_lab.benchmarks.grad_overlap_measured",
    "optimizer": "colossal_lab.benchmarks.optimizer",
    "pipeline_measured": "colossal_lab.benchmarks.pipeline_measured",
    "pipeline_sim": "colossal_lab.benchmarks.pipeline_sim",
    "precision": "colossal_lab.benchmarks.precision",
    "profile_breakdown": "colossal_lab.benchmarks.profile_breakdown",
    "rope": "colossal_lab.benchmarks.rope",
    "sequence_parallel_gemm": "colossal_lab.benchmarks.sequence_parallel_gemm",
    "sequence_parallel_step": "colossal_lab.benchmarks.sequence_parallel_step",
    "spot_check": "colossal_lab.benchmarks.spot_check",
    "step_floor": "colossal_lab.benchmarks.step_floor",
    "step_noise": "colossal_lab.benchmarks.step_noise",
    "waterfall": "colossal_lab.benchmarks.waterfall",
}


def get(name: str):
    try:
        return importlib.import_module(BENCHMARKS[name])
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}") from None
