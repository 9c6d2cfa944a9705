"""Training: the step, the optimizer, the loop, checkpoints, the corpus and the command.

`step` (one training step), `optimizer`, `train` (the loop and `measure_step`),
`checkpoint`, `data` (the corpus), `memory` (a step's memory, measured and modelled)
and `cli` (the `train` command)."""
