"""`apply_switches`: the one path from a plain model and a `Switches` to a model that trains.

    model = apply_switches(build_model(cfg, "cuda"), Switches(enable_flash_attention=True))

Each switch is applied by its own module's `apply(model, value)`, in place, in this
order (the shape of torchtitan's `parallelize_llama`):

    1. attention kernel        switches.attention.apply       (switch 1)
    2. rotary embedding        switches.rope.apply            (finale: our RoPE kernel)
    3. norm kernel             switches.norm.apply            (switch 2)
    4. fused projections       switches.projections.apply     (switch 3)
    5. head + loss             switches.loss.apply            (finale: fused cross-entropy)
       token embedding         switches.embedding.apply       (finale: its backward)
    6. activation checkpoints  switches.checkpointing.apply   (switch 4)
    7. precision and fp8       switches.precision.apply       (switch 6)
       then, on the mesh's "tp" dim when it is > 1: tensor parallelism, switch 5,
       parallel.tensor_parallel.apply (`enable_sequence_parallelism`,
       `sequence_parallelism_mode`; with pipeline stages too: each stage holds its
       tp rank's shards, the zero-bubble W runs their weight-gradient communication)
    8. torch.compile           switches.compile.apply         (`enable_compile`: each
                                                              layer, or the model)
       then, on the mesh's "pp" dim when it is > 1: pipeline stages, switch 7,
       switches.pipeline_parallel.apply (this rank's stages in a `PipelineModel`; not
       with `enable_compile`)
    9. data parallelism        parallel.data_parallel.apply   (switch 8), on the mesh's
                                                              "dp" dim, always last

Why this order: the kernel switches (1, 2, 3, 5) and 6 only set attributes and
commute. 4 restacks `nn.Linear` children, so it runs before 7, which swaps linears for
fp8 ones (fp8 linears left by an earlier application are turned back into plain ones
first). 6 runs before 7 so that the checkpointed forward sees the fp8 linears it
recomputes. Precision comes after the kernels because it changes what parameters are
(dtype, fp8 wrappers), which tensor parallelism then shards and data parallelism
reduces; data parallelism comes last, as in torchtitan, because it hooks or wraps (DDP)
or shards (FSDP2) whatever the others built. Compilation (8) traces the modules as every
switch before it left them (torchtitan's order too: TP, checkpointing, compile, then
FSDP); earlier compilations are removed first, with the fp8 linears, and redone there.

Applying again swaps switches on the same model with no rebuild: weights keep their
values (fused projections are new Parameters: make the optimizer afterwards; fp8
amax histories restart). `model.switches` records what was applied; the precision in
it is what every step asks (`precision.of`).
"""

from __future__ import annotations

import torch

from colossal_lab import precision
from colossal_lab.config import Switches, check_extra
from colossal_lab.ops import attention, cross_entropy, embedding, fp8, norm, rope, swiglu
from colossal_lab.parallel import data_parallel, tensor_parallel
from colossal_lab.switches import attention as attention_switch
from colossal_lab.switches import checkpointing, deferred_adamw, pipeline_parallel
from colossal_lab.switches import compile as compile_switch  # not the builtin
from colossal_lab.switches import embedding as embedding_switch
from colossal_lab.switches import fp8 as fp8_switch
from colossal_lab.switches import loss as loss_switch
from colossal_lab.switches import norm as norm_switch
from colossal_lab.switches import precision as precision_switch
from colossal_lab.switches import projections as projections_switch
from colossal_lab.switches import rope as rope_switch

ORDER = ("enable_flash_attention", "enable_fused_rope", "enable_fused_normalization",
         "enable_fused_projections", "enable_fused_cross_entropy", "enable_fused_embedding",
         "gradient_checkpoint_config", "precision", "enable_compile",
         "overlap_communication")
"""The `Switches` fields in the order `apply_switches` applies them."""

