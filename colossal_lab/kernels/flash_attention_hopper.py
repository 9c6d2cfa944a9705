"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialised, TMA and wgmma.

Why a second forward. The portable kernel (`flash_attention.py`, FlashAttention-2 in
Triton) leaves the schedule to Triton's compiler: every warp loads, multiplies and runs
the softmax in turn, so the tensor cores wait while the exponentials run and the loads
are issued by the same warps that need the registers. On the H200 it reaches about 0.8x
cuDNN. FlashAttention-3 (Shah et al. 2024) splits the work between warps instead, and
Gluon (Triton's lower-level language: explicit layouts, shared memory, barriers and
warp partitions) lets us write that schedule ourselves:

- a **producer** warp issues TMA copies: Q once, then K and V tiles into a ring of
  `STAGES` shared-memory slots. Each slot has a "ready" barrier per tensor, which the
  copy completes, and an "empty" barrier the consumers arrive on when done with it;
- two **consumer** warpgroups (4 warps each) own 64 query rows each of the program's
  128. Per key tile: S = Q Kᵀ with an asynchronous wgmma from shared memory, the online
  softmax in the wgmma accumulator's own register layout (exp2, the scale folded in),
  P converted to bf16 in registers, and O += P V with P as the register operand. Step j
  issues S_j and O += P_{j-1} V_{j-1} back to back. Three schedules (`SCHEDULES`,
  measured side by side): "serial" waits for each product at once; "overlap" computes
  the softmax of S_j while the second product still runs (FA3's intra-warpgroup
  overlap); "pingpong" also makes the two warpgroups take turns issuing their products,
  so one's matmuls run under the other's softmax (FA3's inter-warpgroup ping-pong);
- registers are re-balanced between partitions (`worker_num_regs`): the producer needs
  24 per thread, the consumers take the rest.

Without the causal mask the kernel runs persistent: one program per SM takes the (row
block, head, batch) tiles p, p + P, p + 2P, ..., so one tile's epilogue and the next
tile's first loads overlap (+13% at S = 2048 and 4096 on the H200). Under the mask the
tiles' lengths differ, static shares balance badly (0.91x at S = 16384), and one
program per tile, which the hardware hands to whichever SM frees first, is faster
(`SCHEDULERS`, `forward(..., scheduler=)`). A third, "dynamic", keeps the program per
SM but hands tiles out in order as programs ask for them, through a global counter: the
hardware's balance with the persistent kernel's overlap (written for short causal
sequences).

The online softmax, the LSE it saves for the backward and the causal schedule (unmasked
tiles first, the diagonal tile masked, longest query blocks first) are the portable
kernel's; read its docstring first. The backward for Hopper is
`flash_attention_hopper_backward`; the portable backward takes (O, LSE) from either
forward too.

Scope: compute capability 9.x, bf16 or fp16, head dim 64, 128 or 256, S a multiple of 128,
and q, k, v whose rows can be addressed as one 2-D TMA view (`rows_view`: (B, H, S, D)
contiguous, the (B, S, H, D) transpose, or slices of a packed QKV). Anything else runs
the portable kernel (`unsupported` says why), which is also the teaching version.

Gluon has no interpreter: on a CPU this module only compiles its kernel for sm_90
ahead of time (tests), and it is never chosen.

References: J. Shah et al., "FlashAttention-3: Fast and Accurate Attention with
Asynchrony and Low-precision" (2024); Triton's Gluon tutorials (TMA, wgmma, warp
specialisation) for the API.
"""

from __future__ import annotations

import functools
import math

import torch

try:  # Gluon ships with Triton >= 3.5; an older Triton keeps the portable kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

HALF_M = 64
"""Query rows per consumer warpgroup; a program owns two of them (BLOCK_M = 128)."""
BLOCK_M = 2 * HALF_M
BLOCK_N = 128
"""Key rows per step (`block_n`: 64 at head dim 256)."""
STAGES = 2
"""K/V tiles in flight by default (shared memory: 2 x 2 x 128 x 128 x 2 B = 128 KiB at
D = 128)."""
STAGE_CHOICES = (2, 3, 4)
"""`forward(stages=...)`: K/V slots. More let the load warp run further ahead (at a
tile's start: the next tile's first key tiles) where shared memory has room
(`shared_bytes`): at D = 128 with 128 keys a step, three slots (192 KiB) leave room for
one 32 KiB Q buffer only, 224 of the 227 KiB a program may have, so the persistent
schedulers lose their second Q buffer (`q_buffers`); with 64 keys a step four fit
beside two Q buffers; at D = 256 two are all there is room for."""
KEYS_CHOICES = (64, 128)
"""`forward(keys_per_step=...)`: key rows per step (default `block_n`). 64 halves the
key tile: twice the steps, but a tile's first S arrives sooner and the causal diagonal
wastes half as much (D = 256 takes 64 only)."""
SHARED_LIMIT = 227 * 1024 - 1024
"""Bytes of Q and K/V buffers a program may have: the H200's 227 KiB per block, less
1 KiB for the barriers and the tile slot (ptxas reports about 600 B of them)."""
HEAD_DIMS = (64, 128, 256)
"""Head dims of the forward. At 256 it steps 64 keys at a time (`block_n`; one Q buffer,
192 KiB of shared memory in all); compiled for sm_90a with 80 B of spills, and chosen
by a rule only where the H200 probes found it ahead of the portable forward."""
BACKWARD_HEAD_DIMS = (64, 128, 256)
"""Head dims of the backward (`flash_attention_hopper_backward`; at 256 its warpgroups
split the head dim instead of the keys)."""
SCHEDULES = ("serial", "overlap", "pingpong")
"""How a consumer warpgroup orders its work (`_consume`): "serial" waits for each
matmul at once; "overlap" computes the softmax of S_j while P_{j-1} V_{j-1} runs;
"pingpong" adds turns between the two warpgroups."""
DEFAULT_SCHEDULE = "serial"
"""Fastest or level at every D = 128 shape of the H200 probes (event-timed, same process);
in the sweep's graph replay at the canonical point the three
schedules are level within the p10-p90 spread (about 10%). The two warpgroups seem to
interleave their softmax and matmuls well enough without being told."""
EPILOGUES = ("registers", "tma")
"""How O leaves a consumer warpgroup: "registers", `gl.store` straight from the wgmma
accumulator layout (each thread writes 4-byte pieces, so every 32-byte sector is
half-filled: Nsight Compute counted 4.2 M excess sectors, 50% of the kernel's, at B16 H32
S1024 D128 causal on the H200); or "tma", through the warpgroup's half of the Q buffer
(Q is no longer needed once the tile's last S is done) and one TMA store per 64 rows,
as FlashAttention-3 does. "tma" needs O with a 2-D TMA view (`rows_view`); the Q buffer
is then released after the store instead of before the last P V."""
DEFAULT_EPILOGUE = "registers"
"""On the H200 "tma" lifts the ping-pong schedule (0.85 -> 0.90 of cuDNN at S 2048 GQA-8
causal, 0.79 -> 0.87 at S 1024 full), where the rules' plans already meet the target, but
not the short causal forward; the plans that want it name it (`SHORT_CAUSAL`)."""
CONSUMER_REGS = 240
PRODUCER_REGS = 24
SCHEDULERS = ("grid", "static", "dynamic")
"""Which program takes which (row block, head, batch) tile: "grid", one program per
tile, handed out by the hardware as SMs free up; "static", persistent, one program per
SM taking tiles p, p + P, ...; "dynamic", persistent, each program asking a global
counter for the next tile when it starts one (its load warp asks, and passes the id to
the consumers through shared memory). All three give bit-equal outputs on the H200
(GPU test); "dynamic" is the choice of `flash_attention.AUTO_FORWARD`'s causal plans up
to S = 2048, not a default here."""


def shared_bytes(head_dim: int, keys: int, stages: int, q_bufs: int) -> int:
    """Bytes of a program's Q buffers (two 64-row halves each) and K/V ring, 16-bit."""
    return 2 * (q_bufs * 2 * HALF_M * head_dim + stages * 2 * keys * head_dim)


def q_buffers(scheduler: str, head_dim: int = 128, stages: int = STAGES,
              keys: int | None = None) -> int:
    """Q tiles in shared memory: two for a persistent program where they fit
    (`SHARED_LIMIT`; the load warp fetches the next tile's Q while the consumers finish
    this one: 32 KiB more, 192 KiB in all at D = 128 with two slots), else one, and one
    where each program takes one tile."""
    keys = keys or block_n(head_dim)
    if scheduler == "grid" or shared_bytes(head_dim, keys, stages, 2) > SHARED_LIMIT:
        return 1
    return 2


def block_n(head_dim: int) -> int:
    """Key rows per step: `BLOCK_N`, halved at head dim 256 (the O accumulator takes
    128 registers per thread there, and K/V tiles twice the shared memory)."""
    return BLOCK_N if head_dim <= 128 else BLOCK_N // 2


def default_scheduler(causal: bool) -> str:
    """Measured on the H200: "static" without the causal mask
    (+13% over "grid" at S 2048 and 4096), "grid" with it (static shares of unequal
    tiles balance badly: 0.91x at S 16384)."""
    return "grid" if causal else "static"


if HAVE_GLUON:

    # a barrier among the warps of one partition: `thread_barrier` in Triton 3.6,
    # renamed `barrier` in 3.7
    sync_partition = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.constexpr_function
    def wgmma_layout(n):
        """The register layout of a 64 x n wgmma accumulator of one 4-warp warpgroup."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, n, 16])

    @gluon.jit
    def ring_load(desc, row, col, ready, empty, phase, dst):
        """Producer side of a ring slot: wait until the consumers have released it
        (`empty` completes `phase`), then TMA-copy the (row, col) block of desc into
        dst; `ready` completes when the bytes have landed."""
        mbarrier.wait(empty, phase)
        mbarrier.expect(ready, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, col], ready, dst)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, rows, j, qk_scale, s_layout: gl.constexpr,
                      BLOCK_N: gl.constexpr, MASKED: gl.constexpr):
        """The online softmax of one score tile: P (unnormalised, base 2), the new
        running max and sum, and alpha, the factor that rescales what O holds."""
        if MASKED:  # the diagonal tile: keys after the query get -inf
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0)
            s = gl.where(keep, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            s = s - gl.expand_dims(m_new, 1)
        else:  # scale after the max: one FMA per score
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            s = s * qk_scale - gl.expand_dims(m_new, 1)
        p = gl.exp2(s)
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _consume(q, k_smem, v_smem, bars, acc, p, l_i, m_i, rows, lo, hi, c0, tn0,
                 qk_scale,
                 s_layout: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                 SCHEDULE: gl.constexpr, WG: gl.constexpr):
        """Key tiles [lo, hi), lo >= 1, for one warpgroup's 64 rows; key tile j sits at
        position c0 + j of the K/V ring (the program's count over all its tiles), which
        picks its slot and barrier phases; tn0 counts the turns taken before the tile's
        step 1 (SCHEDULE 2). Step j issues
        S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} back to back. SCHEDULE 0 waits for each
        product at once; 1 runs the softmax of S_j while the second product is still on
        the tensor cores (FlashAttention-3's intra-warpgroup pipelining); 2 also makes
        the two warpgroups take turns issuing their products (FA3's ping-pong): each
        waits for its turn, issues, and hands the turn over, so one's products run
        while the other computes its softmax."""
        k_ready, v_ready, k_empty, v_empty, turn = bars
        HALF: gl.constexpr = q.shape[0]
        s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        for j in range(lo, hi):
            c = c0 + j
            slot = c % STAGES
            prev = (c - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
            p_op = gl.convert_layout(p.to(q.dtype), p_layout)
            mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
            if SCHEDULE == 2:  # warpgroup 0 goes first: its first wait is on a fresh
                # barrier's completed phase
                mbarrier.wait(turn.index(WG), ((tn0 + j - 1) & 1) ^ (1 - WG))
            s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            if SCHEDULE == 0:
                s_tok = warpgroup_mma_wait(0, deps=(s_tok,))
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            if SCHEDULE == 2:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            if SCHEDULE != 0:
                s = warpgroup_mma_wait(1, deps=(s_tok,))  # S_j done; P V still running
            else:
                s = s_tok
                o_tok, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(k_empty.index(slot), count=1)  # K_j read: its slot is free
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, j, qk_scale, s_layout,
                                               BLOCK_N, MASKED)
            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        return acc, p, l_i, m_i

    @gluon.jit
    def _fwd_tile(tile, n_m, H_Q, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, seq_len):
        """Work tile -> (first row m0, query head, batch, key tiles without a mask, key
        tiles in all). Row blocks vary fastest, so the programs running together share
        a few heads' K and V in L2; causal row blocks run longest first."""
        if CAUSAL:
            m0 = (n_m - 1 - tile % n_m) * BLOCK_M
            n_unmasked = m0 // BLOCK_N
            n_blocks = (m0 + BLOCK_M) // BLOCK_N
        else:
            m0 = (tile % n_m) * BLOCK_M
            n_unmasked = seq_len // BLOCK_N
            n_blocks = n_unmasked
        bh = tile // n_m
        return m0, bh % H_Q, (bh // H_Q).to(gl.int64), n_unmasked, n_blocks

    @gluon.jit
    def _consume_tile(tile, c0, tn, it, q_smem, k_smem, v_smem, q_ready, q_empty, kv_bars,
                      o_ptr, o_desc, lse_ptr, o_sb, o_sh, o_ss, H_Q, seq_len, qk_scale,
                      WG: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                      SCHEDULE: gl.constexpr, O_TMA: gl.constexpr,
                      DIAG_SKIP: gl.constexpr):
        """One consumer warpgroup's share of one tile: rows [m0 + 64·WG, m0 + 64·WG + 64).
        c0: the K/V ring position of its first key tile, tn: the turns taken so far, it:
        the tiles taken so far (which Q buffer, and its barrier phase). Returns the new
        (c0, tn). O leaves from registers (`gl.store`), or with O_TMA through the
        warpgroup's half of the tile's Q buffer (free once the last S is done) and a TMA
        store (`EPILOGUES`). With DIAG_SKIP (causal, 64 keys a step) warpgroup 0 leaves
        out the tile's last key tile, all of it after its rows (`forward(diag_skip=...)`),
        and only releases its ring slot, after its epilogue."""
        k_ready, v_ready, k_empty, v_empty, turn = kv_bars
        Q_BUFS: gl.constexpr = q_ready.shape[0]
        qb = it % Q_BUFS
        q = q_smem.index(qb * 2 + WG)
        HALF: gl.constexpr = q_smem.shape[1]
        BLOCK_M: gl.constexpr = 2 * HALF
        s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        m0, h, b, n_unmasked, n_blocks = _fwd_tile(tile, seq_len // BLOCK_M, H_Q, GROUP,
                                                   CAUSAL, BLOCK_M, BLOCK_N, seq_len)
        # the key tiles this warpgroup computes: warpgroup 0's rows end HALF = BLOCK_N
        # keys before the tile's last key tile starts, so all of that tile is masked
        SKIP: gl.constexpr = DIAG_SKIP and CAUSAL and WG == 0 and BLOCK_N == HALF
        n_mine = n_blocks - 1 if SKIP else n_blocks
        rows = m0 + WG * HALF + gl.arange(0, HALF, layout=s_rows)
        m_i = gl.full([HALF], float("-inf"), gl.float32, s_rows)
        l_i = gl.zeros([HALF], gl.float32, s_rows)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_ready.index(qb), (it // Q_BUFS) & 1)
        # key tile 0 alone: its product S_0 has no P V before it to overlap with
        mbarrier.wait(k_ready.index(c0 % STAGES), (c0 // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(c0 % STAGES).permute((1, 0)),
                          gl.zeros([HALF, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(c0 % STAGES), count=1)
        if CAUSAL:
            if n_unmasked == 0:  # the first query block: tile 0 is its diagonal
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, qk_scale,
                                                   s_layout, BLOCK_N, True)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, qk_scale,
                                                   s_layout, BLOCK_N, False)
        else:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, qk_scale, s_layout,
                                               BLOCK_N, False)
        acc, p, l_i, m_i = _consume(q, k_smem, v_smem, kv_bars, acc, p, l_i, m_i, rows, 1,
                                    n_unmasked, c0, tn, qk_scale, s_layout, p_layout,
                                    o_rows, BLOCK_N, STAGES, False, SCHEDULE, WG)
        if CAUSAL:
            acc, p, l_i, m_i = _consume(q, k_smem, v_smem, kv_bars, acc, p, l_i, m_i, rows,
                                        gl.maximum(n_unmasked, 1), n_mine, c0, tn,
                                        qk_scale, s_layout, p_layout, o_rows, BLOCK_N,
                                        STAGES, True, SCHEDULE, WG)
        if not O_TMA:
            mbarrier.arrive(q_empty.index(qb), count=1)  # every S of the tile done: Q free
        # the last P V
        last = c0 + n_mine - 1
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        lse_base = (b * H_Q + h) * seq_len
        gl.store(lse_ptr + lse_base + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453)
        acc = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
        o_base = b * o_sb + h.to(gl.int64) * o_sh
        if O_TMA:  # stage O in this warpgroup's Q half, then one TMA store of 64 rows
            q.store(acc.to(o_desc.dtype))
            fence_async_shared()
            sync_partition()  # every warp's part is in shared memory
            tma.async_copy_shared_to_global(
                o_desc, [(o_base // o_ss).to(gl.int32) + m0 + WG * HALF,
                         (o_base % o_ss).to(gl.int32)], q)
            tma.store_wait(0)  # (the issuing thread) the store has read the buffer
            sync_partition()  # ... and the warp that arrives knows it
            mbarrier.arrive(q_empty.index(qb), count=1)  # the Q buffer is free
        else:
            o_r = m0 + WG * HALF + gl.arange(0, HALF, layout=o_rows)
            o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            o_ptrs = (o_ptr + o_base + gl.expand_dims(o_r.to(gl.int64) * o_ss, 1)
                      + gl.expand_dims(o_d, 0))
            gl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty))
        if SKIP:  # the skipped key tile's slot: released once loaded (its phase is
            # this use's only then: waiting first keeps the count of arrivals right)
            sk = c0 + n_blocks - 1
            mbarrier.wait(k_ready.index(sk % STAGES), (sk // STAGES) & 1)
            mbarrier.arrive(k_empty.index(sk % STAGES), count=1)
            mbarrier.wait(v_ready.index(sk % STAGES), (sk // STAGES) & 1)
            mbarrier.arrive(v_empty.index(sk % STAGES), count=1)
        return c0 + n_blocks, tn + n_blocks - 1  # steps 1 .. n_blocks - 1 took a turn each

    @gluon.jit
    def _receive_tile(tile_smem, tile_ready, tile_empty, it):
        """(DYNAMIC) The tile id the load warp published for this program's tile `it`."""
        slot = it % 2
        mbarrier.wait(tile_ready.index(slot), (it // 2) & 1)
        tile = gl.max(tile_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
        sync_partition()  # every warp has read the slot before it is handed back
        mbarrier.arrive(tile_empty.index(slot), count=1)
        return tile

    @gluon.jit
    def _publish_tile(tile_smem, tile_ready, tile_empty, it, tile):
        """(DYNAMIC) Hand the consumers the id of this program's tile `it` (n_tiles:
        no more)."""
        slot = it % 2
        mbarrier.wait(tile_empty.index(slot), ((it // 2) & 1) ^ 1)
        tile_smem.index(slot).store(gl.full([1], tile, gl.int32,
                                            gl.BlockedLayout([1], [32], [1], [0])))
        sync_partition()
        mbarrier.arrive(tile_ready.index(slot), count=1)

    @gluon.jit
    def _consumer(smem, bars, descs, ptrs, strides, dims, qk_scale, WG: gl.constexpr,
                  GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                  DYNAMIC: gl.constexpr, O_TMA: gl.constexpr, DIAG_SKIP: gl.constexpr):
        """One consumer warpgroup: its 64 rows of each tile the program takes."""
        o_desc = descs[3]
        q_smem, k_smem, v_smem, tile_smem = smem
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, tile_ready, \
            tile_empty = bars
        kv_bars = (k_ready, v_ready, k_empty, v_empty, turn)
        o_ptr, lse_ptr, counter_ptr = ptrs
        o_sb, o_sh, o_ss = strides[9], strides[10], strides[11]
        H_Q, seq_len, n_tiles = dims
        c0 = 0  # K/V ring position of the tile's first key tile
        tn = 0  # turns taken (SCHEDULE 2)
        it = 0  # tiles taken
        if DYNAMIC:
            tile = _receive_tile(tile_smem, tile_ready, tile_empty, it)
            while tile < n_tiles:
                c0, tn = _consume_tile(tile, c0, tn, it, q_smem, k_smem, v_smem, q_ready,
                                       q_empty, kv_bars, o_ptr, o_desc, lse_ptr, o_sb,
                                       o_sh, o_ss, H_Q, seq_len, qk_scale, WG, GROUP,
                                       HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHEDULE, O_TMA,
                                       DIAG_SKIP)
                it += 1
                tile = _receive_tile(tile_smem, tile_ready, tile_empty, it)
        else:
            for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
                c0, tn = _consume_tile(tile, c0, tn, it, q_smem, k_smem, v_smem, q_ready,
                                       q_empty, kv_bars, o_ptr, o_desc, lse_ptr, o_sb,
                                       o_sh, o_ss, H_Q, seq_len, qk_scale, WG, GROUP,
                                       HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHEDULE, O_TMA,
                                       DIAG_SKIP)
                it += 1

    @gluon.jit
    def _produce_tile(tile, c, it, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
                      q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, q_sb, q_sh,
                      q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, H_Q, seq_len,
                      GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr):
        """The load warp's part of one tile: Q's two halves, into the Q buffer the
        consumers finished with Q_BUFS tiles ago, then K and V tile by tile, each into
        its ring slot as soon as the consumers have released it. c: the K/V ring
        position; returns the new."""
        HALF: gl.constexpr = q_smem.shape[1]
        BLOCK_M: gl.constexpr = 2 * HALF
        Q_BUFS: gl.constexpr = q_ready.shape[0]
        m0, h, b, n_unmasked, n_blocks = _fwd_tile(tile, seq_len // BLOCK_M, H_Q, GROUP,
                                                   CAUSAL, BLOCK_M, BLOCK_N, seq_len)
        hkv = (h // GROUP).to(gl.int64)
        q_off = b * q_sb + h.to(gl.int64) * q_sh
        k_off = b * k_sb + hkv * k_sh
        v_off = b * v_sb + hkv * v_sh
        q_row, q_col = (q_off // q_ss).to(gl.int32) + m0, (q_off % q_ss).to(gl.int32)
        k_row, k_col = (k_off // k_ss).to(gl.int32), (k_off % k_ss).to(gl.int32)
        v_row, v_col = (v_off // v_ss).to(gl.int32), (v_off % v_ss).to(gl.int32)
        qb = it % Q_BUFS
        # a fresh barrier: phase 1 counts as complete
        mbarrier.wait(q_empty.index(qb), ((it // Q_BUFS) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_ready.index(qb),
                                        q_smem.index(2 * qb))
        tma.async_copy_global_to_shared(q_desc, [q_row + HALF, q_col], q_ready.index(qb),
                                        q_smem.index(2 * qb + 1))
        for j in range(n_blocks):
            slot = c % STAGES
            phase = ((c // STAGES) & 1) ^ 1
            ring_load(k_desc, k_row + j * BLOCK_N, k_col, k_ready.index(slot),
                      k_empty.index(slot), phase, k_smem.index(slot))
            ring_load(v_desc, v_row + j * BLOCK_N, v_col, v_ready.index(slot),
                      v_empty.index(slot), phase, v_smem.index(slot))
            c += 1
        return c

    @gluon.jit
    def _producer(smem, bars, descs, ptrs, strides, dims, qk_scale, WG: gl.constexpr,
                  GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                  DYNAMIC: gl.constexpr, O_TMA: gl.constexpr, DIAG_SKIP: gl.constexpr):
        """The load warp (the consumers' signature). With DYNAMIC it also fetches the
        program's next tile from a global counter (the next tile nobody has taken) and
        publishes each tile's id to the consumers; otherwise tiles p, p + P, ..."""
        q_smem, k_smem, v_smem, tile_smem = smem
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, tile_ready, \
            tile_empty = bars
        q_desc, k_desc, v_desc = descs[0], descs[1], descs[2]
        counter_ptr = ptrs[2]
        q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss = (
            strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
            strides[6], strides[7], strides[8])
        H_Q, seq_len, n_tiles = dims
        c = 0  # K/V ring position
        it = 0
        if DYNAMIC:
            tile = gl.program_id(0)  # the first P tiles go one to each program
            while tile < n_tiles:
                _publish_tile(tile_smem, tile_ready, tile_empty, it, tile)
                nxt = gl.atomic_add(counter_ptr, 1) + gl.num_programs(0)
                c = _produce_tile(tile, c, it, q_desc, k_desc, v_desc, q_smem, k_smem,
                                  v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                                  v_empty, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh,
                                  v_ss, H_Q, seq_len, GROUP, BLOCK_N, STAGES, CAUSAL)
                tile = nxt
                it += 1
            _publish_tile(tile_smem, tile_ready, tile_empty, it, n_tiles)  # no more
        else:
            for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
                c = _produce_tile(tile, c, it, q_desc, k_desc, v_desc, q_smem, k_smem,
                                  v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                                  v_empty, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh,
                                  v_ss, H_Q, seq_len, GROUP, BLOCK_N, STAGES, CAUSAL)
                it += 1

    @gluon.jit
    def _attn_fwd_hopper_kernel(
        q_desc, k_desc, v_desc,  # 2-D TMA views (`rows_view`): blocks (64, D), (128, D)
        o_desc,  # (O_TMA) O's 2-D TMA view, blocks (64, D); otherwise unused (q_desc)
        o_ptr, lse_ptr,  # O (B, Hq, S, D) any strides; LSE (B, Hq, S) fp32 contiguous
        counter_ptr,  # (DYNAMIC) one int32, zero: how many tiles have been handed out
        q_sb, q_sh, q_ss,  # strides of q (elements): its rows live at (off // q_ss, off % q_ss)
        k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss,
        H_Q, seq_len, n_tiles, qk_scale,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCHEDULE: gl.constexpr,
        DYNAMIC: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        Q_BUFS: gl.constexpr, O_TMA: gl.constexpr, DIAG_SKIP: gl.constexpr,
    ):
        """Program p takes tiles p, p + P, p + 2P, ... of the n_tiles (one each when the
        grid has n_tiles programs; a persistent share when it has one per SM), or, with
        DYNAMIC, p first and then whichever tile is next when it asks (`SCHEDULERS`)."""
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * Q_BUFS, HALF, HEAD_DIM],
                                           q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM],
                                           k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM],
                                           v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        if DYNAMIC:
            for i in gl.static_range(2):
                mbarrier.init(tile_ready.index(i), count=1)
                mbarrier.init(tile_empty.index(i), count=2)  # both consumers read it
        for i in gl.static_range(Q_BUFS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumers done with it
        mbarrier.init(turn.index(0), count=1)  # (SCHEDULE 2) warpgroup 0 may issue
        mbarrier.init(turn.index(1), count=1)  # ... warpgroup 1 may issue
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
            mbarrier.init(v_empty.index(i), count=2)

        smem = (q_smem, k_smem, v_smem, tile_smem)
        bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, tile_ready,
                tile_empty)
        descs = (q_desc, k_desc, v_desc, o_desc)
        ptrs = (o_ptr, lse_ptr, counter_ptr)
        strides = (q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss)
        dims = (H_Q, seq_len, n_tiles)
        # (worker partitions share one signature; tuples are spelled out, since
        # concatenating them would turn the constexprs into runtime values)
        gl.warp_specialize([
            (_consumer, (smem, bars, descs, ptrs, strides, dims, qk_scale, 0, GROUP,
                         HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHEDULE, DYNAMIC, O_TMA,
                         DIAG_SKIP)),
            (_consumer, (smem, bars, descs, ptrs, strides, dims, qk_scale, 1, GROUP,
                         HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHEDULE, DYNAMIC, O_TMA,
                         DIAG_SKIP)),
            (_producer, (smem, bars, descs, ptrs, strides, dims, qk_scale, 0, GROUP,
                         HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHEDULE, DYNAMIC, O_TMA,
                         DIAG_SKIP))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device: the persistent kernels' grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """t (B, H, S, D) as one 2-D view (rows, cols) with row stride ss whose rows are
    t's sequence rows, and ss; or None. Head (b, h) starts at element b·sb + h·sh, i.e.
    at row (b·sb + h·sh) // ss and column (b·sb + h·sh) % ss of the view. That works
    when D is contiguous, the batch stride is whole rows, each head's D columns fit in
    one view row (heads whole rows apart, as in (B, H, S, D), or side by side within a
    row, as in the (B, S, H, D) transpose and slices of a packed QKV), and the strides
    and the base are 16-byte aligned (TMA). The view is only as wide as the columns the
    heads use, so a slice of a wider buffer does not reach past its storage."""
    b, h, s, d = t.shape
    sb, sh, ss, sd = t.stride()
    e = t.element_size()
    if sd != 1 or ss < d or (ss * e) % 16 or t.data_ptr() % 16 or (b > 1 and sb % ss):
        return None
    if h == 1 or sh % ss == 0:
        cols = d  # each head starts on a row of its own
    elif (h - 1) * sh + d <= ss:
        cols = (h - 1) * sh + d
    else:
        return None
    rows = ((b - 1) * sb + (h - 1) * sh) // ss + s
    try:
        return t.as_strided((rows, cols), (ss, 1)), ss
    except RuntimeError:  # the view would run past the storage
        return None


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                which: str = "forward") -> str | None:
    """Why the Hopper kernel of pass `which` ("forward" or "backward") cannot take
    (q, k, v), or None when it can. (The caller has already checked what every backend
    checks: `flash_attention.check_shapes`.)"""
    dims = HEAD_DIMS if which == "forward" else BACKWARD_HEAD_DIMS
    if not HAVE_GLUON:
        return "this Triton has no Gluon"
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "not a Hopper GPU (compute capability 9.x)"
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return f"dtype {q.dtype}: bf16 or fp16 only"
    if q.shape[3] not in dims:
        return f"head_dim {q.shape[3]} not in {dims} (the Hopper {which})"
    if q.shape[2] % BLOCK_M or k.shape[2] != q.shape[2]:
        return f"S={q.shape[2]} is not a multiple of {BLOCK_M}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if rows_view(t) is None:
            return f"{name} with strides {t.stride()} has no 2-D TMA view"
    return None


def diag_skip_applies(causal: bool, keys_per_step: int, schedule: str) -> bool:
    """Whether warpgroup 0's diagonal skip (`forward(diag_skip=True)`) applies: causal,
    64 (`HALF_M`) keys a step, so that the tile's last key tile lies wholly after
    warpgroup 0's rows, and not "pingpong", whose turns count every step."""
    return bool(causal) and keys_per_step == HALF_M and schedule != "pingpong"


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            sm_scale: float, o: torch.Tensor, lse: torch.Tensor, *,
            schedule: str = DEFAULT_SCHEDULE, scheduler: str | None = None,
            epilogue: str = DEFAULT_EPILOGUE, stages: int = STAGES,
            keys_per_step: int | None = None, diag_skip: bool = False) -> None:
    """Fill o (B, Hq, S, D), any strides but a contiguous last dimension, and lse
    (B, Hq, S, fp32, contiguous) for inputs that `unsupported` accepted, with one of
    `SCHEDULES` (what each step buys is measured by running them side by side) and one
    of `SCHEDULERS` (default `default_scheduler(causal)`), one of `EPILOGUES` ("tma"
    where o has q's dtype and a 2-D TMA view, else "registers"), K/V slots from
    `STAGE_CHOICES` and keys per step from `KEYS_CHOICES` (default `block_n`), as far
    as shared memory holds them (`shared_bytes`). `diag_skip` (causal, 64 keys a step,
    not "pingpong"): warpgroup 0 leaves out each tile's last key tile, which its rows
    never see (`DIAG_SKIP`)."""
    d = q.shape[3]
    bn = keys_per_step or block_n(d)
    if stages not in STAGE_CHOICES:
        raise ValueError(f"stages={stages!r}; choose from {STAGE_CHOICES}")
    if bn not in KEYS_CHOICES or bn > block_n(d):
        raise ValueError(f"keys_per_step={keys_per_step!r}; choose from "
                         f"{tuple(n for n in KEYS_CHOICES if n <= block_n(d))} at "
                         f"head_dim {d}")
    if shared_bytes(d, bn, stages, 1) > SHARED_LIMIT:
        raise ValueError(f"stages={stages} with {bn} keys a step at head_dim {d} needs "
                         f"{shared_bytes(d, bn, stages, 1) // 1024} KiB of shared "
                         f"memory, more than the {SHARED_LIMIT // 1024} KiB there is")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; choose from {SCHEDULES}")
    if diag_skip and not diag_skip_applies(True, bn, schedule):
        raise ValueError(f"diag_skip needs {HALF_M} keys a step (here {bn}) and a schedule "
                         f"other than 'pingpong', whose turns count every step (here "
                         f"{schedule!r})")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r}; choose from {EPILOGUES}")
    scheduler = scheduler or default_scheduler(causal)
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r}; choose from {SCHEDULERS}")
    if o.shape != q.shape or o.stride(3) != 1 or not lse.is_contiguous():
        raise ValueError("o must have q's shape and a contiguous last dimension, lse "
                         "must be contiguous")
    b, hq, s, d = q.shape
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = []
    for t, block in ((q, HALF_M), (k, bn), (v, bn)):
        view, stride = rows_view(t)
        layout = gl.NVMMASharedLayout.get_default_for([block, d], gl_dtype)
        descs.append(TensorDescriptor(view, list(view.shape), [stride, 1], [block, d],
                                      layout))
    # (the staging buffer is Q's: same dtype and shared-memory layout)
    o_view = rows_view(o) if epilogue == "tma" and o.dtype == q.dtype else None
    if o_view is not None:
        view, stride = o_view
        descs.append(TensorDescriptor(view, list(view.shape), [stride, 1], [HALF_M, d],
                                      descs[0].layout))
    else:
        descs.append(descs[0])  # (unused)
    n_tiles = s // BLOCK_M * hq * b
    grid = (n_tiles if scheduler == "grid" else min(n_tiles, sm_count(q.device)),)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) \
        if scheduler == "dynamic" else lse  # (unused: any pointer)
    _attn_fwd_hopper_kernel[grid](
        *descs, o, lse, counter, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *o.stride()[:3], hq, s, n_tiles, sm_scale * math.log2(math.e),
        GROUP=hq // k.shape[1], HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_N=bn,
        STAGES=stages, SCHEDULE=SCHEDULES.index(schedule),
        DYNAMIC=scheduler == "dynamic", CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, Q_BUFS=q_buffers(scheduler, d, stages, bn),
        O_TMA=o_view is not None, DIAG_SKIP=bool(diag_skip and causal), num_warps=4)


def aot_arguments(head_dim: int, causal: bool, schedule: str = DEFAULT_SCHEDULE,
                  dynamic: bool = False, epilogue: str = DEFAULT_EPILOGUE,
                  stages: int = STAGES, keys_per_step: int | None = None,
                  diag_skip: bool = False) -> tuple:
    """(kernel, signature, constexprs) to compile the forward for sm_90 without a GPU
    (`sm90_compile.compile_sm90`), for bf16 inputs of one head dim."""
    from triton.runtime.jit import mangle_type

    q = torch.empty(1, 2, 2 * BLOCK_M, head_dim, dtype=torch.bfloat16)
    kern = _attn_fwd_hopper_kernel
    sig = {}
    bn = keys_per_step or block_n(head_dim)
    for name, block in zip(kern.arg_names[:4], (HALF_M, bn, bn, HALF_M)):
        view, ss = rows_view(q)
        layout = gl.NVMMASharedLayout.get_default_for([block, head_dim], gl.bfloat16)
        sig[name] = mangle_type(TensorDescriptor(view, list(view.shape), [ss, 1],
                                                 [block, head_dim], layout))
    sig.update(o_ptr="*bf16", lse_ptr="*fp32", counter_ptr="*i32")
    for name in kern.arg_names[7:23]:
        sig[name] = "i64" if name.endswith(("sb", "sh", "ss")) else "i32"
    sig["qk_scale"] = "fp32"
    consts = dict(GROUP=1, HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_N=bn,
                  STAGES=stages, SCHEDULE=SCHEDULES.index(schedule), DYNAMIC=dynamic,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  Q_BUFS=q_buffers("dynamic" if dynamic else "grid", head_dim, stages, bn),
                  O_TMA=epilogue == "tma", DIAG_SKIP=bool(diag_skip and causal))
    return kern, sig, consts
