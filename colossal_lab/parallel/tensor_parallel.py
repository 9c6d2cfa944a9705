"""Switch 5: tensor parallelism, and sequence parallelism inside it, applied to a plain model.

**Tensor parallelism** (Megatron-LM), t ranks. The attention's q/k/v projection is
*column*-parallel (rank r holds the rows of its heads), the output projection
*row*-parallel (the matching input columns); so is the MLP (gate/up column, down row).
Every op between them is per head or per feature, so a block needs one all-reduce of its
(B, S, d) output forward (g) and one of its input's gradient backward (f).

**Sequence parallelism** (Korthikanti et al.; ColossalAI's "split_gather"). An
all-reduce is a reduce-scatter followed by an all-gather, each moving (t−1)/t · n bytes
per rank. Split it at the block boundary: reduce-scatter the row-parallel output along
the sequence, run the residual add and the norm on the (B, S/t, d) shard, all-gather
right before the next column-parallel linear. The same bytes, and every activation
outside the blocks is 1/t of plain TP's; the norms' weight gradients (each rank saw S/t
tokens) are all-reduced over the group. The tutorial's "chunked sequence all-reduce" is the
"ring" mode: the all-gather and the reduce-scatter cut into t point-to-point steps, each
overlapped with the GEMM of the shard that has arrived.

`apply` builds one of `MODES` (`resolve_mode` maps the two `Switches` fields). The
projections of one input become *one* column-parallel GEMM (`qkv_proj` = [q_r; k_r; v_r],
`gate_up_proj` = [gate_r; up_r]): separate GEMMs would each gather their input again, as
ColossalAI's LLaMA policy does five times per layer. Key/value heads are sharded when t
divides them and replicated when t is a multiple of them (`tp_shards`); the embedding and
the head are split by vocabulary rows, and the loss is the vocabulary-parallel
cross-entropy: no rank holds a full row of logits. `full_tensor` gathers a shard back.

References: M. Shoeybi et al., *Megatron-LM*, arXiv:1909.08053, 2019; V. Korthikanti
et al., *Reducing Activation Recomputation in Large Transformer Models*,
arXiv:2205.05198, 2022; S. Wang et al., *Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models*, ASPLOS 2023; torchtitan's
async TP; ColossalAI `Linear1D_Col` / `Linear1D_Row` and `shardformer/layer/_operation.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from colossal_lab.fallback import fallback
from colossal_lab.ops.norm import LayerNorm, RMSNorm
from colossal_lab.ops.projections import _replace_children
from colossal_lab.parallel import tp_ops
from colossal_lab.parallel.tp_collectives import gather_last_dim, size_and_rank
from colossal_lab.parallel.tp_dtensor import apply_dtensor
from colossal_lab.parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from colossal_lab.parallel.tp_shards import (
    Shard,
    check_sequence,
    check_sizes,
    even_shard,
    gate_up_shard,
    kv_heads_of,
    qkv_shard,
)

MODES = ("all_reduce", "split_gather", "ring", "dtensor", "symm_mem")
"""What `apply` builds: plain TP; Megatron's sequence parallelism with its two backward
overlaps; the chunked ring (`tp_ops.RingGatherLinear`); torch's DTensor plan, the peer
(`tp_dtensor`); PyTorch's async TP on symmetric memory (CUDA + NCCL, else "ring")."""

CONTEXT_PARALLEL = ("all_to_all", "ring_attn")
"""ColossalAI's other two `sequence_parallelism_mode`s: they split the *attention* over
the sequence (DeepSpeed-Ulysses, ring attention), context parallelism, not built here."""


