"""One module per throughput switch: reference, dispatch, autograd wiring, module."""
