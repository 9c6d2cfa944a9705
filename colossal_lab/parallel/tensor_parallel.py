"""Switch 5, `enable_sequence_parallelism` + `sequence_parallelism_mode`: tensor
parallelism, and sequence parallelism inside it.

**What the seed says, and what ColossalAI does.** The seed calls switch 5 "chunked
sequence all-reduce": with TP every attention and MLP block all-reduces, short
sequences make those calls latency-bound, so cut the sequence into chunks and overlap
their communication with computation; "enabled automatically" by
``enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather"``. In
ColossalAI (`colossalai/shardformer/layer/_operation.py`) "split_gather" is
Megatron-LM's sequence parallelism (Korthikanti et al. 2022): each all-reduce becomes
an all-gather before a column-parallel linear and a reduce-scatter after a row-parallel
one, and the norms and residual adds between them run on 1/t of the sequence. Nothing
is chunked. The chunked, overlapped variant is the mode called "ring": the all-gather
and reduce-scatter are cut into t point-to-point steps, each overlapped with the GEMM
of the shard that has already arrived. (`enable_sequence_overlap`, ColossalAI's older
flag for overlapping the backward's communication, was removed in PR #6086, 2024.)

**Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019), t ranks. The attention's
q/k/v projection is *column*-parallel (rank r holds the rows of its heads: its output
features), the output projection *row*-parallel (the matching input columns); so is the
MLP (gate/up column, down row). Between them every op is per head or per feature, so a
block needs one all-reduce of its (B, S, d) output forward (g) and one of its input's
gradient backward (f): four per layer and step.

**Sequence parallelism.** An all-reduce of n bytes is a reduce-scatter followed by an
all-gather; a ring moves (t−1)/t · n bytes per rank for each half. Split it at the block
boundary: reduce-scatter the row-parallel output along the sequence, run the residual
add, the norm and the dropout on the (B, S/t, d) shard, and all-gather right before
the next column-parallel linear. The same bytes as plain TP, and every activation
outside the blocks (norm inputs, residual stream, the linears' saved inputs) is 1/t
of what plain TP replicates on every rank (`benchmarks.sequence_parallel_gemm` counts
it per layer). The norms' weight gradients are partial (each rank saw S/t tokens):
they are all-reduced over the TP group.

**The modes** (`MODES`; `resolve_mode` maps the two `Switches` fields):

- "all_reduce": plain TP (``enable_sequence_parallelism=False``).
- "split_gather": ours, Megatron's SP, with Megatron's two backward overlaps in the
  column-parallel linear (the re-gather of its input during the dX GEMM, the
  reduce-scatter of dX during the dW GEMM); the linear keeps only its input *shard*
  for the backward.
- "ring": ours, the chunked overlap: `tp_ops.RingGatherLinear` and
  `tp_ops.RingLinearReduceScatter`.
- "dtensor": the peer from PyTorch: `torch.distributed.tensor.parallel`'s
  `ColwiseParallel` / `RowwiseParallel` / `SequenceParallel` plan (torchtitan's).
- "symm_mem": PyTorch's async TP, the fused all-gather-matmul and
  matmul-reduce-scatter of symmetric memory (CUDA + NCCL; elsewhere it falls back to
  "ring", the same algorithm in our code).

**What this module builds**, applied to a plain `model.LlamaForCausalLM` on the mesh's
"tp" dim: the projections of one input become *one* column-parallel GEMM
(`qkv_proj` = [q_r; k_r; v_r], `gate_up_proj` = [gate_r; up_r], whatever switch 3 says:
separate GEMMs would each gather their input again; ColossalAI's LLaMA policy gathers
five times per layer, q, k, v, gate and up, and keeps each gathered copy for the
backward); GQA's key/value heads are sharded when t divides them and replicated when t
is a multiple of them (each copy's gradient summed over the ranks that share it); the
embedding and the output head are split by vocabulary rows, and the loss is the
vocabulary-parallel cross-entropy (`tp_ops.vocab_parallel_cross_entropy`: no rank
ever holds a full row of logits). A rank's state dict holds its shards under Hugging
Face's names; `full_tensor` and `full_named` gather them back.

References: M. Shoeybi et al., *Megatron-LM*, arXiv:1909.08053, 2019; V. Korthikanti
et al., *Reducing Activation Recomputation in Large Transformer Models*,
arXiv:2205.05198, 2022; S. Wang et al., *Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models*, ASPLOS 2023; torchtitan's
async TP (``torch.distributed._symmetric_memory``); ColossalAI
`Linear1D_Col` / `Linear1D_Row` and `_operation.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.fallback import fallback
from colossal_lab.ops import autocast_state
from colossal_lab.parallel import tp_ops

MODES = ("all_reduce", "split_gather", "ring", "dtensor", "symm_mem")
"""What `apply` builds; every mode but "all_reduce" is sequence parallel."""

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


# ----------------------------------------------------------------------- the layout


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_sizes(cfg, tp: int, mode: str = "split_gather") -> None:
    """Refuse, before anything changes, a `tp` the model's shapes cannot split."""
    def need(what: str, n: int) -> None:
        if n % tp:
            raise ValueError(f"tp_size={tp} does not divide {what}={n}; choose tp from "
                             f"{_divisors(n)}")

    need("num_attention_heads", cfg.num_attention_heads)
    need("vocab_size", cfg.vocab_size)
    need("intermediate_size", cfg.intermediate_size)
    hkv = cfg.num_key_value_heads
    if tp <= hkv or mode == "dtensor":
        if hkv % tp:
            extra = ("" if mode == "dtensor" else
                     f", or a multiple of it that divides num_attention_heads="
                     f"{cfg.num_attention_heads} (then each key/value head is replicated)")
            raise ValueError(f"tp_size={tp} does not divide num_key_value_heads={hkv}; "
                             f"choose tp from {_divisors(hkv)}{extra}")
    elif tp % hkv:
        raise ValueError(f"tp_size={tp} is more than num_key_value_heads={hkv} but not a "
                         f"multiple of it: each rank needs one whole key/value head; "
                         f"choose tp from {_divisors(hkv)} or a multiple of {hkv}")


