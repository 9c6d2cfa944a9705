"""FlashAttention-2 in Triton: forward and backward, causal or not, grouped-query heads.

Why. Naive attention writes the (S, S) score matrix to memory, reads it back for the
softmax and again for P·V, and keeps it for the backward: O(S²) memory and traffic for
an operation whose inputs and output are O(S·D). Flash attention (Dao et al. 2022) tiles
Q, K and V so that the scores of one (BLOCK_M, BLOCK_N) tile live only in registers and
shared memory, and never reach HBM.

Forward: the online softmax. For one block of BLOCK_M query rows, walk over the key
blocks j = 0, 1, ... and keep, per row, the running maximum m, the running sum l and the
unnormalised output acc (fp32)::

    s_j   = (Q K_jᵀ) · scale · log2(e)           scores in base 2, so exp() is exp2()
    m_new = max(m, rowmax(s_j))
    p_j   = exp2(s_j - m_new)
    alpha = exp2(m - m_new)                       rescales what was summed so far
    l     = alpha · l + rowsum(p_j)
    acc   = alpha · acc + p_j V_j
    m     = m_new
    ...
    O   = acc / l
    LSE = (m + log2 l) · ln 2                     natural-log log-sum-exp, saved

Folding log2(e) into the scale turns every exp into one `exp2` (a single MUFU
instruction) fed by one fused multiply-add. FlashAttention-2 (Dao 2023) keeps the
division by l out of the loop, as above, and gives each program a block of query rows
(not of keys), so the forward needs no communication between programs.

Backward: recompute P from Q, K and the saved LSE instead of storing it::

    P  = exp2(Q Kᵀ · scale · log2(e) - LSE · log2(e))
    dV = Pᵀ dO
    dP = dO Vᵀ
    Δ  = rowsum(dO ∘ O)        (= rowsum(P ∘ dP); `_attn_bwd_preprocess_kernel`)
    dS = P ∘ (dP - Δ)
    dQ = dS K · scale
    dK = dSᵀ Q · scale

dK and dV are sums over query rows, dQ a sum over key rows. Each program of
`_attn_bwd_dkdv_kernel` owns a block of keys and walks over the queries — for
grouped-query attention over all the query heads that share its key/value head — so dK
and dV are complete when it stores them: no atomics, no `repeat_kv` copy. dQ comes one
of two ways (`dq_mode`):

- "separate" (default): `_attn_bwd_dq_kernel` owns a block of queries and walks over the
  keys, recomputing P and dP: 7 matmuls in all, every output written once,
  deterministic (the Triton tutorial's choice).
- "atomic": the dK/dV program also forms dS K for its keys and adds it into an fp32 dQ
  with `atomic_add` (FA2's choice): 5 matmuls, but atomic traffic to L2 and sums whose
  order changes from run to run.

Scheduling. Causal masking costs nothing off the diagonal: each loop is split into the
blocks fully left of (or below) the diagonal, with no mask at all, the diagonal block,
with the causal mask, and, when S is not a multiple of the block, one ragged tail block
with a bounds mask. The grid is (row blocks, heads, batch) with row blocks fastest, so
the programs running at the same time share one head's K and V in L2; causal query
blocks are launched longest-row first, so the last wave is made of short programs.

Layout and dtypes: q (B, Hq, S, D), k and v (B, Hkv, S, D), Hq a multiple of Hkv; any
strides (the kernels take every stride; nothing is copied, so q may be a transpose of a
(B, S, H, D) tensor); head dims 32, 64, 128, 256; bf16 and fp16 (fp32 works, with tf32
matmuls on a GPU). Matmuls accumulate in fp32. Under the CPU interpreter, bf16/fp16
tiles are upcast to fp32 inside the kernels (NumPy has no bf16 matmul).

References: T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention
with IO-Awareness" (2022); T. Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning" (2023); Triton tutorial 06, "Fused Attention".
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from colossal_lab.kernels import INTERPRET
from colossal_lab.kernels import flash_attention_hopper as hopper
from colossal_lab.kernels import flash_attention_hopper_backward as hopper_bwd

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
"""Head dims the kernels accept (a tile's width must be a power of two)."""
KERNELS = ("auto", "portable", "hopper", "hopper-serial", "hopper-overlap",
           "hopper-pingpong")
DEFAULT_KERNEL = "auto"
"""Which kernels run, forward and backward: "portable" (this file's FlashAttention-2),
"hopper" (the Gluon kernels for sm_90: `flash_attention_hopper`'s forward and
`flash_attention_hopper_backward`'s one-pass backward; an error where they cannot run),
"hopper-serial" / "-overlap" / "-pingpong" (the same with one of the forward's
`SCHEDULES` under `flash_attention_hopper.default_scheduler`; "hopper" takes the
`AUTO_FORWARD` plan, or `flash_attention_hopper.DEFAULT_SCHEDULE` where none matches)
or "auto": each pass takes the Hopper kernel where `flash_attention_hopper.unsupported`
accepts the inputs, torch.compile is not tracing and the pass's rules (`AUTO_HOPPER`,
`AUTO_FORWARD`) say it is the faster one, the portable kernel elsewhere (A100s, CPUs,
fp32, odd shapes)."""
AUTO_HOPPER = {"forward": {"head_dims": (128, 256), "min_seq_len": 1024},
               "backward": {"head_dims": (64, 128, 256), "min_seq_len": 1024}}
"""Where "auto" may take the Hopper kernel over the portable one, per pass, from H200
probes (same process, bf16). The Hopper forward lost to the portable one at S = 512 and
at head dim 64, and won at 256 (1.3x with the mask, 1.5x without, S = 4096); its
backward lost only at S = 512. Inside these bounds the forward also needs a row of
`AUTO_FORWARD`. The sweep (`bench flash_attention`, `results/h200/flash_attention.json`)
records both next to cuDNN at every point."""
SHORT_CAUSAL = {"keys_per_step": 64, "stages": 4, "diag_skip": True, "epilogue": "tma"}
"""The Hopper forward's options for short causal rows: 64 keys a step, four K/V slots
(as many as fit: two at head dim 256), warpgroup 0 leaving out each tile's last key
tile, and O stored through shared memory by TMA (`flash_attention_hopper.forward`). At
S = 1024, D = 128 (MHA and GQA-4) they ran at 0.92-0.93x cuDNN on the H200, about 15%
ahead of the same kernel without the TMA store or with 128 keys and two slots."""
AUTO_FORWARD = (
    # (causal, longest S or None, (schedule, scheduler[, options of
    # `flash_attention_hopper.forward`]) or None for the portable forward): the first
    # row that matches decides, inside `AUTO_HOPPER`'s bounds
    (True, 1024, ("overlap", "dynamic", SHORT_CAUSAL)),
    (True, 2048, ("overlap", "dynamic")),
    (True, None, ("serial", "grid")),
    (False, 1024, ("pingpong", "static")),
    (False, None, ("serial", "static")),
)
"""The Hopper forward's plan per mask and length, from H200 probes at D = 128 (graph
replay, interleaved rounds). With the mask, "overlap" under the dynamic scheduler: at
S = 1024 it ran 0.79x cuDNN against the portable forward's 0.73x (0.92x with
`SHORT_CAUSAL`), MHA and GQA-8 alike, and at S = 2048 (GQA-8) it led "serial" on the
grid, which takes over from 4096 on (level there, ahead at 16k). Without the mask at
S = 1024 the persistent ping-pong forward ran at 0.87-0.89x cuDNN against the portable
one's 0.62-0.73x; "serial" takes over from 2048 on (level with ping-pong at 4096)."""
DQ_MODES = ("separate", "atomic")
DEFAULT_DQ_MODE = "separate"
"""How the backward computes dQ (see `flash_attention_backward`). "separate" is
deterministic; the benchmark measures both ("triton" and "triton-atomic")."""

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x · log2 e)
_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): back from base 2 to natural log


