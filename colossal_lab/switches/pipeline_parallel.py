"""Switch 7, pipeline parallelism: cuts a model into this rank's stages and runs a schedule.

ColossalAI's ``pp_size`` with `pp_style` ("1f1b", "interleaved", "zbv"; ours also "gpipe",
"zb-h1"), `num_microbatches`, `num_model_chunks` and `overlap_p2p`: the layers are cut
into stages on the ranks of the mesh's "pp" dim, and each step's batch flows through
them as m micro-batches in the order a schedule gives.

`apply(model, switches, mesh)` picks the schedule from the switches (`make_schedule`),
cuts the model into this rank's stages (`pipeline.stages`) and returns a
`PipelineModel`: this rank's stages plus the runtime that executes the schedule
(`pipeline.runtime`). A pipelined model runs forward and backward together,
``loss = model.step(input_ids, labels)``: the stages of a micro-batch's forward and
backward run at different times on different ranks, so there is no separate
``forward`` to call. `apply_switches` applies it after precision, before data
parallelism (which then reduces each stage's gradients over its "dp" group; `step`
runs under ``no_sync()``, call ``data_parallel.of(model).finish()`` after it).

The idea, the bubble arithmetic and the schedules are chapter 07's and
`colossal_lab.parallel.pipeline`'s docstrings.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from colossal_lab import precision
from colossal_lab.parallel import data_parallel
from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.runtime import PipelineRuntime
from colossal_lab.parallel.pipeline.simulate import simulate
from colossal_lab.parallel.pipeline.stages import build_stages, check_tied, split_layers

STYLES = ("1f1b", "interleaved", "zbv", "gpipe", "zb-h1")
"""`Switches.pp_style` values: ColossalAI's three, then ours."""

DEFAULT_CHUNKS = {"1f1b": 1, "gpipe": 1, "zb-h1": 1, "interleaved": 2, "zbv": 2}