def check_sequence(seq_len: int, tp: int) -> None:
    """Sequence parallelism splits the sequence into `tp` equal shards."""
    if seq_len % tp:
        lo = seq_len - seq_len % tp
        raise ValueError(f"sequence length {seq_len} is not divisible by tp_size={tp}: "
                         f"sequence parallelism gives each rank S/tp tokens; pad or cut "
                         f"the batch to a multiple of {tp} (e.g. {lo} or {lo + tp}), or "
                         "use plain tensor parallelism (enable_sequence_parallelism=False)")


@dataclass(frozen=True)
class Shard:
    """Which part of a full tensor a rank's local tensor holds: along `dim`, rank r
    holds the ranges `pieces[r]` of the full `full` elements, concatenated in order.
    Ranks may hold the same range (replicated key/value heads)."""

    dim: int
    full: int
    pieces: tuple[tuple[tuple[int, int], ...], ...]

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's local tensor from the full one (a copy)."""
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.pieces[rank]],
                         dim=self.dim).clone()


def _even(n: int, tp: int, scale: int = 1, offset: int = 0):
    """Rank r's [r·n/tp, (r+1)·n/tp) scaled by `scale`, shifted by `offset`."""
    k = n // tp
    return [(offset + r * k * scale, offset + (r + 1) * k * scale) for r in range(tp)]