def _seq_bucket(seq_len: int) -> int:
    """Autotuning key for the sequence length: the best tile hardly changes inside a
    bucket, and one key per distinct length would re-tune for every batch."""
    return 1024 if seq_len <= 1024 else (4096 if seq_len <= 4096 else 16384)


def _smem_bytes(tile_rows: int, step_rows: int, head_dim: int, stages: int,
                stationary: int, streamed: int, elt: int) -> int:
    """Rough shared memory of a config: `stationary` (tile_rows, D) tiles held for the
    whole program, `streamed` (step_rows, D) tiles per pipeline stage, `elt`-byte values."""
    return elt * head_dim * (stationary * tile_rows + stages * streamed * step_rows)


_SMEM_LIMIT = 220 * 1024  # H100/H200: 227 KiB per block, minus scratch for reductions

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim; BLOCK_M counts query
# rows, BLOCK_N key rows. On Hopper a warpgroup (4 warps) issues wgmma on 64-row slabs.
# Chosen from sm_90 compiles (ptxas -v): tiles whose accumulators spill registers at a
# head dim are not offered there (e.g. a 128x64 forward tile with 4 warps at D=128).
_TILES = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
             (64, 64, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
        256: [(128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3)],
    },
    # dK/dV: a program owns BLOCK_N keys and steps over BLOCK_M queries
    "dkdv": {
        64: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3),
             (32, 64, 4, 2)],
        128: [(32, 128, 8, 3), (32, 128, 8, 4), (64, 128, 8, 2), (32, 64, 4, 2)],
        256: [(16, 64, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2)],
    },
    # dQ: a program owns BLOCK_M queries and steps over BLOCK_N keys
    "dq": {
        64: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
             (64, 32, 4, 2)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
              (64, 32, 4, 2)],
        256: [(64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2)],
    },
}


def _tiles_for(kind: str, head_dim: int) -> list[tuple]:
    return _TILES[kind][64 if head_dim <= 64 else head_dim]


