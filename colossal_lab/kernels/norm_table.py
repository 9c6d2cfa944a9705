"""Tuned launch settings of the fused norms, per GPU; generated, do not edit by hand.

`python -m colossal_lab.benchmarks.fused_norm --write-table` rewrites this file from
`results/<gpu>/fused_norm_tune.json` (made by `bench fused_norm --tune` on that GPU).
`_norm_common.launch_config` consults `TABLES[<GPU name>]["<block>/<dtype>/<pass>"]`
(the GPU as `torch.cuda.get_device_name()` and the tune results' provenance name it)
(block = next_power_of_2(H), pass "fwd" or "bwd") and falls back to its heuristic for
a GPU or key that is absent. Keys of an entry: rows, num_warps and, for "bwd",
programs_per_sm, num_stages, prefetch (RMSNorm only) and, tuned at small token
counts, min_rows_per_program. A "<block>/<dtype>/<pass>/small" entry (whole launches
tuned at 1024 tokens) overrides its pass's entry at up to `_norm_common.SMALL_ROWS` rows.
"""

# from results/h200/fused_norm_tune.json, commit 4d581d2b1c
TABLES: dict[str, dict[str, dict[str, int | bool]]] = (
    {'NVIDIA H200': {'1024/bfloat16/bwd': {'min_rows_per_program': 2},
                     '1024/bfloat16/bwd/small': {'min_rows_per_program': 1,
                                                 'num_stages': 1,
                                                 'num_warps': 4,
                                                 'prefetch': False,
                                                 'programs_per_sm': 2,
                                                 'rows': 4},
                     '1024/float32/bwd': {'min_rows_per_program': 1},
                     '1024/float32/bwd/small': {'min_rows_per_program': 1,
                                                'num_stages': 1,
                                                'num_warps': 4,
                                                'prefetch': False,
                                                'programs_per_sm': 2,
                                                'rows': 4},
                     '2048/bfloat16/bwd': {'min_rows_per_program': 4},
                     '2048/float32/bwd': {'min_rows_per_program': 4},
                     '4096/bfloat16/bwd': {'min_rows_per_program': 2,
                                           'num_stages': 1,
                                           'num_warps': 8,
                                           'prefetch': True,
                                           'programs_per_sm': 2,
                                           'rows': 1},
                     '4096/bfloat16/fwd': {'num_warps': 8, 'rows': 1},
                     '4096/float32/bwd': {'min_rows_per_program': 4}}}
)
