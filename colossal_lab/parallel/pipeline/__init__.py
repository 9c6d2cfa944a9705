"""Switch 7, pipeline parallelism: schedules as data, checked, simulated and run.

`schedules` builds the per-rank programs (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) as
plain lists of actions, `validate` checks one (every F, B and W exactly once,
dependencies, no deadlock under blocking point-to-point, peak live activations),
`simulate` times it from per-action costs and `sim_rows` turns a measurement's recorded
per-layer costs into simulated rows: none of them needs torch. `stages` cuts the model
into stages and `runtime` runs a schedule on them over `torch.distributed`.
"""
