"""Cut our LLaMA into pipeline stages: contiguous decoder layers, embedding first, head last.

A schedule runs S = p · v virtual stages (v model chunks on each of p ranks), and its
``placement`` says which rank holds which. The model is cut the same way whatever the
placement: stage s holds decoder layers s · L/S .. (s + 1) · L/S − 1, stage 0 also the
embedding, stage S − 1 the final norm, the head and the loss. Linear placement (GPipe,
1F1B, ZB-H1) puts stage s on rank s, interleaved stage c · p + r on rank r, and V (ZB-V)
stages r and 2p − 1 − r on rank r, so rank 0 holds the embedding *and* the head.

A `Stage` holds the model's own modules, nothing copied: gradients land on the model's
parameters, and the switches applied before come along. Stage 0 takes token ids (b, S),
the others the hidden state (b, S, d), which is all that travels (each stage computes its
own rotary tables). Under sequence parallelism (switch 5, applied before the cut) the
hidden state is this rank's (b, S/t, d) shard, and the last stage ends in the
vocabulary-parallel head and loss (`tensor_parallel.head_and_loss`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.ops import cross_entropy as loss_switch
from colossal_lab.parallel.tensor_parallel import head_and_loss


class StageError(ValueError):
    """A model that cannot be cut into the stages asked for; the message says what to
    change."""


def split_layers(num_layers: int, num_stages: int,
                 layers_per_stage: list[int] | None = None) -> list[range]:
    """Which decoder layers each of `num_stages` virtual stages holds: contiguous
    ranges in model order, `num_layers / num_stages` each, or `layers_per_stage` (one
    count per stage, summing to `num_layers`; a count may be 0, e.g. to give the first
    stage, which also runs the embedding, fewer layers)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise StageError(f"num_stages={num_stages!r} must be a whole number >= 1")
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or any(c < 0 for c in counts) \
                or sum(counts) != num_layers:
            raise StageError(f"layers_per_stage={counts} must give each of the "
                             f"{num_stages} stages a count >= 0, summing to the model's "
                             f"{num_layers} layers")
    else:
        if num_layers % num_stages:
            ok = [s for s in range(1, num_layers + 1) if num_layers % s == 0]
            raise StageError(
                f"{num_layers} decoder layers do not divide into {num_stages} equal "
                f"stages (pipeline ranks × model chunks per rank): choose a number of "
                f"stages in {ok}, or give layers_per_stage explicitly")
        counts = [num_layers // num_stages] * num_stages
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


class Stage(nn.Module):
    """Virtual stage `index` of `num_stages` of a `model.LlamaForCausalLM`, holding the
    model's own modules (nothing copied): decoder layers `layer_ids`, plus the embedding
    on stage 0 and the final norm and head on the last stage.

    ``forward(x, labels=None)``: x is token ids (b, S) on stage 0, the hidden state
    (b, S, d) elsewhere; returns the hidden state (b, S, d), or on the last stage the
    mean cross-entropy against `labels` (b, S) (the logits (b, S, V) without labels)."""

    def __init__(self, model: nn.Module, index: int, num_stages: int, layer_ids: range):
        super().__init__()
        if not 0 <= index < num_stages:
            raise StageError(f"stage index {index} is outside 0..{num_stages - 1}")
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.cfg = model.cfg
        self.layer_ids = layer_ids
        body = model.model
        self.embed_tokens = body.embed_tokens if self.is_first else None
        self.layers = nn.ModuleDict({str(i): body.layers[i] for i in layer_ids})
        self.norm = body.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.loss_backend = getattr(model, "loss_backend", False) if self.is_last else False
        self.tp = getattr(model, "tp", None)  # switch 5's state, applied before the cut
        self.seq_shards = self.tp.size if self.tp is not None \
            and self.tp.sequence_parallel else 1
        """Under sequence parallelism a stage holds 1/t of the sequence between layers:
        it receives and sends (b, S/t, d)."""
        # buffers only (inv_freq, not saved): shared, not a parameter of any stage
        self.rotary_emb = body.rotary_emb
        names = {id(p): n for n, p in model.named_parameters()}  # a tied weight: 1st name
        self._names = {n: names[id(p)] for n, p in self.named_parameters()}

    def extra_repr(self) -> str:
        parts = [f"stage {self.index}/{self.num_stages}"]
        if len(self.layer_ids):
            parts.append(f"layers {self.layer_ids.start}..{self.layer_ids.stop - 1}")
        parts += ["embedding"] * self.is_first + ["norm, head, loss"] * self.is_last
        return ", ".join(parts)

    def model_names(self) -> dict[str, str]:
        """This stage's parameter names -> their names in the full model."""
        return dict(self._names)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        seq = x.shape[1] * (1 if self.is_first else self.seq_shards)
        if self.is_first:
            x = self.embed_tokens(x)  # (b, S) ids -> (b, S, d) (b, S/t, d) under SP
        cos, sin = self.rotary_emb(seq, x.device)  # the whole sequence's positions
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if not self.is_last:
            return x  # (b, S, d) or (b, S/t, d): the activation sent to the next stage
        hidden = self.norm(x)
        if self.tp is not None:
            return head_and_loss(self.tp, self.lm_head, hidden, labels)
        if labels is not None and self.loss_backend:
            return loss_switch.fused_linear_cross_entropy(
                hidden.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                backend=self.loss_backend)
        logits = self.lm_head(hidden)  # (b, S, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().long())


def check_tied(model: nn.Module, placement: tuple[int, ...]) -> None:
    """A head tied to the embedding must sit on the embedding's rank: the two uses of
    one weight would otherwise need their gradients summed across ranks, which this
    runtime does not do. V placement has both on rank 0; linear and interleaved
    placements put the last stage on another rank."""
    if getattr(model.cfg, "tie_word_embeddings", False) and placement[0] != placement[-1]:
        raise StageError(
            "tie_word_embeddings: the head shares the embedding's weight, but the first "
            f"stage runs on rank {placement[0]} and the last on rank {placement[-1]}; "
            "use pp_style='zbv' (both on rank 0) or a model with untied embeddings")


def build_stages(model: nn.Module, placement: tuple[int, ...] | list[int], rank: int,
                 layers_per_stage: list[int] | None = None) -> dict[int, Stage]:
    """This rank's stages of `model` under `placement` (the rank of each virtual stage,
    e.g. `Schedule.placement`), by stage index. The other stages' modules are not
    referenced: drop `model` and they are freed with it."""
    placement = tuple(placement)
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise StageError(f"build_stages cuts our model.LlamaForCausalLM, not a "
                         f"{type(model).__name__}")
    if rank not in placement:
        raise StageError(f"rank {rank} holds no stage of placement {list(placement)}")
    check_tied(model, placement)
    ranges = split_layers(len(model.model.layers), len(placement), layers_per_stage)
    return {s: Stage(model, s, len(placement), ranges[s])
            for s, r in enumerate(placement) if r == rank}


def activation_shape(cfg, micro_batch: int, seq_len: int) -> tuple[int, int, int]:
    """What one stage sends the next for one micro-batch: the hidden state (b, S, d)
    (and its gradient, the same shape, comes back)."""
    return (micro_batch, seq_len, cfg.hidden_size)
