"""The model's building blocks, one module per op: the eager reference, the dispatch to a
backend, and the autograd wiring (attention, norm, rope, SwiGLU and fused projections,
cross entropy, embedding, fp8 linear); `kernel_switch` is the backend choice they share."""
