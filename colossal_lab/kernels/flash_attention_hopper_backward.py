"""FlashAttention backward for Hopper (sm_90) in Gluon: one pass, dQ through TMA reductions.

The portable backward (`flash_attention.py`) runs two kernels, dK/dV and then dQ, and
recomputes P and dP in both: 7 matmuls where the mathematics needs 5. Its one-pass
variant (dq_mode="atomic") lost on the H200 because Triton's compiler gives every warp
every job: loads, five products, exponentials and atomics in turn, one 8-warp program
per SM. This kernel splits the jobs between warps, FlashAttention-3's way:

- one program owns 128 keys of one (batch, key/value head): K and V stay in shared
  memory, and dK, dV accumulate in registers, 64 key rows per consumer warpgroup;
- a **producer** warp streams the query side with TMA, 64 query rows a step: Q and dO
  into a ring of `STAGES` slots ("ready" barriers the copies complete, "empty" ones
  the consumers release). For grouped-query attention it walks over the query heads of
  the group, so dK and dV are complete when stored;
- two **consumer** warpgroups, per step (Sᵀ, not S, so that Pᵀ and dSᵀ come out of the
  products as the register operands the next products need)::

      Sᵀ  = K_h Qᵀ                   (64 keys x 64 queries, async wgmma from shared memory)
      dPᵀ = V_h dOᵀ                  (issued right behind Sᵀ)
      Pᵀ  = exp2(Sᵀ · scale·log2 e - LSE₂)     while dPᵀ is still on the tensor cores
      dV_h += Pᵀ dO                  (Pᵀ from registers)
      dSᵀ = Pᵀ ∘ (dPᵀ - Δ) · scale
      dK_h += dSᵀ Q                  (dSᵀ from registers)
      dSᵀ -> shared memory; both halves there -> dQ += dS K

  At head dim 128 each warpgroup forms half of dQ's columns from all 128 keys (64 x 64
  fp32 in registers); at head dim 64 the warpgroups take turns forming the whole of it.
  The warpgroup writes its dQ tile to shared memory and one thread issues a TMA
  reduction (`cp.reduce.async.bulk.tensor ... .add.f32`) into an fp32 buffer: the adds
  happen in L2, with no per-element atomics and no address registers; the launcher
  converts the buffer to the input dtype at the end. 5 matmuls; the sums' order, and so
  dQ's last bits, change from run to run (dK and dV do not).
- the row statistics (LSE in base 2, Δ) of each query block go to shared memory with
  the block (the load warp copies them), and the consumers read them just before use:
  held in registers for the whole step they cost 32 per thread, and spills.

One program per (key block, key/value head, batch), launched in that order, so the
programs running together share a few heads' Q and dO in L2 and the hardware hands
the next program to whichever SM frees first. A persistent version (one program per
SM over a strided share of the tiles) was measured and lost: static shares balance
badly under the causal mask (0.85x at S = 1024, 0.82x at 16k).

Registers per consumer thread: dK and dV 64 each, Sᵀ and dPᵀ 32 each, dQ 32; the
producer needs 24 (`worker_num_regs` re-balances them). Shared memory at head dim 128:
K and V 64 KiB, Q and dO 2 x 2 x 16 KiB, dSᵀ 2 x 16 KiB, the dQ tiles on their way out
2 x 16 KiB: 194 KiB, so one program per SM.

At head dim 256 dK and dV would take 128 registers each per consumer thread, so there
a program owns 64 keys and the warpgroups split the head dim instead: one forms Sᵀ and
Pᵀ, the other dPᵀ and dSᵀ, each hands its tile to the other through shared memory, and
each accumulates its 128 columns of dK and dV and adds its columns of dQ
(`_bwd256_steps`; FlashAttention-3 also takes 64 x 64 tiles and one dO slot there).

Scope: as the Hopper forward (`flash_attention_hopper.unsupported`), and dO with a TMA
view (the launcher copies it otherwise). Δ = rowsum(dO ∘ O) comes from the portable
kernel's pre-processing.

References: J. Shah et al., "FlashAttention-3" (2024), section 3 and its backward;
T. Dao, "FlashAttention-2" (2023), for the atomic dQ.
"""