def resolve_mode(enable_sequence_parallelism: bool, sequence_parallelism_mode=None) -> str:
    """The mode the two `Switches` fields ask for under tensor parallelism: plain TP
    ("all_reduce") without sequence parallelism; with it, `sequence_parallelism_mode`
    (default "split_gather", ColossalAI's default too)."""
    mode = sequence_parallelism_mode
    if not enable_sequence_parallelism:
        if mode not in (None, "all_reduce"):
            raise ValueError(f"sequence_parallelism_mode={mode!r} needs "
                             "enable_sequence_parallelism=True (False is plain tensor "
                             "parallelism, 'all_reduce')")
        return "all_reduce"
    mode = mode or "split_gather"
    if mode == "all_reduce":
        raise ValueError("sequence_parallelism_mode='all_reduce' is plain tensor "
                         "parallelism: set enable_sequence_parallelism=False, or pick a "
                         f"sequence-parallel mode from {MODES[1:]}")
    if mode in CONTEXT_PARALLEL:
        raise NotImplementedError(
            f"sequence_parallelism_mode={mode!r} is context parallelism (the attention "
            f"split over the sequence), not built here; choose one of {MODES[1:]}")
    if mode not in MODES:
        raise ValueError(f"sequence_parallelism_mode={mode!r}; choose one of {MODES[1:]} "
                         "(or enable_sequence_parallelism=False for plain TP)")
    return mode


# ------------------------------------------------------------------------ the state


@dataclass
class TensorParallel:
    """What `apply` did to a model (``model.tp``)."""

    mode: str
    size: int
    rank: int
    group: object
    mesh: object = None
    vocab_start: int = 0
    hooks: list = field(default_factory=list)

    @property
    def sequence_parallel(self) -> bool:
        return self.mode != "all_reduce"


def of(model: nn.Module) -> TensorParallel | None:
    """The `TensorParallel` state of `model`, None for a model without TP."""
    return getattr(model, "tp", None)


def _grad_all_reduce(group):
    """A gradient hook: the sum over the TP group of what every rank computed (a norm
    weight that saw only this rank's tokens)."""

    def hook(g):
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g

    return hook


def _kv_replica_hook(cfg, tp: int, rank: int, group):
    """A gradient hook on the fused local qkv weight when key/value heads are
    replicated: each copy of head h got the gradient of this rank's queries only; the
    head's gradient is the sum over the ranks that hold it (a zero-padded all-reduce
    of the full k/v blocks over the group)."""
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    nq = cfg.num_attention_heads // tp * d
    h = kv_heads_of(cfg, tp)[rank][0]

    def hook(g):
        buf = g.new_zeros((2, hkv, d, g.shape[1]))  # [k; v] of every head
        buf[0, h] = g[nq:nq + d]
        buf[1, h] = g[nq + d:nq + 2 * d]
        dist.all_reduce(buf, group=group)
        g = g.clone()
        g[nq:nq + d], g[nq + d:nq + 2 * d] = buf[0, h], buf[1, h]
        return g

    return hook


def _mark(p: nn.Parameter, shard: Shard) -> nn.Parameter:
    p._tp_shard = shard  # read by `full_tensor`
    return p


def _full_weight(module: nn.Module, parts: tuple[str, ...], fused: str) -> torch.Tensor:
    """The weight of `fused` (stacked [parts] when the module holds them separately)."""
    if fused in module._modules:
        lin = module._modules[fused]
        ws = [lin.weight]
    else:
        ws = [module._modules[p].weight for p in parts]
    for p in parts + (fused,):
        lin = module._modules.get(p)
        if lin is not None and (type(lin) is not nn.Linear or lin.bias is not None):
            raise TypeError(f"{p} is a {type(lin).__name__}"
                            f"{' with a bias' if type(lin) is nn.Linear else ''}: tensor "
                            "parallelism shards plain bias-free nn.Linear projections "
                            "(apply it before fp8 linears; our LLaMA has no biases)")
    return torch.cat([w.detach() for w in ws])


def _shard_block(module: nn.Module, parts: tuple[str, ...], fused: str, out_name: str,
                 col_shard: Shard, row_shard: Shard, rank: int, mode: str, group,
                 symm_name) -> ColumnParallelLinear:
    """Swap `module`'s projections of one input (`parts` or `fused`) for one
    column-parallel `fused` linear, and its `out_name` linear for a row-parallel one."""
    full = _full_weight(module, parts, fused)
    rg = next(iter(module._modules[fused if fused in module._modules else parts[0]]
                   .parameters())).requires_grad
    col = ColumnParallelLinear(col_shard.take(full, rank).requires_grad_(rg), mode, group,
                               symm_name)
    _mark(col.weight, col_shard)
    old = [fused] if fused in module._modules else list(parts)
    _replace_children(module, old, {fused: col})
    out = module._modules[out_name]
    if type(out) is not nn.Linear or out.bias is not None:
        raise TypeError(f"{out_name} is a {type(out).__name__}: tensor parallelism shards "
                        "plain bias-free nn.Linear projections")
    row = RowParallelLinear(row_shard.take(out.weight.detach(), rank)
                            .requires_grad_(out.weight.requires_grad), mode, group,
                            symm_name)
    _mark(row.weight, row_shard)
    module._modules[out_name] = row
    return col