def _prune(kind: str):
    """Keep the head dim's tiles; drop those that break the causal block alignment or
    cannot fit in shared memory."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        d, causal, elt = args["HEAD_DIM"], args["CAUSAL"], args["Q"].element_size()
        offered = set(_tiles_for(kind, d))
        keep = []
        for c in configs:
            bm, bn, st = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages
            if (bm, bn, c.num_warps, st) not in offered:
                continue
            if kind == "fwd":  # stationary q; k, v streamed
                smem, big, small = _smem_bytes(bm, bn, d, st, 1, 2, elt), bm, bn
            elif kind == "dkdv":  # stationary k, v; q, dO streamed
                smem, big, small = _smem_bytes(bn, bm, d, st, 2, 2, elt), bn, bm
            else:  # dq: stationary q, dO; k, v streamed
                smem, big, small = _smem_bytes(bm, bn, d, st, 2, 2, elt), bm, bn
            if causal and big % small:
                continue  # the diagonal must be covered by whole steps
            if smem <= _SMEM_LIMIT:
                keep.append(c)
        # fp32 (tf32 matmuls, not a speed target) may fit none of the bf16 tiles
        return keep or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"],
                                                    c.num_stages))]

    return prune


def _configs(kind: str) -> list[triton.Config]:
    """Tiles to autotune over on a GPU (pruned to the head dim's list at launch); exactly
    one small tile under the interpreter."""
    if INTERPRET:  # unequal tiles so the tests cover diagonals spanning several steps
        bm, bn = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}[kind]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    tiles = dict.fromkeys(t for per_dim in _TILES[kind].values() for t in per_dim)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in tiles]


_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "GROUP", "SEQ_BUCKET"]


# --------------------------------------------------------------------------- forward


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q,  # running state and the query tile
                    k_ptrs, v_ptrs,  # (BLOCK_N, D) pointers to the first key/value block
                    stride_ks, stride_vs,  # row strides of k and v
                    offs_m, offs_n,  # query row indices (BLOCK_M,), 0..BLOCK_N-1
                    lo, hi, seq_len, qk_scale,  # key range [lo, hi), S, scale·log2(e)
                    BLOCK_N: tl.constexpr,  # key rows per step
                    MASKED: tl.constexpr,  # False: no mask; True: causal or bounds mask
                    CAUSAL: tl.constexpr):  # with MASKED: the diagonal; else the tail
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            k = tl.load(k_ptrs + start_n * stride_ks, mask=cols[:, None] < seq_len, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_ks)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))  # (BLOCK_M, BLOCK_N), fp32
        if MASKED:
            if CAUSAL:
                keep = offs_m[:, None] >= cols[None, :]
            else:
                keep = cols[None, :] < seq_len
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:  # scale after the max: one FMA per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs + start_n * stride_vs, mask=cols[:, None] < seq_len, other=0.0)
        else:
            v = tl.load(v_ptrs + start_n * stride_vs)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune("fwd")})
@triton.jit
def _attn_fwd_kernel(
    Q, K, V,  # inputs: (B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D), any strides
    Out,  # output O, (B, Hq, S, D)
    LSE,  # output (B, Hq, S) fp32, contiguous: natural-log log-sum-exp of each row
    stride_qb, stride_qh, stride_qs, stride_qd,  # strides of Q, in elements
    stride_kb, stride_kh, stride_ks, stride_kd,  # strides of K
    stride_vb, stride_vh, stride_vs, stride_vd,  # strides of V
    stride_ob, stride_oh, stride_os, stride_od,  # strides of O
    H_Q,  # number of query heads
    seq_len,  # S: query and key length
    qk_scale,  # softmax scale · log2(e)
    SEQ_BUCKET,  # autotuning key only (see `_seq_bucket`)
    GROUP: tl.constexpr,  # query heads per key/value head, Hq // Hkv
    HEAD_DIM: tl.constexpr,  # D
    CAUSAL: tl.constexpr,  # mask keys after the query
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter with bf16/fp16 inputs)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key rows per step
):
    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    else:
        start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hkv = off_h // GROUP  # grouped-query attention: read the shared k/v head
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_hkv.to(tl.int64) * stride_vh
    Out += off_b * stride_ob + off_h.to(tl.int64) * stride_oh
    LSE += (off_b * H_Q + off_h) * seq_len

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(Q + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # stays in registers/SMEM throughout
    if UPCAST:
        q = q.to(tl.float32)
    k_ptrs = K + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # blocks fully left of the diagonal: all keys < start_m·BLOCK_M < S, no mask
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs,
                                        stride_ks, stride_vs, offs_m, offs_n,
                                        0, start_m * BLOCK_M, seq_len, qk_scale,
                                        BLOCK_N, False, True)
        # the diagonal block (its steps), clipped to S
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs,
                                        stride_ks, stride_vs, offs_m, offs_n,
                                        start_m * BLOCK_M,
                                        tl.minimum((start_m + 1) * BLOCK_M, seq_len),
                                        seq_len, qk_scale, BLOCK_N, True, True)
    else:
        n_full = (seq_len // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs,
                                        stride_ks, stride_vs, offs_m, offs_n,
                                        0, n_full, seq_len, qk_scale, BLOCK_N, False, False)
        # the ragged last key block, if S is not a multiple of BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs,
                                        stride_ks, stride_vs, offs_m, offs_n,
                                        n_full, seq_len, seq_len, qk_scale,
                                        BLOCK_N, True, False)
    acc = acc / l_i[:, None]
    tl.store(LSE + offs_m, (m_i + tl.math.log2(l_i)) * _LN2, mask=row_ok)
    tl.store(Out + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


# -------------------------------------------------------------------------- backward


@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DO,  # forward output O and its gradient dO, (B, Hq, S, D), any strides
    DELTA,  # output (B, Hq, S) fp32, contiguous: rowsum(dO ∘ O)
    stride_ob, stride_oh, stride_os, stride_od,  # strides of O
    stride_dob, stride_doh, stride_dos, stride_dod,  # strides of DO
    H_Q,  # number of query heads
    seq_len,  # S
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_M: tl.constexpr,  # rows per program
):
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    Out += off_b * stride_ob + off_h.to(tl.int64) * stride_oh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    o = tl.load(Out + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + (off_b * H_Q + off_h) * seq_len + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v,  # fp32 accumulators, the stationary key/value tile
                         q_ptrs, do_ptrs,  # (BLOCK_M, D) pointers to the first query block
                         stride_qs, stride_dos,  # row strides of q and dO
                         dq_ptrs, stride_dqs,  # fp32 dQ accumulator (ATOMIC_DQ only)
                         LSE, DELTA,  # this head's rows of LSE and Δ
                         offs_n, arange_m,  # key row indices (BLOCK_N,), 0..BLOCK_M-1
                         lo, hi, seq_len, qk_scale,  # query range [lo, hi), S, scale·log2 e
                         sm_scale,  # softmax scale (ATOMIC_DQ only)
                         BLOCK_M: tl.constexpr,  # query rows per step
                         MASKED: tl.constexpr,  # False: no mask; True: causal or bounds mask
                         CAUSAL: tl.constexpr,  # with MASKED: the diagonal; else the tail
                         ATOMIC_DQ: tl.constexpr):  # also add dS K · scale into dQ
    # Work with transposed tiles (keys along rows): Pᵀ and dSᵀ come out of the first
    # matmuls already in the layout dV += Pᵀ dO and dK += dSᵀ Q need, no register transpose.
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + arange_m
        if MASKED:
            row_ok = offs_m < seq_len
            q = tl.load(q_ptrs + start_m * stride_qs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs + start_m * stride_dos, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE + offs_m, mask=row_ok, other=0.0) * _LOG2E
            delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs + start_m * stride_qs)
            do = tl.load(do_ptrs + start_m * stride_dos)
            lse2 = tl.load(LSE + offs_m) * _LOG2E
            delta = tl.load(DELTA + offs_m)
        q = q.to(k.dtype)
        do = do.to(k.dtype)
        qk_t = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M) = (Q Kᵀ)ᵀ
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if MASKED:
            keep = row_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(keep, p_t, 0.0)
        dv = tl.dot(p_t.to(k.dtype), do, dv)  # dV += Pᵀ dO
        dp_t = tl.dot(v, tl.trans(do))  # (dO Vᵀ)ᵀ
        ds_t = p_t * (dp_t - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ - Δ)
        dk = tl.dot(ds_t.to(k.dtype), q, dk)  # dK += dSᵀ Q (scale applied at the end)
        if ATOMIC_DQ:  # FA2's dQ: partial sums from every key block meet in fp32 memory
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k) * sm_scale  # (BLOCK_M, D)
            if MASKED:
                tl.atomic_add(dq_ptrs + start_m * stride_dqs, dq, mask=row_ok[:, None],
                              sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs + start_m * stride_dqs, dq, sem="relaxed")
    return dk, dv


@triton.autotune(configs=_configs("dkdv"), key=_TUNE_KEY + ["ATOMIC_DQ"],
                 prune_configs_by={"early_config_prune": _prune("dkdv")},
                 reset_to_zero=["DQ"])  # tuning reruns the kernel: atomics must restart at 0
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V,  # forward inputs: (B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D)
    DO,  # gradient of the output, (B, Hq, S, D)
    LSE, DELTA,  # (B, Hq, S) fp32, contiguous: forward log-sum-exp and rowsum(dO ∘ O)
    DK, DV,  # outputs, (B, Hkv, S, D)
    DQ,  # ATOMIC_DQ: fp32 (B, Hq, S, D) accumulator, zeroed; otherwise unused
    stride_qb, stride_qh, stride_qs, stride_qd,  # strides of Q
    stride_kb, stride_kh, stride_ks, stride_kd,  # strides of K
    stride_vb, stride_vh, stride_vs, stride_vd,  # strides of V
    stride_dob, stride_doh, stride_dos, stride_dod,  # strides of DO
    stride_dkb, stride_dkh, stride_dks, stride_dkd,  # strides of DK
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,  # strides of DV
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,  # strides of DQ
    H_Q,  # number of query heads
    seq_len,  # S
    qk_scale,  # softmax scale · log2(e)
    sm_scale,  # softmax scale (for dK = dSᵀ Q · scale)
    SEQ_BUCKET,  # autotuning key only
    GROUP: tl.constexpr,  # query heads per key/value head; this program sums over them
    HEAD_DIM: tl.constexpr,  # D
    CAUSAL: tl.constexpr,  # mask keys after the query
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter with bf16/fp16 inputs)
    ATOMIC_DQ: tl.constexpr,  # also accumulate dQ here (atomics) instead of its own kernel
    BLOCK_M: tl.constexpr,  # query rows per step
    BLOCK_N: tl.constexpr,  # key rows per program
):
    if CAUSAL:
        tl.static_assert(BLOCK_N % BLOCK_M == 0)
    start_n = tl.program_id(0) * BLOCK_N  # causal: low keys see the most queries, go first
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    K += off_b * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_hkv.to(tl.int64) * stride_vh
    DK += off_b * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
    DV += off_b * stride_dvb + off_hkv.to(tl.int64) * stride_dvh

    offs_n = start_n + tl.arange(0, BLOCK_N)
    arange_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < seq_len
    k = tl.load(K + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=key_ok[:, None], other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                mask=key_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    m_full = (seq_len // BLOCK_M) * BLOCK_M  # end of the whole query blocks

    for g in range(GROUP):  # every query head that reads this key/value head
        off_h = off_hkv * GROUP + g
        q_ptrs = (Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh
                  + arange_m[:, None] * stride_qs + offs_d[None, :] * stride_qd)
        do_ptrs = (DO + off_b * stride_dob + off_h.to(tl.int64) * stride_doh
                   + arange_m[:, None] * stride_dos + offs_d[None, :] * stride_dod)
        dq_ptrs = (DQ + off_b * stride_dqb + off_h.to(tl.int64) * stride_dqh
                   + arange_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd)
        lse = LSE + (off_b * H_Q + off_h) * seq_len
        delta = DELTA + (off_b * H_Q + off_h) * seq_len
        if CAUSAL:
            # queries on the diagonal block: causal mask
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qs, stride_dos,
                                          dq_ptrs, stride_dqs, lse, delta, offs_n, arange_m,
                                          start_n, tl.minimum(start_n + BLOCK_N, seq_len),
                                          seq_len, qk_scale, sm_scale, BLOCK_M, True, True,
                                          ATOMIC_DQ)
            lo = start_n + BLOCK_N
            hi = tl.maximum(lo, m_full)
        else:
            lo = 0
            hi = m_full
        # queries below the diagonal (all of them if not causal): no mask
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qs, stride_dos,
                                      dq_ptrs, stride_dqs, lse, delta, offs_n, arange_m,
                                      lo, hi, seq_len, qk_scale, sm_scale, BLOCK_M,
                                      False, False, ATOMIC_DQ)
        # the ragged last query block
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qs, stride_dos,
                                      dq_ptrs, stride_dqs, lse, delta, offs_n, arange_m,
                                      hi, seq_len, seq_len, qk_scale, sm_scale, BLOCK_M,
                                      True, False, ATOMIC_DQ)

    tl.store(DK + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta,  # accumulator, stationary tiles, row stats
                       k_ptrs, v_ptrs,  # (BLOCK_N, D) pointers to the first key/value block
                       stride_ks, stride_vs,  # row strides of k and v
                       offs_m, offs_n,  # query row indices (BLOCK_M,), 0..BLOCK_N-1
                       lo, hi, seq_len, qk_scale,  # key range [lo, hi), S, scale·log2(e)
                       BLOCK_N: tl.constexpr,  # key rows per step
                       MASKED: tl.constexpr,  # False: no mask; True: causal or bounds mask
                       CAUSAL: tl.constexpr):  # with MASKED: the diagonal; else the tail
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            k = tl.load(k_ptrs + start_n * stride_ks, mask=cols[:, None] < seq_len, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vs, mask=cols[:, None] < seq_len, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_ks)
            v = tl.load(v_ptrs + start_n * stride_vs)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            if CAUSAL:
                keep = offs_m[:, None] >= cols[None, :]
            else:
                keep = cols[None, :] < seq_len
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])  # dS = P ∘ (dP - Δ)
        dq = tl.dot(ds.to(q.dtype), k, dq)  # dQ += dS K (scale applied at the end)
    return dq


@triton.autotune(configs=_configs("dq"), key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune("dq")})
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V,  # forward inputs: (B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D)
    DO,  # gradient of the output, (B, Hq, S, D)
    LSE, DELTA,  # (B, Hq, S) fp32, contiguous: forward log-sum-exp and rowsum(dO ∘ O)
    DQ,  # output, (B, Hq, S, D)
    stride_qb, stride_qh, stride_qs, stride_qd,  # strides of Q
    stride_kb, stride_kh, stride_ks, stride_kd,  # strides of K
    stride_vb, stride_vh, stride_vs, stride_vd,  # strides of V
    stride_dob, stride_doh, stride_dos, stride_dod,  # strides of DO
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,  # strides of DQ
    H_Q,  # number of query heads
    seq_len,  # S
    qk_scale,  # softmax scale · log2(e)
    sm_scale,  # softmax scale (for dQ = dS K · scale)
    SEQ_BUCKET,  # autotuning key only
    GROUP: tl.constexpr,  # query heads per key/value head
    HEAD_DIM: tl.constexpr,  # D
    CAUSAL: tl.constexpr,  # mask keys after the query
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter with bf16/fp16 inputs)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key rows per step
):
    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    else:
        start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hkv = off_h // GROUP
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    DQ += off_b * stride_dqb + off_h.to(tl.int64) * stride_dqh
    K += off_b * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_hkv.to(tl.int64) * stride_vh
    LSE += (off_b * H_Q + off_h) * seq_len
    DELTA += (off_b * H_Q + off_h) * seq_len

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(Q + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    do = do.to(q.dtype)
    lse2 = tl.load(LSE + offs_m, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
    k_ptrs = K + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs,
                                offs_m, offs_n, 0, start_m * BLOCK_M, seq_len, qk_scale,
                                BLOCK_N, False, True)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs,
                                offs_m, offs_n, start_m * BLOCK_M,
                                tl.minimum((start_m + 1) * BLOCK_M, seq_len), seq_len,
                                qk_scale, BLOCK_N, True, True)
    else:
        n_full = (seq_len // BLOCK_N) * BLOCK_N
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs,
                                offs_m, offs_n, 0, n_full, seq_len, qk_scale,
                                BLOCK_N, False, False)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs,
                                offs_m, offs_n, n_full, seq_len, seq_len, qk_scale,
                                BLOCK_N, True, False)
    tl.store(DQ + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------- launchers


def tuned_configs() -> dict[str, dict[str, str]]:
    """The tiles the autotuner picked so far, per kernel and tuning key (for results)."""
    kernels = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel,
               "dq": _attn_bwd_dq_kernel}
    return {name: {str(key): str(cfg) for key, cfg in k.cache.items()}
            for name, k in kernels.items()}


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The shape rules every attention backend shares (`switches.attention` checks them
    for all of them); returns the group size Hq // Hkv."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (B, H, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if hkv == 0:
        raise ValueError("k and v have no heads (Hkv=0)")
    if (b, d) != (bk, dk):
        raise ValueError(f"batch/head_dim of q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}: each key/value head "
                         "must serve a whole group of query heads")
    return hq // hkv



def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate early, saying what to change; returns the group size Hq // Hkv."""
    groups = check_shapes(q, k, v)
    s, sk, d = q.shape[2], k.shape[2], q.shape[3]
    if s != sk:
        raise ValueError(f"flash_attention needs equal query and key lengths; got {s} and {sk}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported by the Triton flash attention; "
                         f"supported: {SUPPORTED_HEAD_DIMS} (pad D, or use backend='sdpa')")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype} not supported; use bf16, fp16 or fp32")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError("Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    if q.dtype == torch.float32 and d > 128 and not INTERPRET:
        raise ValueError(f"fp32 with head_dim={d} does not fit in shared memory; use bf16 "
                         "or fp16 (fp32 runs as tf32 on the GPU anyway)")
    return groups


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype != torch.float32


