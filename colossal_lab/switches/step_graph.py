"""`enable_compile="graph"` (no ColossalAI flag): the whole training step replayed as a CUDA graph.

**What it does.** A step of `llama-7b-8l` with every kernel switch on is several hundred
launches, each issued by the host through Python. Where short kernels follow each other
(the first layer, the optimizer's small parameters) the GPU waits for the host, time the
profile of chapter 09 counts as *idle*. A CUDA graph records one step's launches once;
replaying it issues the whole step with one call. The model is not changed: the step of
`training.train.make_step` is wrapped in a `GraphedStep`, which

1. runs the first step eagerly (Triton compiles, cuDNN plans, the optimizer creates its
   state: none of that may sit inside a graph); with fp8 delayed scaling a second one,
   since the first casts are dynamic and the steady state's kernel variants (a cast
   scaled from the history, the ring's filing with its reset) first run in step two;
2. then captures one step on static input buffers (`timing._capture`), without running it;
3. later copies each batch into those buffers and replays.

Parameters, gradients, masters, moments and step counts are the same tensors eager and
replayed, updated in place, so a checkpoint reads what the replays wrote. Another batch
shape, or a changed lr, weight decay, betas or eps (baked into the launches), captures
again. Load a checkpoint *before* the first step: loading replaces the optimizer's state
tensors, which an earlier graph would no longer see. `check` refuses what a replay
cannot reproduce: no GPU, fp16 and torch's AdamW (not capturable as built), gradient
checkpointing, data, tensor and pipeline parallelism. The numerics are the eager step's.

**fp8.** Both scalings capture. Dynamic scaling keeps nothing between steps. Delayed
scaling's amax-history ring lives on the device (`ops.fp8._Scaler`): the write position
is a (1,) tensor that one kernel advances after each cast, so every replay files its
amaxes in the next slot, as the eager steps do. Its one host-side flag (has the history
started?) is set by the first, dynamic cast of each role, in the eager first step; a
capture that meets a role still unstarted raises rather than replaying a dynamic cast
forever.

**What it buys.** Probed on an H200 at `llama-7b-8l`, bf16, the replayed step is level
with the eager one within the p10-p90 spreads: with GEMMs of milliseconds the host
stays ahead of the GPU nearly all the step. A graph matters where the kernels are short.
"""

from __future__ import annotations

import time

import torch

from colossal_lab import precision
from colossal_lab.measure import timing
from colossal_lab.switches import fp8 as fp8_switch


def check(switches, device=None) -> None:
    """Refuse what `enable_compile="graph"` cannot capture (see the module docstring).

    Every precision but fp16 is taken, fp8 with dynamic or delayed scaling alike."""
    value = switches.enable_compile
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"enable_compile={value!r} replays the training step as a CUDA "
                         f"graph: it needs a GPU, not {torch.device(device).type}")
    refused = {
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
    """`step(input_ids, labels) -> loss`, replayed as a CUDA graph after one eager call
    (two where the first started fp8 delayed-scaling histories).

    `capture_s`: the wall time of the last capture; `captures`: how many were made;
    `eager_steps`: how many calls ran eagerly before the first capture."""

    def __init__(self, step, optimizer, device):
        self.step, self.optimizer, self.device = step, optimizer, torch.device(device)
        self.scaler, self.precision = step.scaler, step.precision
        self.flush = step.flush  # (a deferred update is refused with a graph)
        self.close = step.close
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None
        self.capture_s: float | None = None
        self.captures = 0
        self.eager_steps = 0

    def _key(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        hyper = tuple((g["lr"], g.get("weight_decay"), tuple(g.get("betas", ())),
                       g.get("eps")) for g in self.optimizer.param_groups)
        return (tuple(input_ids.shape), input_ids.dtype, tuple(labels.shape),
                labels.dtype, hyper)

    def _capture(self, input_ids: torch.Tensor, labels: torch.Tensor, key) -> None:
        self.graph = self.inputs = self.loss = None  # an older graph's pool goes first
        if self.device.type == "cuda":  # the eager steps' cached blocks back to the
            torch.cuda.empty_cache()  # device: the graph's private pool allocates anew
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
            started = fp8_switch.histories_started(self.step.inner)
            loss = self.step(input_ids, labels)
            self.eager_steps += 1
            # a step that started fp8 histories ran dynamic first casts: the next one
            # runs eagerly too, compiling the steady state's kernels outside the graph
            if fp8_switch.histories_started(self.step.inner) == started:
                self._capture(input_ids, labels, key)
            return loss
        if key != self.key:
            self._capture(input_ids, labels, key)
        self.inputs[0].copy_(input_ids, non_blocking=True)
        self.inputs[1].copy_(labels, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites the graph's own
