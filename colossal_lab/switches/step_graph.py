"""`enable_compile="graph"`: the whole training step replayed as one CUDA graph.

**What it does.** With every kernel switch on, a step of `llama-7b-8l` is several
hundred kernel launches (forward, backward, the norm of the gradients, one AdamW
launch per parameter), and the host issues each one through Python. The GPU runs ahead
of the host for most of the step, because the GEMMs are long; where short kernels
follow each other (the step's first layer, the optimizer's small parameters) it waits,
and the profile of chapter 09 counts that time as *idle*. A CUDA graph records the
launches of one step once; replaying it issues the whole step with one call, so no
kernel waits for the host and nothing is re-decided per step.

**How.** `GraphedStep` wraps a step of `train.make_step`:

1. the first call runs the step eagerly: Triton compiles our kernels, cuDNN builds its
   plans, and the optimizer creates its state (a graph must not contain any of that;
   a state created inside the capture would be created again on every replay);
2. the same call then captures one step (`timing._capture`: a memory pool and a stream
   of its own) on static input buffers, without running it: capturing records the
   kernels, it does not execute them;
3. every later call copies its batch into the static buffers and replays the graph.

The parameters, gradients, masters, moments and step counts are the same tensors in
the eager step and in the graph, updated in place, so a checkpoint reads what the
replays wrote. A batch of another shape, or a changed learning rate, weight decay,
betas or eps (baked into the launches as numbers), captures again. Load a checkpoint
*before* the first step: loading replaces the optimizer's state tensors, which a graph
captured earlier would no longer see.

**What it refuses** (`check`, one line each, before anything is built): a device that
is not a GPU; fp8 with delayed scaling (its amax history advances a host-side position
every step, which a replay would not); fp16 and torch's AdamW (not capturable as
built); gradient checkpointing (its recompute stashes RNG states, untested under
capture); data, tensor and pipeline parallelism (collectives and schedules, not
composed yet).
The numerics are the eager step's: the same kernels in the same order.

**Measured** (H200, `notes/probe_step_graph.py`, notes/probes/step_graph_71fb95e.json):
the best bf16 step of `llama-7b-8l` takes 311.0 ms replayed against 311.9 ms eager,
level within the p10-p90 spreads, for a 56 ms capture and the same peak memory. With
GEMMs of milliseconds the host stays ahead of the GPU for nearly the whole step, so a
graph has little to take there; it matters where the kernels are short.
"""

from __future__ import annotations

import time

import torch

from colossal_lab.measure import timing


def check(switches, device=None) -> None:
    """Refuse what `enable_compile="graph"` cannot capture (see the module docstring)."""
    from colossal_lab import precision

    value = switches.enable_compile
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"enable_compile={value!r} replays the training step as a CUDA "
                         f"graph: it needs a GPU, not {torch.device(device).type}")
    extra = switches.extra or {}
    refused = {
        "fp8 with delayed scaling (its amax history moves a host-side position every "
        "step)": switches.precision == "fp8" and extra.get("fp8_scaling") == "delayed",
        "fp16 (its loss scaler is not captured yet)": switches.precision == "fp16",
        "torch's AdamW (built with capturable=False): set enable_fused_optimizer=True":
            device is not None and precision.optimizer_backend(
                switches.enable_fused_optimizer, device) != "triton",
        "gradient checkpointing (not captured yet)":
            bool(switches.gradient_checkpoint_config),
        "data parallelism (overlap_communication; not captured yet)":
            bool(switches.overlap_communication),
        "tensor parallelism (enable_sequence_parallelism; not captured yet)":
            bool(switches.enable_sequence_parallelism),
    }
    if named := [k for k, v in refused.items() if v]:
        raise ValueError(f"enable_compile={value!r} does not capture {named[0]}")


class GraphedStep:
    """`step(input_ids, labels) -> loss`, replayed as a CUDA graph after one eager call.

    `capture_s`: the wall time of the last capture; `captures`: how many were made."""

    def __init__(self, step, optimizer, device):
        self.step, self.optimizer, self.device = step, optimizer, torch.device(device)
        self.scaler, self.precision = step.scaler, step.precision
        self.flush = step.flush  # (a deferred update is refused with a graph)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None
        self.capture_s: float | None = None
        self.captures = 0

    def _key(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        hyper = tuple((g["lr"], g.get("weight_decay"), tuple(g.get("betas", ())),
                       g.get("eps")) for g in self.optimizer.param_groups)
        return (tuple(input_ids.shape), input_ids.dtype, tuple(labels.shape),
                labels.dtype, hyper)

    def _capture(self, input_ids: torch.Tensor, labels: torch.Tensor, key) -> None:
        self.graph = self.inputs = self.loss = None  # an older graph's pool goes first
        start = time.perf_counter()
        self.inputs = (input_ids.to(self.device, copy=True),
                       labels.to(self.device, copy=True))
        graph = torch.cuda.CUDAGraph()

        def one_step():
            self.loss = self.step(*self.inputs)

        timing._capture(one_step, graph)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graph, self.key = graph, key
        self.capture_s = round(time.perf_counter() - start, 3)
        self.captures += 1

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        key = self._key(input_ids, labels)
        if self.captures == 0:  # the eager step, then the capture
            loss = self.step(input_ids, labels)
            self._capture(input_ids, labels, key)
            return loss
        if key != self.key:
            self._capture(input_ids, labels, key)
        self.inputs[0].copy_(input_ids, non_blocking=True)
        self.inputs[1].copy_(labels, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites the graph's own
