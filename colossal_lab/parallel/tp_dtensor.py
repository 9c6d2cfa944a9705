"""The peer of our tensor parallelism: torchtitan's plan with `torch.distributed.tensor.parallel`.

`apply_dtensor` is `tensor_parallel.apply`'s "dtensor" mode: the same sharding of the
same model, laid out by torch's `ColwiseParallel` / `RowwiseParallel` /
`SequenceParallel` styles instead of our modules. torch's package is imported when the
mode is used: it takes seconds to import, and every other mode goes without it.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import init_device_mesh

from colossal_lab.ops.projections import FUSIONS, split_linear


def _norm_style():
    """torch's `SequenceParallel` for our norms, which take the residual as a keyword
    (`norm(a, residual=x)`) and then return (norm(x + a), x + a): the keyword becomes a
    sequence-sharded DTensor too, and every output comes back as a local shard."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel
    from torch.distributed.tensor.parallel.style import distribute_module

    class NormSequenceParallel(SequenceParallel):
        def _apply(self, module, device_mesh):
            def to_local(mod, outputs, mesh):
                if isinstance(outputs, tuple):
                    return tuple(o.to_local() for o in outputs)
                return outputs.to_local()

            def residual(mod, args, kwargs):
                r = kwargs.get("residual")
                if isinstance(r, torch.Tensor) and not isinstance(r, DTensor):
                    kwargs = {**kwargs, "residual": DTensor.from_local(
                        r, device_mesh, (Shard(1),), run_check=False)}
                return args, kwargs

            module = distribute_module(module, device_mesh, self._replicate_module_fn,
                                       functools.partial(self._prepare_input_fn,
                                                         self.sequence_sharding),
                                       to_local)
            module.register_forward_pre_hook(residual, with_kwargs=True)
            return module

    return NormSequenceParallel()


def apply_dtensor(model, layers, cfg, mesh, tp: int) -> None:
    """torchtitan's plan with `torch.distributed.tensor.parallel`: even row blocks of
    every column-parallel weight (so the projections are split back into q/k/v and
    gate/up first: an even block of a fused [q; k; v] would be the wrong heads),
    `SequenceParallel` norms, the embedding `RowwiseParallel` with a sequence-sharded
    output, the head `ColwiseParallel` gathering the sequence; the loss is still ours
    (torch's `loss_parallel` must wrap the backward too, which a model's forward cannot
    do)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    if mesh is None:
        device = next(model.parameters()).device.type
        tp_mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
    else:
        tp_mesh = mesh["tp"]
    for m in list(model.modules()):
        for fused, parts in FUSIONS.items():
            if fused in m._modules:
                split_linear(m, fused, list(parts), m._fused_sizes[fused])
    hq = cfg.num_attention_heads // tp
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1)),
        "model.norm": _norm_style(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
    }
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": _norm_style(),
            p + "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None,
                                                                       None)),
            p + "self_attn.q_proj": ColwiseParallel(),
            p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            p + "post_attention_layernorm": _norm_style(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        layer.self_attn.cfg = cfg.replace(hidden_size=hq * cfg.head_dim,
                                          num_attention_heads=hq,
                                          num_key_value_heads=cfg.num_key_value_heads // tp)
    parallelize_module(model, tp_mesh, plan)