def kv_heads_of(cfg, tp: int) -> list[tuple[int, int]]:
    """The key/value heads [a, b) each rank holds: its 1/tp when tp divides Hkv, else
    the one head its query heads attend to (replicated tp/Hkv times)."""
    hkv = cfg.num_key_value_heads
    if tp <= hkv:
        return [(a, b) for a, b in _even(hkv, tp)]
    rep = tp // hkv
    return [(r // rep, r // rep + 1) for r in range(tp)]


def qkv_shard(cfg, tp: int) -> Shard:
    """Rows of the fused [q; k; v] weight ((Hq + 2·Hkv)·D, d) per rank: its query
    heads, then its key and value heads."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = _even(hq, tp, d)
    kv = kv_heads_of(cfg, tp)
    pieces = tuple((q[r], ((hq + a) * d, (hq + b) * d),
                    ((hq + hkv + a) * d, (hq + hkv + b) * d)) for r, (a, b) in enumerate(kv))
    return Shard(0, (hq + 2 * hkv) * d, pieces)


def gate_up_shard(cfg, tp: int) -> Shard:
    """Rows of the fused [gate; up] weight (2·i, d) per rank."""
    i = cfg.intermediate_size
    return Shard(0, 2 * i, tuple((g, u) for g, u in zip(_even(i, tp), _even(i, tp,
                                                                            offset=i))))


def even_shard(n: int, tp: int, dim: int) -> Shard:
    """Rank r holds the r-th of tp equal ranges along `dim`."""
    return Shard(dim, n, tuple((p,) for p in _even(n, tp)))


# ----------------------------------------------------------------------- the modules


def _compute_dtype(x: torch.Tensor, w: torch.Tensor):
    """Operands in autocast's dtype (cast here, differentiably), so that the autograd
    functions below run their own GEMMs with autocast off."""
    dtype = autocast_state.current_dtype(x.device.type)
    if dtype is None:
        return x, w
    return x.to(dtype), w.to(dtype)


class _ParallelLinear(nn.Module):
    """A linear layer holding one rank's block of a bias-free weight.

    ``wgrad_store``: set by a zero-bubble pipeline (`pipeline.runtime.
    defer_weight_grads`) to defer this linear's weight gradient, communication included,
    to the schedule's W (`tp_ops.deferral`); None: computed in the backward."""

    wgrad_store = None

    def _operands(self, x: torch.Tensor):
        """(x, w, defer): the operands in autocast's dtype, the weight detached when its
        gradient is deferred (W adds it), and the deferral for the autograd function."""
        defer = tp_ops.deferral(self, x)
        x, w = _compute_dtype(x, self.weight.detach() if defer else self.weight)
        return x, w, defer

    def __init__(self, weight: torch.Tensor, mode: str, group, symm_name=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.out_features, self.in_features = weight.shape
        self.mode, self.group, self.symm_name = mode, group, symm_name

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local), mode={self.mode!r}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x Wᵀ with W this rank's rows (output features). Input: the replicated
    (B, S, k) ("all_reduce") or this rank's (B, S/t, k) shard (the sequence-parallel
    modes); output (B, S, n/t)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w, defer = self._operands(x)
        with autocast_state.off(x.device.type):
            if self.mode == "all_reduce":
                return tp_ops.LinearAllReduceBackward.apply(x, w, self.group, defer)
            if self.mode == "split_gather":
                return tp_ops.GatherLinear.apply(x, w, self.group, defer)
            if self.mode == "ring":
                return tp_ops.RingGatherLinear.apply(x, w, self.group, defer)
            return tp_ops.SymmMemGatherLinear.apply(x, w, self.group, self.symm_name,
                                                    defer)


class RowParallelLinear(_ParallelLinear):
    """y = Σ_ranks h_r W_rᵀ with W_r this rank's columns (input features). Input
    (B, S, k/t); output the replicated (B, S, n) ("all_reduce", an all-reduce) or this
    rank's (B, S/t, n) shard (a reduce-scatter)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h, w, defer = self._operands(h)
        with autocast_state.off(h.device.type):
            if self.mode == "all_reduce":
                y = F.linear(h, w) if defer is None else \
                    tp_ops.LinearDeferredGrad.apply(h, w, defer)
                return tp_ops.reduce_from_tp(y, self.group)
            if self.mode == "split_gather":
                return tp_ops.LinearReduceScatter.apply(h, w, self.group, defer)
            if self.mode == "ring":
                return tp_ops.RingLinearReduceScatter.apply(h, w, self.group, defer)
            return tp_ops.SymmMemLinearReduceScatter.apply(h, w, self.group,
                                                           self.symm_name, defer)


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/t) of the embedding. Each rank looks up the
    tokens it owns (zeros for the others); the partial sums are all-reduced (plain TP)
    or reduce-scattered along the sequence (SP: the layers start on shards)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, mode: str, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.vocab_start, self.mode, self.group = vocab_start, mode, group
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t, _ = tp_ops.size_and_rank(self.group)
        if self.mode != "all_reduce":
            check_sequence(ids.shape[1], t)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)  # (B, S, d)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        if self.mode == "all_reduce":
            return tp_ops.reduce_from_tp(out, self.group)
        return tp_ops.scatter_seq(out, self.group)  # (B, S/t, d)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local, from {self.vocab_start}), "
                f"{self.embedding_dim}, mode={self.mode!r}")


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
    from colossal_lab.ops.projections import _replace_children

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
    t, _ = tp_ops.size_and_rank(group)
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
        return tp_ops.gather_last_dim(logits, tp.group)
    return tp_ops.vocab_parallel_cross_entropy(logits, labels, tp.vocab_start, tp.group)


def _layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise TypeError(f"tensor parallelism needs our model.LlamaForCausalLM (a `model."
                        f"layers` list and an `lm_head`), not a {type(model).__name__}")
    return layers


def apply(model: nn.Module, mode: str, mesh=None) -> nn.Module:
    """Switch 5 on `model`, in place, over the mesh's "tp" dim (`mesh=None`: every rank
    of the world is one TP group): shard every decoder layer, the embedding and the
    output head, and make the forward run the `mode`'s communication (`MODES`). Apply
    it after the kernel switches and the precision, before data parallelism, and make
    the optimizer afterwards (new Parameters). A TP model cannot be sharded again:
    build a fresh one. Returns the model."""
    from colossal_lab.ops.norm import LayerNorm, RMSNorm

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
    tp, rank = tp_ops.size_and_rank(group)
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
        _apply_dtensor(model, layers, cfg, mesh, tp)
    else:
        symm_name = tp_ops.enable_symm_mem(group) if mode == "symm_mem" else None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            col = _shard_block(attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", "o_proj",
                               qkv_shard(cfg, tp),
                               Shard(1, cfg.num_attention_heads * cfg.head_dim, tuple(
                                   (p,) for p in _even(cfg.num_attention_heads, tp,
                                                       cfg.head_dim))),
                               rank, mode, group, symm_name)
            hq, (a, b) = cfg.num_attention_heads // tp, kv_heads_of(cfg, tp)[rank]
            attn.cfg = cfg.replace(hidden_size=hq * cfg.head_dim, num_attention_heads=hq,
                                   num_key_value_heads=b - a)  # what this rank computes
            attn._fused_sizes["qkv_proj"] = attn.qkv_sizes()
            if tp > cfg.num_key_value_heads:
                state.hooks.append(col.weight.register_hook(
                    _kv_replica_hook(cfg, tp, rank, group)))
            i = cfg.intermediate_size
            _shard_block(mlp, ("gate_proj", "up_proj"), "gate_up_proj", "down_proj",
                         gate_up_shard(cfg, tp), even_shard(i, tp, 1), rank, mode, group,
                         symm_name)
            mlp._fused_sizes["gate_up_proj"] = [i // tp] * 2
        vocab = even_shard(cfg.vocab_size, tp, 0)
        emb = model.model.embed_tokens
        tied = model.lm_head.weight is emb.weight
        new_emb = VocabParallelEmbedding(vocab.take(emb.weight.detach(), rank)
                                         .requires_grad_(emb.weight.requires_grad),
                                         state.vocab_start, mode, group)
        _mark(new_emb.weight, vocab)
        model.model.embed_tokens = new_emb
        head = model.lm_head
        new_head = ColumnParallelLinear(vocab.take(head.weight.detach(), rank)
                                        .requires_grad_(head.weight.requires_grad),
                                        mode, group, symm_name)
        if tied:
            new_head.weight = new_emb.weight
        _mark(new_head.weight, vocab)
        model.lm_head = new_head
        if mode != "all_reduce":  # norms saw S/t tokens: their weight gradients sum
            for m in model.modules():
                if isinstance(m, (RMSNorm, LayerNorm)):
                    for p in m.parameters():
                        if p.requires_grad:
                            state.hooks.append(p.register_hook(_grad_all_reduce(group)))
    model.tp = state
    model.forward = functools.partial(_tp_forward, model)
    return model


# ------------------------------------------------------------- the peer: torch's plan


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


def _apply_dtensor(model, layers, cfg, mesh, tp: int) -> None:
    """torchtitan's plan with `torch.distributed.tensor.parallel`: even row blocks of
    every column-parallel weight (so the projections are split back into q/k/v and
    gate/up first: an even block of a fused [q; k; v] would be the wrong heads),
    `SequenceParallel` norms, the embedding `RowwiseParallel` with a sequence-sharded
    output, the head `ColwiseParallel` gathering the sequence; the loss is still ours
    (torch's `loss_parallel` must wrap the backward too, which a model's forward cannot
    do)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from colossal_lab.ops.projections import FUSIONS, split_linear

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
    t, _ = tp_ops.size_and_rank(group)
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


# ---------------------------------------------------------------- correctness check