def _broadcast(model: nn.Module, group) -> None:
    """Every TP rank shards the same full model: rank 0's."""
    t, _ = size_and_rank(group)
    if t == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for x in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(x.data, src=src, group=group)


def _tp_forward(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
    """`LlamaForCausalLM.forward` under TP: the decoder (on sequence shards under SP),
    the vocabulary-parallel head on the whole sequence, then the vocabulary-parallel
    loss; without labels the full logits (gathered: for inference and checks)."""
    tp = model.tp
    if tp.sequence_parallel:
        check_sequence(input_ids.shape[1], tp.size)
    hidden = model.model(input_ids)  # (B, S/t, d) under SP, (B, S, d) otherwise
    return head_and_loss(tp, model.lm_head, hidden, labels)


def head_and_loss(tp: TensorParallel, lm_head: nn.Module, hidden: torch.Tensor,
                  labels: torch.Tensor | None = None) -> torch.Tensor:
    """The vocabulary-parallel head on the final norm's output (gathered over the
    sequence under SP), then the vocabulary-parallel loss against the whole sequence's
    `labels`; without labels the full logits. The model's and a pipeline's last stage's
    (`pipeline.stages.Stage`) tail."""
    logits = lm_head(hidden)  # (B, S, V/t): this rank's vocabulary columns
    if labels is None:
        return gather_last_dim(logits, tp.group)
    return tp_ops.vocab_parallel_cross_entropy(logits, labels, tp.vocab_start, tp.group)


def _layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise TypeError(f"tensor parallelism needs our model.LlamaForCausalLM (a `model."
                        f"layers` list and an `lm_head`), not a {type(model).__name__}")
    return layers


def _shard_layer(layer: nn.Module, cfg, state: TensorParallel, symm_name) -> None:
    """One decoder layer: attention and MLP each become a column-parallel fused
    projection and a row-parallel output projection."""
    tp, rank, mode, group = state.size, state.rank, state.mode, state.group
    attn, mlp = layer.self_attn, layer.mlp
    col = _shard_block(attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", "o_proj",
                       qkv_shard(cfg, tp),
                       even_shard(cfg.num_attention_heads * cfg.head_dim, tp, 1),
                       rank, mode, group, symm_name)
    hq, (a, b) = cfg.num_attention_heads // tp, kv_heads_of(cfg, tp)[rank]
    attn.cfg = cfg.replace(hidden_size=hq * cfg.head_dim, num_attention_heads=hq,
                           num_key_value_heads=b - a)  # what this rank computes
    attn._fused_sizes["qkv_proj"] = attn.qkv_sizes()
    if tp > cfg.num_key_value_heads:
        state.hooks.append(col.weight.register_hook(_kv_replica_hook(cfg, tp, rank, group)))
    i = cfg.intermediate_size
    _shard_block(mlp, ("gate_proj", "up_proj"), "gate_up_proj", "down_proj",
                 gate_up_shard(cfg, tp), even_shard(i, tp, 1), rank, mode, group, symm_name)
    mlp._fused_sizes["gate_up_proj"] = [i // tp] * 2


def _shard_vocab(model: nn.Module, cfg, state: TensorParallel, symm_name) -> None:
    """The embedding and the head split by vocabulary rows (one weight if tied)."""
    rank = state.rank
    vocab = even_shard(cfg.vocab_size, state.size, 0)
    emb = model.model.embed_tokens
    tied = model.lm_head.weight is emb.weight
    new_emb = VocabParallelEmbedding(vocab.take(emb.weight.detach(), rank)
                                     .requires_grad_(emb.weight.requires_grad),
                                     state.vocab_start, state.mode, state.group)
    _mark(new_emb.weight, vocab)
    model.model.embed_tokens = new_emb
    head = model.lm_head
    new_head = ColumnParallelLinear(vocab.take(head.weight.detach(), rank)
                                    .requires_grad_(head.weight.requires_grad),
                                    state.mode, state.group, symm_name)
    if tied:
        new_head.weight = new_emb.weight
    _mark(new_head.weight, vocab)
    model.lm_head = new_head


def apply(model: nn.Module, mode: str, mesh=None) -> nn.Module:
    """Switch 5 on `model`, in place, over the mesh's "tp" dim (`mesh=None`: every rank
    of the world is one TP group): shard every decoder layer, the embedding and the
    output head, and make the forward run the `mode`'s communication (`MODES`). Apply
    it after the kernel switches and the precision, before data parallelism, and make
    the optimizer afterwards (new Parameters). A TP model cannot be sharded again:
    build a fresh one. Returns the model."""
    if mode not in MODES:
        raise ValueError(f"tensor-parallel mode {mode!r}; choose one of {MODES}")
    if of(model) is not None:
        raise RuntimeError("tensor parallelism was already applied to this model; build a "
                           "fresh model to apply it again")
    layers = _layers(model)
    cfg = model.cfg
    if mesh is not None and "tp" not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"the mesh has dims {mesh.mesh_dim_names}; tensor parallelism "
                         "needs a 'tp' dim (distributed.make_mesh makes one)")
    group = mesh.get_group("tp") if mesh is not None else None
    tp, rank = size_and_rank(group)
    check_sizes(cfg, tp, mode)
    if getattr(model, "loss_backend", False):
        raise ValueError("enable_fused_cross_entropy and tensor parallelism: under TP the "
                         "loss is the vocabulary-parallel cross-entropy (the logits are "
                         "never whole either); turn enable_fused_cross_entropy off")
    if mode == "symm_mem" and not tp_ops.symm_mem_available(group):
        fallback("sequence_parallelism_mode 'symm_mem' needs CUDA, NCCL and "
                 "torch.distributed._symmetric_memory", "ring")
        mode = "ring"
    if mode == "dtensor" and cfg.tie_word_embeddings:
        raise ValueError("the 'dtensor' plan shards the embedding and the head separately; "
                         "a tied model needs one of our modes ('split_gather', 'ring')")
    _broadcast(model, group)
    state = TensorParallel(mode, tp, rank, group, mesh,
                           vocab_start=rank * (cfg.vocab_size // tp))
    if mode == "dtensor":
        apply_dtensor(model, layers, cfg, mesh, tp)
    else:
        symm_name = tp_ops.enable_symm_mem(group) if mode == "symm_mem" else None
        for layer in layers:
            _shard_layer(layer, cfg, state, symm_name)
        _shard_vocab(model, cfg, state, symm_name)
        if mode != "all_reduce":  # norms saw S/t tokens: their weight gradients sum
            for m in model.modules():
                if isinstance(m, (RMSNorm, LayerNorm)):
                    for p in m.parameters():
                        if p.requires_grad:
                            state.hooks.append(p.register_hook(_grad_all_reduce(group)))
    model.tp = state
    model.forward = functools.partial(_tp_forward, model)
    return model


# ------------------------------------------------------------------- full tensors


def full_tensor(p: torch.Tensor, local: torch.Tensor | None = None, group=None
                ) -> torch.Tensor:
    """The whole tensor of which `local` (default: `p` itself; pass ``p.grad`` for its
    gradient) is this rank's part, on every rank: gathered by `p`'s `Shard` (a
    collective: every rank of the group must call it), ``full_tensor()`` of a DTensor,
    or `local` itself for a replicated parameter."""
    local = p if local is None else local
    if hasattr(local, "full_tensor"):
        return local.full_tensor()
    shard = getattr(p, "_tp_shard", None)
    if shard is None:
        return local.detach()
    t, _ = size_and_rank(group)
    parts = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    shape = list(local.shape)
    shape[shard.dim] = shard.full
    out = local.new_empty(shape)
    for r, part in enumerate(parts):
        off = 0
        for a, b in shard.pieces[r]:
            out.narrow(shard.dim, a, b - a).copy_(part.narrow(shard.dim, off, b - a))
            off += b - a
    return out

