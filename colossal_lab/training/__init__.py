"""Training: the step, the optimizer, the loop, checkpoints, the corpus, the memory
model of a step and the `train` command."""
