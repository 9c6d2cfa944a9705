"""Tuned launch settings of the fused norms, per GPU; generated, do not edit by hand.

`python -m colossal_lab.benchmarks.fused_norm --write-table` rewrites this file from
`results/<gpu>/fused_norm_tune.json` (made by `bench fused_norm --tune` on that GPU).
`_norm_common.launch_config` consults `TABLES[<GPU name>]["<block>/<dtype>/<pass>"]`
(the GPU as `torch.cuda.get_device_name()` and the tune results' provenance name it)
(block = next_power_of_2(H), pass "fwd" or "bwd") and falls back to its heuristic for
a GPU or key that is absent. Keys of an entry: rows, num_warps and, for "bwd",
programs_per_sm, num_stages, prefetch (RMSNorm only) and, tuned at small token
counts, min_rows_per_program.
"""

TABLES: dict[str, dict[str, dict[str, int]]] = {}