_APPLY = {"enable_flash_attention": attention_switch.apply,
          "enable_fused_rope": rope_switch.apply,
          "enable_fused_normalization": norm_switch.apply,
          "enable_fused_projections": projections_switch.apply,
          "enable_fused_cross_entropy": loss_switch.apply,
          "enable_fused_embedding": embedding_switch.apply,
          "gradient_checkpoint_config": checkpointing.apply}
"""The module swaps, applied in this loop; `precision` and `enable_compile` are applied
after it (and after tensor parallelism), `overlap_communication` last."""


def check(switches: Switches, device: torch.device | str | None = None) -> None:
    """Refuse, before anything is built or changed, what cannot work: fp8 without fp8
    tensor cores, fp8 delayed scaling with a selective recompute, a bad checkpoint
    config, an unknown backend name, a compilation that cannot trace (our Triton
    kernels under the CPU's interpreter)."""
    if not isinstance(switches, Switches):
        raise TypeError(f"expected a Switches, not {type(switches).__name__}")
    check_extra(switches.extra)
    checkpointing.resolve(switches.gradient_checkpoint_config)
    swiglu.is_fused(switches.enable_fused_projections)
    for value, names, field in ((switches.enable_flash_attention, attention.BACKENDS,
                                 "enable_flash_attention"),
                                (switches.enable_fused_normalization, norm.BACKENDS,
                                 "enable_fused_normalization"),
                                (switches.enable_fused_rope, rope.BACKENDS,
                                 "enable_fused_rope"),
                                (switches.enable_fused_cross_entropy, cross_entropy.BACKENDS,
                                 "enable_fused_cross_entropy"),
                                (switches.enable_fused_embedding, embedding.BACKENDS,
                                 "enable_fused_embedding")):
        if not (isinstance(value, bool) or value is None or value in names):
            raise ValueError(f"{field}={value!r}; choose True, False or one of {names}")
    if precision.policy(switches.precision).fp8:
        if device is not None:
            fp8.check_fp8_supported(device)
        fp8_switch.check_with_checkpointing(switches.extra, switches.gradient_checkpoint_config)
    precision.optimizer_backend(switches.enable_fused_optimizer, device)  # validates
    precision.adamw_moments(switches)  # validates
    deferred_adamw.check(switches, device)
    compile_switch.check(switches, device)
    pipeline_parallel.check(switches)
    tensor_parallel.resolve_mode(switches.enable_sequence_parallelism,
                                 switches.sequence_parallelism_mode)  # validates
    dp = switches.overlap_communication
    data_parallel.resolve(dp, 2)  # validates the value
    if dp not in (False, None) and not torch.distributed.is_initialized():
        raise ValueError(f"overlap_communication={dp!r} reduces gradients across ranks: "
                         "launch with torchrun (or `train --nproc N`) and call "
                         "colossal_lab.parallel.distributed.init() first")


def _check_tensor_parallel(model, switches: Switches, mesh) -> str | None:
    """The tensor-parallel mode to apply (None: the mesh's "tp" dim is 1 or there is no
    mesh), refusing before anything changes what cannot work."""
    tp = mesh["tp"].size() if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) \
        else 1
    mode = tensor_parallel.resolve_mode(switches.enable_sequence_parallelism,
                                        switches.sequence_parallelism_mode)
    inner = data_parallel.unwrap(model)
    if tensor_parallel.of(inner) is not None:
        raise RuntimeError("tensor parallelism was applied to this model already: build a "
                           "fresh model to apply switches again")
    if tp == 1:
        if switches.enable_sequence_parallelism:
            raise ValueError("enable_sequence_parallelism=True splits the sequence over the "
                             "tensor-parallel ranks: make the mesh with tp > 1 "
                             "(distributed.make_mesh(tp=...)), or turn it off")
        return None
    if not torch.distributed.is_initialized():
        raise ValueError(f"tensor parallelism over tp={tp} ranks: launch with torchrun "
                         "and call colossal_lab.parallel.distributed.init() first")
    if mode == "dtensor" and pipeline_parallel.pp_size(mesh) > 1:
        raise NotImplementedError("the 'dtensor' peer is not composed with pipeline "
                                  "stages here (its DTensor linears do not defer their "
                                  "weight gradients): use 'split_gather' or 'ring', or "
                                  "make the mesh with pp=1")
    if switches.enable_fused_cross_entropy:
        raise ValueError("enable_fused_cross_entropy with tensor parallelism: TP's loss is "
                         "the vocabulary-parallel cross-entropy (the logits are never "
                         "whole either); turn enable_fused_cross_entropy off")
    if switches.enable_fused_embedding:
        raise ValueError("enable_fused_embedding with tensor parallelism: TP shards the "
                         "embedding's rows through the module's own call (torch's "
                         "RowwiseParallel); turn enable_fused_embedding off")
    if mode == "dtensor" and "dp" in mesh.mesh_dim_names and mesh["dp"].size() > 1:
        raise NotImplementedError("the 'dtensor' peer is not composed with data "
                                  "parallelism here: make the mesh with dp=1")
    tensor_parallel.check_sizes(inner.cfg, tp, mode)
    return mode


