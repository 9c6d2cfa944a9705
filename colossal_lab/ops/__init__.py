"""The model's building blocks, one module per op: reference, dispatch and autograd wiring.

Attention, norm, rope, SwiGLU and fused projections, cross entropy, embedding and the fp8
linear; `kernel_switch` is the backend rule they share. The ops take a backend argument
and know nothing of `Switches`: `colossal_lab.switches` sets the backends on a model.
"""
