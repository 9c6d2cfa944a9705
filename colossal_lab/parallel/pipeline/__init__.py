"""Switch 7, pipeline parallelism: schedules as data, a validator and a simulator.

`schedules` builds the per-rank programs (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V)
as plain lists of actions, `validate` checks one (every F, B and W exactly once,
dependencies, no deadlock under blocking point-to-point, peak live activations) and
`simulate` times it from per-action costs (timeline, bubble, makespan, Gantt plots and
the explorer); `sim_rows` turns a measurement's recorded per-layer costs into the
simulated rows of a results file. Nothing here needs torch or a GPU.
"""