from __future__ import annotations

import math

import torch

from colossal_lab.kernels import flash_attention_hopper as hopper

if hopper.HAVE_GLUON:
    from triton._C.libtriton import ir as _ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile src into the global tile at coord (TMA bulk
        reduction, `cp.reduce.async.bulk.tensor ... .add`). Gluon's Hopper `tma` module
        has the copies but not this; the op and its builder call exist (Triton 3.6 and
        3.7), so this wraps them as `tma.async_copy_shared_to_global` wraps the copy.
        Like the copy, one thread issues it; `tma.store_wait` waits for it to have read
        src."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                  tensor_desc.handle, coord, src.handle)

BLOCK_N = 128
"""Keys per program (two consumer warpgroups of 64)."""
HALF_N = BLOCK_N // 2
BLOCK_M = 64
"""Query rows per step."""
STAGES = 2
"""Q/dO tiles in flight."""
CONSUMER_REGS = 240
PRODUCER_REGS = 24
LOG2E = 1.4426950408889634

if hopper.HAVE_GLUON:

    @gluon.jit
    def _add_dq(dq, dq_desc, dq_buf, row, col):
        """dQ[row:row+64, col:col+n] += dq through shared memory and a TMA reduction."""
        tma.store_wait(0)  # the previous reduction has read the buffer (issuing thread)
        hopper.sync_partition()  # ... and everyone knows it
        dq_buf.store(dq)
        fence_async_shared()
        hopper.sync_partition()
        _tma_reduce_add(dq_desc, [row, col], dq_buf)

    @gluon.jit
    def _bwd_steps(t, lo, hi, k_h, v_h, k_dq, q_smem, do_smem, ds_smem, lse_smem,
                   delta_smem, bars, dk, dv, dq_desc, dq_buf, dq_row0, keys, qk_scale, sm_scale,
                   s_layout: gl.constexpr, a_layout: gl.constexpr,
                   dq_layout: gl.constexpr, DQ_COL0: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                   DQ_SPLIT: gl.constexpr, WG: gl.constexpr):
        """Query blocks [lo, hi) of one head, for one warpgroup's 64 keys; t counts the
        steps taken so far (it picks the ring slot and barrier phase)."""
        q_ready, do_ready, q_empty, do_empty, ds_ready = bars
        BM: gl.constexpr = q_smem.shape[1]
        HALF: gl.constexpr = k_h.shape[0]
        DQ_N: gl.constexpr = k_dq.shape[1]
        s_zero = gl.zeros([HALF, BM], gl.float32, s_layout)
        dq_zero = gl.zeros([BM, DQ_N], gl.float32, dq_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        for i in range(lo, hi):
            slot = t % STAGES
            phase = (t // STAGES) & 1
            q = q_smem.index(slot)
            do = do_smem.index(slot)
            mbarrier.wait(q_ready.index(slot), phase)
            s_tok = warpgroup_mma(k_h, q.permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            dp_tok = warpgroup_mma(v_h, do.permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # Sᵀ done, dPᵀ still running
            lse2 = lse_smem.index(slot).load(col_layout)  # this block's LSE · log2(e)
            if MASKED:  # a diagonal block: queries before the key get P = 0
                cols = i * BM + gl.arange(0, BM, layout=col_layout)
                keep = gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1)
                s = gl.where(keep, s * qk_scale - gl.expand_dims(lse2, 0), float("-inf"))
            else:
                s = s * qk_scale - gl.expand_dims(lse2, 0)
            p = gl.exp2(s)
            p_op = gl.convert_layout(p.to(q.dtype), a_layout)
            dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp_tok,))  # dPᵀ done, dV still running
            delta = delta_smem.index(slot).load(col_layout)
            ds = (p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(q.dtype)
            ds_op = gl.convert_layout(ds, a_layout)
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            # dSᵀ to shared memory; dQ = dS K needs both warpgroups' halves
            ds_slot = ds_smem.index(t % 2)
            ds_slot.slice(WG * HALF, HALF, dim=0).store(ds)
            fence_async_shared()
            hopper.sync_partition()
            mbarrier.arrive(ds_ready.index(t % 2), count=1)
            if DQ_SPLIT:  # each warpgroup forms half of dQ's columns
                mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
                dq_tok = warpgroup_mma(ds_slot.permute((1, 0)), k_dq, dq_zero,
                                       use_acc=False, is_async=True)
                dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(
                    0, deps=(dv_tok, dk_tok, dq_tok, p_op, ds_op))
                mbarrier.arrive(q_empty.index(slot), count=1)
                mbarrier.arrive(do_empty.index(slot), count=1)
                _add_dq(dq, dq_desc, dq_buf, dq_row0 + i * BM, DQ_COL0)
            else:
                dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op,
                                                                  ds_op))
                if t % 2 == WG:  # the warpgroups take turns forming all of dQ
                    mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
                    dq_tok = warpgroup_mma(ds_slot.permute((1, 0)), k_dq, dq_zero,
                                           use_acc=False, is_async=True)
                    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
                    mbarrier.arrive(q_empty.index(slot), count=1)
                    mbarrier.arrive(do_empty.index(slot), count=1)
                    _add_dq(dq, dq_desc, dq_buf, dq_row0 + i * BM, 0)
                else:
                    mbarrier.arrive(q_empty.index(slot), count=1)
                    mbarrier.arrive(do_empty.index(slot), count=1)
            t += 1
        return t, dk, dv

    @gluon.jit
    def _bwd_consumer(smem, bars, descs, heads, ptrs, strides, seq_len, n0, qk_scale,
                      sm_scale, WG: gl.constexpr, GROUP: gl.constexpr,
                      HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        """One consumer warpgroup: keys [n0 + 64·WG, n0 + 64·WG + 64)."""
        q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem = smem
        kv_bar, q_ready, do_ready, q_empty, do_empty, ds_ready = bars
        step_bars = (q_ready, do_ready, q_empty, do_empty, ds_ready)
        dq_desc = descs[4]
        dq_buf = dq_smem.index(WG)
        dk_ptr, dv_ptr = ptrs[2], ptrs[3]
        dk_ss, dv_ss = strides[0], strides[1]
        bh0, dk_base, dv_base = heads[4], heads[5], heads[6]  # (b, first query head)
        BM: gl.constexpr = q_smem.shape[1]
        HALF: gl.constexpr = k_smem.shape[0] // 2
        DQ_SPLIT: gl.constexpr = HEAD_DIM == 128
        DQ_N: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT else HEAD_DIM
        DQ_COL0: gl.constexpr = WG * DQ_N if DQ_SPLIT else 0
        s_layout: gl.constexpr = hopper.wgmma_layout(BM)
        kv_layout: gl.constexpr = hopper.wgmma_layout(HEAD_DIM)
        dq_layout: gl.constexpr = hopper.wgmma_layout(DQ_N)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout,
                                                     k_width=2)
        k_h = k_smem.slice(WG * HALF, HALF, dim=0)
        v_h = v_smem.slice(WG * HALF, HALF, dim=0)
        if DQ_SPLIT:
            k_dq = k_smem.slice(DQ_COL0, DQ_N, dim=1)
        else:
            k_dq = k_smem
        keys = n0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([HALF, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([HALF, HEAD_DIM], gl.float32, kv_layout)
        n_q = seq_len // BM
        if CAUSAL:
            lo = n0 // BM
            n_diag = (2 * HALF) // BM  # query blocks that cross the diagonal
        else:
            lo = 0
            n_diag = 0
        mbarrier.wait(kv_bar, 0)
        t = 0
        for g in range(GROUP):
            dq_row0 = ((bh0 + g) * seq_len).to(gl.int32)  # the head's first row of dQ
            if CAUSAL:
                t, dk, dv = _bwd_steps(t, lo, lo + n_diag, k_h, v_h, k_dq, q_smem,
                                       do_smem, ds_smem, lse_smem, delta_smem, step_bars,
                                       dk, dv, dq_desc, dq_buf, dq_row0, keys, qk_scale,
                                       sm_scale,
                                       s_layout, a_layout, dq_layout, DQ_COL0, HEAD_DIM,
                                       STAGES, True, DQ_SPLIT, WG)
            t, dk, dv = _bwd_steps(t, lo + n_diag, n_q, k_h, v_h, k_dq, q_smem, do_smem,
                                   ds_smem, lse_smem, delta_smem, step_bars, dk, dv,
                                   dq_desc, dq_buf, dq_row0, keys, qk_scale, sm_scale,
                                   s_layout,
                                   a_layout, dq_layout, DQ_COL0, HEAD_DIM, STAGES, False,
                                   DQ_SPLIT, WG)
        rows = n0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, kv_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        off = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(dk_ptr + dk_base + off * dk_ss + gl.expand_dims(d, 0),
                 dk.to(dk_ptr.dtype.element_ty))
        gl.store(dv_ptr + dv_base + off * dv_ss + gl.expand_dims(d, 0),
                 dv.to(dv_ptr.dtype.element_ty))
        tma.store_wait(0)  # the last dQ reduction has read its buffer

    @gluon.jit
    def _bwd_producer(smem, bars, descs, heads, ptrs, strides, seq_len, n0, qk_scale,
                      sm_scale, WG: gl.constexpr, GROUP: gl.constexpr,
                      HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        """The load warp: K and V once, then Q and dO block by block, each into its slot
        as soon as both consumers have released it (the consumers' signature)."""
        q_smem, do_smem, k_smem, v_smem = smem[0], smem[1], smem[2], smem[3]
        lse_smem, delta_smem = smem[5], smem[6]
        kv_bar, q_ready, do_ready, q_empty, do_empty = bars[0], bars[1], bars[2], \
            bars[3], bars[4]
        q_desc, do_desc, k_desc, v_desc, dq_desc = descs
        lse_ptr, delta_ptr = ptrs[0], ptrs[1]
        bh0 = heads[4]
        k_row, k_col, v_row, v_col = heads[0], heads[1], heads[2], heads[3]
        q_ss, do_ss = strides[2], strides[3]
        q_off, do_off = strides[4], strides[5]  # element offset of head (b, first_h)
        q_sh, do_sh = strides[6], strides[7]
        BM: gl.constexpr = q_smem.shape[1]
        Q_STAGES: gl.constexpr = q_smem.shape[0]
        DO_STAGES: gl.constexpr = do_smem.shape[0]  # one at head dim 256 (no room)
        stat_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
        stat_cols = gl.arange(0, BM, layout=stat_layout)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row, k_col], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [v_row, v_col], kv_bar, v_smem)
        n_q = seq_len // BM
        if CAUSAL:
            lo = n0 // BM
        else:
            lo = 0
        t = 0
        for g in range(GROUP):
            qo = q_off + g * q_sh
            dqo = do_off + g * do_sh
            q_row, q_col = (qo // q_ss).to(gl.int32), (qo % q_ss).to(gl.int32)
            do_row, do_col = (dqo // do_ss).to(gl.int32), (dqo % do_ss).to(gl.int32)
            stat_base = (bh0 + g) * seq_len
            for i in range(lo, n_q):
                slot = t % Q_STAGES
                phase = ((t // Q_STAGES) & 1) ^ 1  # a fresh barrier: phase 1 is complete
                mbarrier.wait(q_empty.index(slot), phase)
                # the block's LSE (base 2) and Δ into shared memory, where the consumers
                # read them when needed (as registers they would hold 32 of each
                # thread's registers for the whole step)
                rows = stat_base + i * BM + stat_cols
                lse_smem.index(slot).store(gl.load(lse_ptr + rows) * 1.4426950408889634)
                delta_smem.index(slot).store(gl.load(delta_ptr + rows))
                hopper.sync_partition()
                mbarrier.arrive(q_ready.index(slot), count=1)
                mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_row + i * BM, q_col],
                                                q_ready.index(slot), q_smem.index(slot))
                do_slot = t % DO_STAGES
                hopper.ring_load(do_desc, do_row + i * BM, do_col, do_ready.index(do_slot),
                                 do_empty.index(do_slot), ((t // DO_STAGES) & 1) ^ 1,
                                 do_smem.index(do_slot))
                t += 1

    # ---------------------------------------------------------------- head dim 256
    # dK and dV of 64 keys at head dim 256 are 64 x 256 fp32 each: 128 registers per
    # thread apiece in one warpgroup, too many for both. So at 256 a program owns 64
    # keys and the two consumer warpgroups split the head dim instead of the keys:
    # warpgroup w holds dK and dV's columns [128 w, 128 w + 128) (64 + 64 registers).
    # The two products that need every column split by kind: warpgroup 0 forms
    # Sᵀ = K Qᵀ and Pᵀ, warpgroup 1 dPᵀ = V dOᵀ and, with Pᵀ from shared memory,
    # dSᵀ; both hand their result over in shared memory, and each then adds its
    # columns of dV += Pᵀ dO, dK += dSᵀ Q and dQ += dS K (dQ 64 columns at a time).
    # Shared memory: K, V 64 KiB; Q 2 x 32 KiB; dO one slot of 32 KiB; Pᵀ and dSᵀ
    # 2 x 2 x 8 KiB; the dQ tiles on their way out 2 x 16 KiB: 224 KiB, about 226 KiB
    # with the row statistics and barriers (ptxas: 230,960 B of the 232,448 allowed).

    @gluon.jit
    def _bwd256_steps(t, lo, hi, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem,
                      lse_smem, delta_smem, bars, dk, dv, dq_desc, dq_buf, dq_row0, keys,
                      qk_scale, sm_scale, s_layout: gl.constexpr, dq_layout: gl.constexpr,
                      MASKED: gl.constexpr, WG: gl.constexpr):
        """Query blocks [lo, hi) of one head for one warpgroup (see above); t counts
        the steps taken so far (ring slots and barrier phases)."""
        q_ready, do_ready, q_empty, do_empty, p_ready, ds_ready = bars
        Q_STAGES: gl.constexpr = q_smem.shape[0]
        BM: gl.constexpr = q_smem.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        BN: gl.constexpr = k_smem.shape[0]
        COLS: gl.constexpr = HEAD_DIM // 2  # this warpgroup's columns of dK, dV, dQ
        DQ_N: gl.constexpr = dq_buf.shape[1]
        s_zero = gl.zeros([BN, BM], gl.float32, s_layout)
        dq_zero = gl.zeros([BM, DQ_N], gl.float32, dq_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        for i in range(lo, hi):
            slot = t % Q_STAGES
            q = q_smem.index(slot)
            do = do_smem.index(0)
            buf = t % 2
            p_buf = p_smem.index(buf)
            ds_buf = ds_smem.index(buf)
            mbarrier.wait(q_ready.index(slot), (t // Q_STAGES) & 1)
            if WG == 0:  # Sᵀ, Pᵀ -> shared memory
                s_tok = warpgroup_mma(k_smem, q.permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                lse2 = lse_smem.index(slot).load(col_layout)
                if MASKED:  # the diagonal block: queries before the key get P = 0
                    cols = i * BM + gl.arange(0, BM, layout=col_layout)
                    keep = gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1)
                    s = gl.where(keep, s * qk_scale - gl.expand_dims(lse2, 0),
                                 float("-inf"))
                else:
                    s = s * qk_scale - gl.expand_dims(lse2, 0)
                p_buf.store(gl.exp2(s).to(q.dtype))
                fence_async_shared()
                hopper.sync_partition()
                mbarrier.arrive(p_ready.index(buf), count=1)
                mbarrier.wait(do_ready.index(0), t & 1)
            else:  # dPᵀ; with Pᵀ, dSᵀ -> shared memory
                mbarrier.wait(do_ready.index(0), t & 1)
                dp_tok = warpgroup_mma(v_smem, do.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                dp = warpgroup_mma_wait(0, deps=(dp_tok,))
                delta = delta_smem.index(slot).load(col_layout)
                mbarrier.wait(p_ready.index(buf), (t // 2) & 1)
                p = p_buf.load(s_layout).to(gl.float32)
                ds_buf.store((p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(q.dtype))
                fence_async_shared()
                hopper.sync_partition()
                mbarrier.arrive(ds_ready.index(buf), count=1)
            mbarrier.wait(p_ready.index(buf), (t // 2) & 1)
            dv_tok = warpgroup_mma(p_buf, do.slice(WG * COLS, COLS, dim=1), dv,
                                   is_async=True)
            mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
            dk_tok = warpgroup_mma(ds_buf, q.slice(WG * COLS, COLS, dim=1), dk,
                                   is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            mbarrier.arrive(do_empty.index(0), count=1)
            mbarrier.arrive(q_empty.index(slot), count=1)
            for c in gl.static_range(COLS // DQ_N):  # dQ's columns, DQ_N at a time
                dq_tok = warpgroup_mma(ds_buf.permute((1, 0)),
                                       k_smem.slice(WG * COLS + c * DQ_N, DQ_N, dim=1),
                                       dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq_tok,))
                _add_dq(dq, dq_desc, dq_buf, dq_row0 + i * BM, WG * COLS + c * DQ_N)
            t += 1
        return t, dk, dv

    @gluon.jit
    def _bwd256_consumer(smem, bars, descs, heads, ptrs, strides, seq_len, n0, qk_scale,
                         sm_scale, WG: gl.constexpr, GROUP: gl.constexpr,
                         HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                         STAGES: gl.constexpr):
        """One consumer warpgroup at head dim 256: columns [128·WG, 128·WG + 128) of
        the program's 64 keys."""
        q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, \
            p_smem = smem
        kv_bar, q_ready, do_ready, q_empty, do_empty, ds_ready, p_ready = bars
        step_bars = (q_ready, do_ready, q_empty, do_empty, p_ready, ds_ready)
        dq_desc = descs[4]
        dq_buf = dq_smem.index(WG)
        dk_ptr, dv_ptr = ptrs[2], ptrs[3]
        dk_ss, dv_ss = strides[0], strides[1]
        bh0, dk_base, dv_base = heads[4], heads[5], heads[6]
        BM: gl.constexpr = q_smem.shape[1]
        BN: gl.constexpr = k_smem.shape[0]
        COLS: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = hopper.wgmma_layout(BM)
        kv_layout: gl.constexpr = hopper.wgmma_layout(COLS)
        dq_layout: gl.constexpr = hopper.wgmma_layout(dq_buf.shape[1])
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BN, COLS], gl.float32, kv_layout)
        dv = gl.zeros([BN, COLS], gl.float32, kv_layout)
        n_q = seq_len // BM
        if CAUSAL:
            lo = n0 // BM
            n_diag = BN // BM  # query blocks that cross the diagonal
        else:
            lo = 0
            n_diag = 0
        mbarrier.wait(kv_bar, 0)
        t = 0
        for g in range(GROUP):
            dq_row0 = ((bh0 + g) * seq_len).to(gl.int32)
            if CAUSAL:
                t, dk, dv = _bwd256_steps(t, lo, lo + n_diag, k_smem, v_smem, q_smem,
                                          do_smem, p_smem, ds_smem, lse_smem, delta_smem,
                                          step_bars, dk, dv, dq_desc, dq_buf, dq_row0,
                                          keys, qk_scale, sm_scale, s_layout, dq_layout,
                                          True, WG)
            t, dk, dv = _bwd256_steps(t, lo + n_diag, n_q, k_smem, v_smem, q_smem,
                                      do_smem, p_smem, ds_smem, lse_smem, delta_smem,
                                      step_bars, dk, dv, dq_desc, dq_buf, dq_row0, keys,
                                      qk_scale, sm_scale, s_layout, dq_layout, False, WG)
        rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout))
        d = WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, kv_layout))
        off = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(dk_ptr + dk_base + off * dk_ss + gl.expand_dims(d, 0),
                 dk.to(dk_ptr.dtype.element_ty))
        gl.store(dv_ptr + dv_base + off * dv_ss + gl.expand_dims(d, 0),
                 dv.to(dv_ptr.dtype.element_ty))
        tma.store_wait(0)  # the last dQ reduction has read its buffer

    @gluon.jit
    def _attn_bwd_hopper_kernel(
        q_desc, do_desc, k_desc, v_desc,  # 2-D TMA views: blocks (64, D), (64, D), (128, D)
        dq_desc,  # (B·Hq·S, D) fp32, zeroed: dQ accumulates here; block (64, D or D/2)
        lse_ptr, delta_ptr,  # (B, Hq, S) fp32 contiguous: LSE (natural log) and Δ
        dk_ptr, dv_ptr,  # (B, Hkv, S, D), any strides, contiguous last dimension
        q_sb, q_sh, q_ss, do_sb, do_sh, do_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
        dk_sb, dk_sh, dk_ss, dv_sb, dv_sh, dv_ss,
        H_Q, seq_len, qk_scale, sm_scale,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        n0 = gl.program_id(0) * BN  # causal: program 0 has the most query blocks
        off_hkv = gl.program_id(1)
        off_b = gl.program_id(2).to(gl.int64)
        first_h = off_hkv * GROUP
        k_off = off_b * k_sb + off_hkv.to(gl.int64) * k_sh
        v_off = off_b * v_sb + off_hkv.to(gl.int64) * v_sh
        heads = ((k_off // k_ss).to(gl.int32) + n0, (k_off % k_ss).to(gl.int32),
                 (v_off // v_ss).to(gl.int32) + n0, (v_off % v_ss).to(gl.int32),
                 off_b * H_Q + first_h,
                 off_b * dk_sb + off_hkv.to(gl.int64) * dk_sh,
                 off_b * dv_sb + off_hkv.to(gl.int64) * dv_sh)
        strides = (dk_ss, dv_ss, q_ss, do_ss,
                   off_b * q_sb + first_h.to(gl.int64) * q_sh,
                   off_b * do_sb + first_h.to(gl.int64) * do_sh, q_sh, do_sh)
        ptrs = (lse_ptr, delta_ptr, dk_ptr, dv_ptr)

        DO_STAGES: gl.constexpr = 1 if HEAD_DIM == 256 else STAGES
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, HEAD_DIM],
                                           q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [DO_STAGES, BM, HEAD_DIM],
                                            do_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [BN, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, HEAD_DIM], v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM],
                                                                       q_desc.dtype)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BN, BM], ds_layout)
        stat_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_smem)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_smem)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                            dq_desc.layout)  # one per consumer
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1],
                                             mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1],
                                             mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=2)  # the Q copy and the row statistics
            mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
        for i in gl.static_range(DO_STAGES):
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(do_empty.index(i), count=2)
        descs = (q_desc, do_desc, k_desc, v_desc, dq_desc)
        if HEAD_DIM == 256:  # warpgroups split the columns (see _bwd256_steps)
            p_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BN, BM], ds_layout)
            p_ready = gl.allocate_shared_memory(gl.int64, [2, 1],
                                                mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(p_ready.index(i), count=1)  # warpgroup 0 wrote Pᵀ
                mbarrier.init(ds_ready.index(i), count=1)  # warpgroup 1 wrote dSᵀ
            smem = (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem,
                    dq_smem, p_smem)
            bars = (kv_bar, q_ready, do_ready, q_empty, do_empty, ds_ready, p_ready)
            gl.warp_specialize([
                (_bwd256_consumer, (smem, bars, descs, heads, ptrs, strides, seq_len, n0,
                                    qk_scale, sm_scale, 0, GROUP, HEAD_DIM, CAUSAL,
                                    STAGES)),
                (_bwd256_consumer, (smem, bars, descs, heads, ptrs, strides, seq_len, n0,
                                    qk_scale, sm_scale, 1, GROUP, HEAD_DIM, CAUSAL,
                                    STAGES)),
                (_bwd_producer, (smem, bars, descs, heads, ptrs, strides, seq_len, n0,
                                 qk_scale, sm_scale, 0, GROUP, HEAD_DIM, CAUSAL, STAGES))],
                               [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            mbarrier.init(ds_ready.index(0), count=2)  # both halves of dSᵀ written
            mbarrier.init(ds_ready.index(1), count=2)
            smem = (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem,
                    dq_smem)
            bars = (kv_bar, q_ready, do_ready, q_empty, do_empty, ds_ready)
            gl.warp_specialize([
                (_bwd_consumer, (smem, bars, descs, heads, ptrs, strides, seq_len, n0,
                                 qk_scale, sm_scale, 0, GROUP, HEAD_DIM, CAUSAL, STAGES)),
                (_bwd_consumer, (smem, bars, descs, heads, ptrs, strides, seq_len, n0,
                                 qk_scale, sm_scale, 1, GROUP, HEAD_DIM, CAUSAL, STAGES)),
                (_bwd_producer, (smem, bars, descs, heads, ptrs, strides, seq_len, n0,
                                 qk_scale, sm_scale, 0, GROUP, HEAD_DIM, CAUSAL, STAGES))],
                               [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _descriptor(t: torch.Tensor, block: int) -> TensorDescriptor:
    view, stride = hopper.rows_view(t)
    d = t.shape[3]
    gl_dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block, d], gl_dtype)
    return TensorDescriptor(view, list(view.shape), [stride, 1], [block, d], layout)


def block_n(head_dim: int) -> int:
    """Keys per program: `BLOCK_N`, 64 at head dim 256 (the warpgroups split the
    columns there instead of the keys)."""
    return BLOCK_N if head_dim <= 128 else BLOCK_N // 2


def dq_descriptor(dq: torch.Tensor) -> TensorDescriptor:
    """The fp32 dQ accumulator (B, Hq, S, D) as rows (B·Hq·S, D); a consumer adds a
    (64, D/2) tile at head dim 128 (each forms half the columns), (64, D) at 64, and
    (64, 64) at 256 (each forms its half 64 columns at a time)."""
    d = dq.shape[-1]
    block = [BLOCK_M, 64]
    view = dq.view(-1, d)
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(view, list(view.shape), [d, 1], block, layout)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, causal: bool, sm_scale: float,
             dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """Fill dk and dv (k's shape, contiguous last dimension) and return dQ in fp32
    (B, Hq, S, D), for inputs `flash_attention_hopper.unsupported` accepted. lse and
    delta: (B, Hq, S) fp32 contiguous; do: any strides (copied if it has no TMA view)."""
    if dk.shape != k.shape or dv.shape != v.shape or dk.stride(3) != 1 \
            or dv.stride(3) != 1:
        raise ValueError("dk and dv must have k's shape and a contiguous last dimension")
    if not (lse.is_contiguous() and delta.is_contiguous()):
        raise ValueError("lse and delta must be contiguous")
    if hopper.rows_view(do) is None:
        do = do.contiguous()
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    dq = torch.zeros((b, hq, s, d), device=q.device, dtype=torch.float32)
    bn = block_n(d)
    descs = (_descriptor(q, BLOCK_M), _descriptor(do, BLOCK_M), _descriptor(k, bn),
             _descriptor(v, bn), dq_descriptor(dq))
    _attn_bwd_hopper_kernel[(s // bn, hkv, b)](
        *descs, lse, delta, dk, dv, *q.stride()[:3], *do.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        hq, s, sm_scale * math.log2(math.e), sm_scale,
        GROUP=hq // hkv, HEAD_DIM=d, CAUSAL=bool(causal), STAGES=STAGES,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return dq


def aot_arguments(head_dim: int, causal: bool, group: int = 1) -> tuple:
    """(kernel, signature, constexprs) to compile the backward for sm_90 without a GPU
    (`sm90_compile.compile_sm90`), for bf16 inputs of one head dim."""
    from triton.runtime.jit import mangle_type

    kern = _attn_bwd_hopper_kernel
    q = torch.empty(1, 2, 2 * BLOCK_N, head_dim, dtype=torch.bfloat16)
    bn = block_n(head_dim)
    sig = {name: mangle_type(_descriptor(q, block)) for name, block in
           zip(kern.arg_names[:4], (BLOCK_M, BLOCK_M, bn, bn))}
    sig["dq_desc"] = mangle_type(dq_descriptor(torch.empty(q.shape)))
    sig.update(lse_ptr="*fp32", delta_ptr="*fp32", dk_ptr="*bf16", dv_ptr="*bf16")
    consts = dict(GROUP=group, HEAD_DIM=head_dim, CAUSAL=causal, STAGES=STAGES,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    for name in kern.arg_names[len(sig):]:
        if name in consts:
            break
        sig[name] = ("fp32" if name in ("qk_scale", "sm_scale") else
                     "i64" if name.endswith(("sb", "sh", "ss")) else "i32")
    return kern, sig, consts
