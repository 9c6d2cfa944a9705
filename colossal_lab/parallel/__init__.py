"""Parallelism applied to a plain model: process groups and meshes (`distributed`),
tensor and sequence parallelism, data-parallel gradient synchronisation, the global
gradient norm and the pipeline schedules with their runtime."""