def pp_size(mesh) -> int:
    """The size of the mesh's "pp" dim (1 without a mesh or without the dim)."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["pp"].size()


def check(switches) -> None:
    """Refuse pipeline settings that cannot work, whatever the mesh (typos early)."""
    style, chunks, m = switches.pp_style, switches.num_model_chunks, switches.num_microbatches
    if style not in STYLES:
        raise ValueError(f"pp_style={style!r}; choose one of {STYLES}")
    for name, v in (("num_model_chunks", chunks), ("num_microbatches", m)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} must be a whole number >= 1 (or None)")
    v = DEFAULT_CHUNKS[style] if chunks is None else chunks
    if style in ("1f1b", "gpipe", "zb-h1") and v != 1:
        raise ValueError(f"pp_style={style!r} runs one model chunk per rank, not "
                         f"num_model_chunks={v}: use pp_style='interleaved' for more")
    if style == "interleaved" and v < 2:
        raise ValueError("pp_style='interleaved' needs num_model_chunks >= 2 (with 1 "
                         "it is pp_style='1f1b')")
    if style == "zbv" and v != 2:
        raise ValueError(f"pp_style='zbv' holds exactly 2 model chunks per rank (the two "
                         f"arms of the V), not num_model_chunks={v}")


def check_mesh(switches, mesh, model: nn.Module | None = None) -> None:
    """Refuse, before anything changes, what cannot run on `mesh`'s "pp" dim: a
    schedule that cannot be built, a model that does not cut into its stages, and
    what the runtime does not do (loss scaling; DDP's and FSDP2's wrappers around a
    model whose forward is the pipeline's)."""
    p = pp_size(mesh)
    if p == 1:
        return
    dp = switches.overlap_communication
    if dp in ("ddp", "fsdp2"):
        raise ValueError(f"overlap_communication={dp!r} wraps the model's forward, which "
                         f"a pipelined model (pp={p}) does not have: use True (ours, "
                         "overlapped buckets) or 'naive'")
    if precision.policy(switches.precision).loss_scaling:
        raise NotImplementedError(f"precision={switches.precision!r} needs loss scaling, "
                                  "which the pipeline runtime does not do: use 'bf16'")
    schedule = make_schedule(switches, p)
    if model is not None and hasattr(model, "model"):
        split_layers(len(model.model.layers), schedule.num_stages)
        check_tied(model, schedule.placement)


def make_schedule(switches, p: int) -> sch.Schedule:
    """The schedule `switches` asks for on `p` pipeline ranks, or a clear error."""
    check(switches)
    style, m = switches.pp_style, switches.num_microbatches
    chunks = switches.num_model_chunks or DEFAULT_CHUNKS[style]
    if m is None:
        raise ValueError(f"pipeline parallelism over {p} ranks needs num_microbatches: "
                         f"e.g. {2 * p} or more (1F1B's bubble is (p−1)/(m+p−1) of the "
                         f"step: {(p - 1) / (3 * p - 1):.0%} at m = 2p, "
                         f"{(p - 1) / (5 * p - 1):.0%} at m = 4p)")
    if style == "zbv" and m < p:
        bubble = simulate(sch.zb_v(p, m)).bubble
        raise ValueError(f"pp_style='zbv' needs num_microbatches >= the pipeline size: "
                         f"m={m} < p={p} never fills the V (the simulated bubble is "
                         f"{bubble:.0%} of the step); use m >= {p}")
    return sch.make(style, p, m, chunks)


class PipelineModel(nn.Module):
    """This rank's share of a pipelined `LlamaForCausalLM`: its stages (`stages`, by
    virtual stage index; their parameters are the model's own) and the runtime that
    runs the schedule (`runtime`). Train it with ``loss = model.step(ids, labels)``,
    then the optimizer over ``model.parameters()`` (this rank's only)."""

    def __init__(self, model: nn.Module, stages: dict, runtime):
        super().__init__()
        self.cfg = model.cfg
        self.stages = nn.ModuleDict({str(s): st for s, st in sorted(stages.items())})
        self.runtime = runtime
        self.switches = getattr(model, "switches", None)

    @property
    def schedule(self) -> sch.Schedule:
        return self.runtime.schedule

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole batch through the pipeline (`runtime.
        PipelineRuntime.step`): gradients on this rank's parameters, the loss (the mean
        over micro-batches) returned on every rank of the pipeline. With data
        parallelism the gradients are not reduced yet: ``data_parallel.of(model).
        finish()`` does it."""
        with data_parallel.of(self).no_sync():  # one reduction after the whole step
            return self.runtime.step(input_ids, labels)

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined model runs forward and backward together, stage by "
                        "stage on its ranks: loss = model.step(input_ids, labels)")

    def model_names(self) -> dict[str, str]:
        """This module's parameter names -> their names in the full model."""
        return {f"stages.{s}.{n}": full for s, st in self.stages.items()
                for n, full in st.model_names().items()}


def apply(model: nn.Module, switches, mesh) -> nn.Module:
    """Switch 7 on `model` over the mesh's "pp" dim: `model` itself when that dim is 1
    (or there is no mesh), else a `PipelineModel` holding this rank's stages of it.
    Apply after the switches that change modules and dtypes (kernels, checkpointing,
    precision: the stages keep what they set), before data parallelism."""
    p = pp_size(mesh)
    check(switches)
    if p == 1:
        return model
    if isinstance(model, PipelineModel):
        raise ValueError("this model is pipelined already: build a fresh model and apply "
                         "the switches to it")
    check_mesh(switches, mesh, model)
    schedule = make_schedule(switches, p)
    group = mesh.get_group("pp")
    rank = torch.distributed.get_rank(group)
    stages = build_stages(model, schedule.placement, rank)
    runtime = PipelineRuntime(stages, schedule, group=group,
                              overlap_p2p=switches.overlap_p2p,
                              precision=switches.precision,
                              act_dtype=model.model.embed_tokens.weight.dtype)
    return PipelineModel(model, stages, runtime)
