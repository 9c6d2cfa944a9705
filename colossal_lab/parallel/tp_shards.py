"""Which block of each weight a tensor-parallel rank holds, and the sizes that can be split.

Rank r of t holds the r-th of t even ranges of every sharded dim, with two twists: the
fused projections are cut per part (rank r's [q_r; k_r; v_r], [gate_r; up_r]), and when
t exceeds the key/value heads each rank holds the one whole head its queries attend to
(replicated t/Hkv times). A `Shard` records the ranges, so that `tensor_parallel.
full_tensor` can put a tensor back together and `grad_norm` count a replica once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