def _scale(sm_scale: float | None, head_dim: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if not scale > 0:  # the unmasked loop takes max(qk) · scale as the max of the scores
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    return scale


def _forward_plan(kernel: str, s: int, causal: bool, d: int = 128
                  ) -> tuple[str, str, dict] | None:
    """(schedule, scheduler, options) of the Hopper forward that `kernel` asks for at
    length s and head dim d: "auto" and "hopper" take the `AUTO_FORWARD` row for
    (causal, s), "hopper" the default plan where that row says portable (None for
    "auto"); the named schedules ("hopper-serial", ...) take `default_scheduler(causal)`
    and the default options. The options are keywords of `flash_attention_hopper.forward`
    cut to what head dim d allows (`_fit_options`)."""
    schedule = kernel.partition("-")[2]
    if schedule:
        return schedule, hopper.default_scheduler(causal), {}
    plan = next(plan for row_causal, longest, plan in AUTO_FORWARD
                if row_causal == bool(causal) and (longest is None or s <= longest))
    if plan is None:
        return None if kernel == "auto" else (
            hopper.DEFAULT_SCHEDULE, hopper.default_scheduler(causal), {})
    schedule, scheduler, *options = plan
    return schedule, scheduler, _fit_options(options[0] if options else {}, d, causal,
                                             schedule)


def _fit_options(options: dict, d: int, causal: bool, schedule: str) -> dict:
    """A plan's options at head dim d: keys a step at most `block_n(d)`, the most K/V
    slots up to the asked number that shared memory holds, the diagonal skip only where
    `forward` takes it (causal, 64 keys a step, not "pingpong")."""
    out = dict(options)
    keys = min(out.get("keys_per_step") or hopper.block_n(d), hopper.block_n(d))
    if "keys_per_step" in out:
        out["keys_per_step"] = keys
    if "stages" in out:
        out["stages"] = max(n for n in hopper.STAGE_CHOICES if n <= out["stages"] and (
            n == min(hopper.STAGE_CHOICES)
            or hopper.shared_bytes(d, keys, n, 1) <= hopper.SHARED_LIMIT))
    if out.get("diag_skip"):
        out["diag_skip"] = hopper.diag_skip_applies(causal, keys, schedule)
    return out


def _plan_name(plan: tuple[str, str, dict], d: int) -> str:
    """"hopper-overlap-dynamic", with "-tma" (the epilogue, where not the default),
    "-k64" (keys a step other than `block_n(d)`), "-s4" (K/V slots other than `STAGES`)
    and "-skip" (the diagonal skip) as they apply: the names the probes and the sweep
    record."""
    schedule, scheduler, options = plan
    keys = options.get("keys_per_step") or hopper.block_n(d)
    stages = options.get("stages", hopper.STAGES)
    epilogue = options.get("epilogue", hopper.DEFAULT_EPILOGUE)
    return (f"hopper-{schedule}-{scheduler}"
            + (f"-{epilogue}" if epilogue != hopper.DEFAULT_EPILOGUE else "")
            + (f"-k{keys}" if keys != hopper.block_n(d) else "")
            + (f"-s{stages}" if stages != hopper.STAGES else "")
            + ("-skip" if options.get("diag_skip") else ""))


def _why_not_hopper(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    which: str = "forward", causal: bool = True) -> str | None:
    """None where `kernel` (not "portable") runs the Hopper kernel of pass `which` on
    these inputs; otherwise why not, which is an error unless kernel is "auto"."""
    rule = AUTO_HOPPER[which]
    if kernel == "auto" and (q.shape[3] not in rule["head_dims"]
                             or q.shape[2] < rule["min_seq_len"]
                             or which == "forward"
                             and _forward_plan(kernel, q.shape[2], causal,
                                               q.shape[3]) is None):
        return f"the portable {which} is faster here (AUTO_HOPPER, AUTO_FORWARD)"
    if INTERPRET:
        why = "Gluon has no interpreter"
    elif torch.compiler.is_compiling():
        why = "torch.compile is tracing (it traces the portable kernel)"
    else:
        why = hopper.unsupported(q, k, v, which)
    if why is not None and kernel != "auto":
        raise ValueError(f"the Hopper kernels cannot take these inputs: {why} "
                         "(kernel='auto' falls back to the portable kernel)")
    return why


def _check_kernel(kernel: str | None) -> str:
    kernel = kernel or DEFAULT_KERNEL
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; choose from {KERNELS}")
    return kernel


def kernel_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kernel: str | None = None, causal: bool = True) -> str:
    """Which kernel each pass runs for these inputs, e.g. "fwd hopper-overlap-dynamic,
    bwd hopper" (the forward's schedule and scheduler) or "fwd portable, bwd portable"
    (for the benchmark's rows)."""
    kernel = _check_kernel(kernel)
    names = []
    for which in ("forward", "backward"):
        name = "portable"
        if kernel != "portable":
            try:
                if _why_not_hopper(kernel, q, k, v, which, causal) is None:
                    name = _plan_name(_forward_plan(kernel, q.shape[2], causal,
                                                    q.shape[3]), q.shape[3]) \
                        if which == "forward" else "hopper"
            except ValueError:  # an explicit "hopper" that cannot run: it would raise
                name = "error"
        names.append(("fwd " if which == "forward" else "bwd ") + name)
    return ", ".join(names)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            causal: bool = True, sm_scale: float | None = None,
                            kernel: str | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        q: (B, Hq, S, D); k, v: (B, Hkv, S, D). Any strides; nothing is copied.
        causal: mask keys after the query.
        sm_scale: softmax scale, default 1/sqrt(D).
        kernel: one of `KERNELS`, default `DEFAULT_KERNEL`.
    Returns:
        o: (B, Hq, S, D) in q's dtype, laid out like q (`empty_like`), so the usual
           `o.transpose(1, 2).reshape(B, S, H·D)` of a (B, S, H, D) q costs no copy;
        lse: (B, Hq, S) fp32, the natural-log log-sum-exp of each score row.
    """
    group = _check_inputs(q, k, v)
    kernel = _check_kernel(kernel)
    b, hq, s, d = q.shape
    sm_scale = _scale(sm_scale, d)
    o = torch.empty_like(q)
    lse = torch.empty((b, hq, s), device=q.device, dtype=torch.float32)
    if s == 0 or b == 0:
        return o, lse
    if kernel != "portable" and _why_not_hopper(kernel, q, k, v, causal=causal) is None:
        schedule, scheduler, options = _forward_plan(kernel, s, causal, d)
        hopper.forward(q, k, v, causal, sm_scale, o, lse, schedule=schedule,
                       scheduler=scheduler, **options)
        return o, lse

    def grid(meta):
        return (triton.cdiv(s, meta["BLOCK_M"]), hq, b)

    _attn_fwd_kernel[grid](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        hq, s, sm_scale * math.log2(math.e), _seq_bucket(s),
        GROUP=group, HEAD_DIM=d, CAUSAL=bool(causal), UPCAST=_upcast(q.dtype))
    return o, lse


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                             causal: bool = True, sm_scale: float | None = None,
                             dq_mode: str | None = None, kernel: str | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward: Δ = rowsum(dO ∘ O), then dK/dV and dQ.

    Args:
        do: (B, Hq, S, D) gradient of the output, any strides.
        q, k, v, o, lse: as passed to / returned by `flash_attention_forward`.
        dq_mode: "separate" (dQ in its own kernel, recomputing P and dP: 7 matmuls,
            deterministic) or "atomic" (the dK/dV kernel adds dS K into an fp32 buffer
            with atomics, FA2's way: 5 matmuls, run-to-run bit differences). Default
            `DEFAULT_DQ_MODE`. The Hopper backward always adds dQ up (through TMA
            reductions); dq_mode is the portable kernel's.
        kernel: one of `KERNELS` (every "hopper*" name runs the same backward),
            default `DEFAULT_KERNEL`.
    Returns:
        dq (B, Hq, S, D), dk and dv (B, Hkv, S, D), laid out like q, k, v.
    """
    group = _check_inputs(q, k, v)
    dq_mode = dq_mode or DEFAULT_DQ_MODE
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode={dq_mode!r}; choose from {DQ_MODES}")
    kernel = _check_kernel(kernel)
    atomic = dq_mode == "atomic"
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    sm_scale = _scale(sm_scale, d)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    hopper_ok = kernel != "portable" and s > 0 and b > 0 \
        and _why_not_hopper(kernel, q, k, v, "backward") is None
    if hopper_ok:
        atomic = False  # no buffer here: the Hopper kernel allocates its own
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic \
        else torch.empty_like(q)
    if s == 0 or b == 0:
        return dq.zero_().to(q.dtype), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    block = 32 if INTERPRET else 64
    _attn_bwd_preprocess_kernel[(triton.cdiv(s, block), hq, b)](
        o, do, delta, *o.stride(), *do.stride(), hq, s, HEAD_DIM=d, BLOCK_M=block)
    if hopper_ok:
        dq32 = hopper_bwd.backward(do, q, k, v, lse, delta, causal, sm_scale, dk, dv)
        return dq.copy_(dq32), dk, dv
    common = dict(GROUP=group, HEAD_DIM=d, CAUSAL=bool(causal), UPCAST=_upcast(q.dtype))
    qk_scale = sm_scale * math.log2(math.e)

    def grid_kv(meta):
        return (triton.cdiv(s, meta["BLOCK_N"]), hkv, b)

    _attn_bwd_dkdv_kernel[grid_kv](
        q, k, v, do, lse, delta, dk, dv, dq, *q.stride(), *k.stride(), *v.stride(),
        *do.stride(), *dk.stride(), *dv.stride(), *dq.stride(), hq, s, qk_scale, sm_scale,
        _seq_bucket(s), ATOMIC_DQ=atomic, **common)
    if atomic:
        return dq.to(q.dtype), dk, dv

    def grid_q(meta):
        return (triton.cdiv(s, meta["BLOCK_M"]), hq, b)

    _attn_bwd_dq_kernel[grid_q](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *dq.stride(), hq, s, qk_scale, sm_scale, _seq_bucket(s), **common)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wiring: save q, k, v, o and the LSE (O(S) extra), never P."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, dq_mode=None, kernel=None):
        o, lse = flash_attention_forward(q, k, v, causal, sm_scale, kernel)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.dq_mode, ctx.kernel = causal, sm_scale, dq_mode, kernel
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale,
                                              ctx.dq_mode, ctx.kernel)
        return dq, dk, dv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    sm_scale: float | None = None, *, dq_mode: str | None = None,
                    kernel: str | None = None) -> torch.Tensor:
    """Exact attention softmax(q kᵀ · scale) v without materialising the scores.

    Args:
        q: (B, Hq, S, D) queries; D in `SUPPORTED_HEAD_DIMS`.
        k: (B, Hkv, S, D) keys; Hq must be a multiple of Hkv (grouped-query attention,
            handled inside the kernels: no copies of k or v).
        v: (B, Hkv, S, D) values.
        causal: mask keys after the query (top-left aligned, queries and keys equal length).
        sm_scale: softmax scale, default 1/sqrt(D).
        dq_mode: how the backward computes dQ, "separate" or "atomic" (see
            `flash_attention_backward`); default `DEFAULT_DQ_MODE`.
        kernel: which kernels, forward and backward (`KERNELS`); default
            `DEFAULT_KERNEL`.
    Returns:
        (B, Hq, S, D) in q's dtype; differentiable in q, k and v.
    """
    _check_inputs(q, k, v)
    if dq_mode is not None and dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode={dq_mode!r}; choose from {DQ_MODES}")
    if _check_kernel(kernel) not in ("auto", "portable") and torch.is_grad_enabled() \
            and any(t.requires_grad for t in (q, k, v)):
        _why_not_hopper(kernel, q, k, v, "backward")  # raises now, not in the backward
    return FlashAttentionFunction.apply(q, k, v, bool(causal), sm_scale, dq_mode, kernel)