def apply_switches(model: torch.nn.Module, switches: Switches,
                   mesh=None) -> torch.nn.Module:
    """Apply every switch of `switches` to `model` in `ORDER`, in place; returns the
    model to train: `model` itself, for `overlap_communication="ddp"` the
    `DistributedDataParallel` wrapping it, or with a "pp" dim > 1 the
    `pipeline_parallel.PipelineModel` of this rank's stages. A switch turned on that no
    module of the model takes (a model without our attention modules asked for a
    flash-attention backend) is an error, not a no-op.

    `mesh` (`colossal_lab.parallel.distributed.make_mesh`): pipeline stages on its "pp" dim,
    tensor parallelism on its "tp" dim, data parallelism on its "dp" dim (None: every
    rank of the world)."""
    if mesh is not None and not hasattr(mesh, "mesh_dim_names"):
        raise TypeError(f"mesh must be a DeviceMesh (colossal_lab.parallel.distributed.make_mesh), "
                        f"not {type(mesh).__name__}")
    tp_mode = _check_tensor_parallel(model, switches, mesh)
    pipeline_parallel.check_mesh(switches, mesh, data_parallel.unwrap(model))
    inner = data_parallel.unwrap(model)  # DDP's and torch.compile's wrappers
    device = next(inner.parameters()).device
    check(switches, device)
    compile_switch.check_model(inner, switches.enable_compile, pipeline_parallel.pp_size(mesh))
    fp8_switch.revert(inner)  # plain linears for the structural switches; precision redoes it
    compile_switch.revert(inner)  # eager modules for them too; compiled again below
    for field, apply_one in _APPLY.items():
        value = getattr(switches, field)
        count = apply_one(inner, value)
        if count == 0 and value not in (False, None) and field != "gradient_checkpoint_config":
            raise ValueError(f"{field}={value!r}, but no module of this "
                             f"{type(inner).__name__} takes it (our model.LlamaForCausalLM "
                             "does)")
        if field == "gradient_checkpoint_config" and value is not None \
                and not checkpointing.layer_lists(inner):
            raise ValueError(f"gradient_checkpoint_config is set, but this "
                             f"{type(inner).__name__} has no `layers` list to checkpoint")
    precision_switch.apply(inner, switches.precision, switches.extra)
    inner.switches = switches
    if tp_mode is not None:  # on the mesh's "tp" dim, before the stages and the reduction
        tensor_parallel.apply(inner, tp_mode, mesh)
    # after every swap of modules and dtypes, so the graphs trace what will run
    compile_switch.apply(inner, switches.enable_compile, switches.extra)
    if pipeline_parallel.pp_size(mesh) > 1:  # this rank's stages; data parallelism next
        model = pipeline_parallel.apply(inner, switches, mesh)
    dtype = switches.extra.get("dp_reduce_dtype")
    return data_parallel.apply(  # last: it hooks, wraps or shards what the others built
        model, switches.overlap_communication, mesh,
        bucket_elems=switches.extra.get("dp_bucket_elems", data_parallel.DEFAULT_BUCKET_ELEMS),
        reduce_dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
