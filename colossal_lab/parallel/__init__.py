"""Parallelism applied to a plain model: meshes, tensor, data and pipeline parallelism.

`distributed` starts the processes and their mesh; `tensor_parallel` (switch 5),
`data_parallel` (switch 8) and `pipeline` (switch 7) each transform the model; `grad_norm`
clips a model split over ranks.
"""
