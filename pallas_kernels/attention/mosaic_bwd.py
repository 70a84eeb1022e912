"""Flash-attention backward on Mosaic GPU (Hopper): a dK/dV kernel, and dQ one of two ways.

  preprocess (XLA)  delta = rowsum(o * do) - dlse,  lse2 = lse * log2(e)  (+inf where lse = -inf,
                    so a row that saw no key gets p = exp2(s - lse2) = 0 exactly)
  dkdv  grid (S/128, B, K): consumer w owns 64 keys of kv head kh; the producer streams q, do, lse2,
        delta of every query head of the GQA group, block by block:
          sT = K Q^T   pT = exp2(sT - lse2)   dV += pT dO   dpT = V dO^T
          dsT = pT (dpT - delta)   dK += dsT Q
        dK/dV of a kv head are summed in registers: no atomics, no [B, S, H, E] intermediate.
  dQ, `dq_atomic` (the default): the dkdv step also computes dQ's share of its keys, dS K, and adds
        it into a zeroed fp32 [B, T, H, E] buffer with TMA reduce-adds: 5 GEMMs in all. Both consumers
        stage dS^T in SMEM; with E >= 128 each then takes half of dQ's columns over all 128 keys of the
        CTA (64 x E/2 accumulators, one add of 64 x E per CTA step; K's columns read from both
        consumers' K tiles), after a barrier that says both halves of dS are written; with E = 64
        each takes its own 64 keys and all columns.
  dQ, `dq_atomic=False`: a dq kernel, grid (T/128, B, H): consumer w owns 64 queries; the producer
        streams K/V of kv head h // G:  s = Q K^T  p = exp2(s - lse2)  dp = dO V^T  ds = p (dp - delta)
        dQ += ds K. No atomics, but S and dP are computed twice: 7 GEMMs in all. Needed for
        block_q_dkv = 128.

Causal bounds as in the Triton kernels (plan.py): a dK/dV consumer starts at the first query
block that sees its keys, and the CTA's producer starts at the earlier consumer's first block, so
the later consumer drains (waits and releases) the blocks before its own start.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._common import LOG2E
from pallas_kernels.attention.plan import AttentionPlan, backward_stats, kv_loop_bounds, q_loop_bounds
from pallas_kernels.attention.mosaic_fwd import BQ
from pallas_kernels.attention import mosaic_common as mc

BK = mc.ROWS_PER_WARPGROUP  # keys per dK/dV consumer


def _dq_columns(e: int) -> int:
    """dQ columns per consumer under dq_atomic: E/2 (over all keys of the CTA) where a half still fills
    a 128-byte swizzled SMEM row of K (64 bf16 values), that is E >= 128; else all E (over its own keys)."""
    return e // mc.N_CONSUMERS if e >= mc.N_CONSUMERS * 64 else e


def _dkdv_kernel(*refs, plan: AttentionPlan, bq: int, stages: int, group: int, e: int, dtype, dq_atomic: bool,
                 dq_cols: int):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref = refs[:6]
    qseg_ref, kseg_ref = refs[6:8] if plan.has_seg else (None, None)
    dq_acc_ref = refs[-5] if dq_atomic else None
    dk_ref, dv_ref, smem, bars = refs[-4:]
    k_smem, v_smem, kseg_smem, q_smem, do_smem, lse_smem, delta_smem, qseg_smem, ds_smem, dq_smem = smem
    k_bar, v_bar, kseg_bar, q_bar, do_bar, lse_bar, delta_bar, qseg_bar, used, ds_ready, k_done = bars
    b, kh, wg = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("wg")
    cta_k = lax.axis_index("k_blocks") * (mc.N_CONSUMERS * BK)
    cta_lo, _, hi = q_loop_bounds(plan, cta_k, bq, BK)
    n_i = hi - cta_lo  # query blocks per head that the CTA streams
    scale = plan.sm_scale * LOG2E
    split_e = dq_atomic and dq_cols < e  # the consumers split dQ's columns (_dq_columns)

    @pl.when(wg < mc.N_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(mc.CONSUMER_REGISTERS, action="increase")
        k_start = cta_k + wg * BK
        rows = (b, pl.ds(k_start, BK), kh)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[wg], k_bar.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[wg], v_bar.at[wg])
        k_seg = None
        if plan.has_seg:
            k_seg = mc.owned_ids(kseg_ref.at[b, pl.ds(k_start, BK)], kseg_smem.at[wg], kseg_bar.at[wg])
        for j in range(mc.N_CONSUMERS) if split_e else (wg,):  # split_e: dQ's B operand is all keys' K
            plgpu.barrier_wait(k_bar.at[j])
        plgpu.barrier_wait(v_bar.at[wg])
        lo, mid, _ = q_loop_bounds(plan, k_start, bq, BK)
        if split_e:
            # Every step's dQ needs both consumers' dS, so the later consumer computes (to zeros, under the
            # mask) the blocks before its own first one instead of draining them.
            lo = cta_lo

        def step(qi, carry, base, h, masked: bool):
            slot = lax.rem(base + qi, stages)
            plgpu.barrier_wait(q_bar.at[slot])
            plgpu.barrier_wait(do_bar.at[slot])
            buf = lax.rem(base + qi, 2)  # dS^T is double-buffered: see issue_dq

            def gemms(acc_refs):
                # wgmma groups waited on in issue order, so each elementwise phase runs while the tensor
                # cores do a GEMM: exp2 of S^T beside dP^T, and (without dq_atomic) dS^T beside dV.
                dk_ref, dv_ref, s_ref, dp_ref = acc_refs
                plgpu.wgmma(s_ref, k_smem.at[wg], q_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(dp_ref, v_smem.at[wg], do_smem.at[slot].transpose((1, 0)))
                plgpu.barrier_wait(lse_bar.at[slot])
                s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                p_t = jnp.exp2(s_t * scale - mc.cols(mc.load_vector(lse_smem.at[slot], mc.COL), s_t.shape))
                if masked:
                    q_seg = None
                    if plan.has_seg:
                        plgpu.barrier_wait(qseg_bar.at[slot])
                        q_seg = mc.load_vector(qseg_smem.at[slot], mc.COL)
                    p_t = jnp.where(mc.tile_mask(plan, qi * bq, k_start, p_t.shape, q_seg, k_seg, keys_on_rows=True),
                                    p_t, 0.0)
                if not dq_atomic:
                    plgpu.wgmma(dv_ref, p_t.astype(dtype), do_smem.at[slot])
                plgpu.barrier_wait(delta_bar.at[slot])
                dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0 if dq_atomic else 1)
                ds_t = (p_t * (dp_t - mc.cols(mc.load_vector(delta_smem.at[slot], mc.COL), p_t.shape))).astype(dtype)
                if not dq_atomic:
                    plgpu.wgmma(dk_ref, ds_t, q_smem.at[slot])
                    return
                # dq_atomic: dS^T staged first, then dV, dQ and dK issued back to back (FlashAttention-3's
                # order): dV keeps the tensor cores busy through the wait for the other consumer's dS^T,
                # and dQ's fp32 tile goes to SMEM and out while dK runs. Against dV issued before dS^T and
                # dK before dQ: level to 4% faster at 240 registers (H200, 2026-11-28, docs/PERFORMANCE.md).
                ds_smem.at[buf, wg][...] = ds_t
                plgpu.commit_smem()
                if split_e:
                    plgpu.barrier_arrive(ds_ready.at[buf])
                plgpu.wgmma(dv_ref, p_t.astype(dtype), do_smem.at[slot])

                def dq_then_dk(dq_ref):
                    issue_dq(dq_ref, buf)
                    plgpu.wgmma(dk_ref, ds_t, q_smem.at[slot])
                    return plgpu.wgmma_accumulator_load(dq_ref, wait_n=1)  # dV and dQ done, dK in flight
                add_dq(pl.run_scoped(dq_then_dk, plgpu.ACC((bq, dq_cols), jnp.float32)), qi, h)

            tile = mc.full((BK, bq), 0.0)
            dk, dv, _, _ = pl.run_state(gemms)(tuple(plgpu.ACC.init(x) for x in (*carry, tile, tile)))
            plgpu.barrier_arrive(used.at[slot])
            return dk, dv

        def issue_dq(acc_ref, buf):
            """Issue dQ[q block, my columns] = dS K: a wgmma group per consumer whose dS^T and K it reads.

            Buffer `buf` of dS^T is written again two steps later. By then the other consumer has
            arrived on the next step's ds_ready, which it does only after its wgmma here has read `buf`.
            """
            if split_e:
                plgpu.barrier_wait(ds_ready.at[buf])
                my_cols = pl.ds(wg * dq_cols, dq_cols)
                operands = [(ds_smem.at[buf, j].transpose((1, 0)), k_smem.at[j, :, my_cols])
                            for j in range(mc.N_CONSUMERS)]
            else:
                operands = [(ds_smem.at[buf, wg].transpose((1, 0)), k_smem.at[wg])]
            for a, b_op in operands:
                plgpu.wgmma(acc_ref, a, b_op)

        def add_dq(dq, qi, h):
            """dq_acc[q block, my columns] += dq: an fp32 TMA reduce-add from SMEM."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous add has read dq_smem
            dq_smem.at[wg][...] = dq
            plgpu.commit_smem()
            cols = pl.ds(wg * dq_cols, dq_cols) if split_e else pl.ds(0, e)
            plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_acc_ref.at[b, pl.ds(qi * bq, bq), h, cols],
                                    reduction_op="add")

        data = (q_bar, do_bar, lse_bar, delta_bar) + ((qseg_bar,) if plan.has_seg else ())

        def head(g, carry):
            base = g * n_i - cta_lo  # step index of query block qi of this head: base + qi
            h = kh * group + g
            mc.drain(base + cta_lo, base + lo, stages, data, (used,))
            carry = lax.fori_loop(lo, mid, functools.partial(step, base=base, h=h, masked=True), carry)
            return lax.fori_loop(mid, hi, functools.partial(step, base=base, h=h, masked=False), carry)

        zeros = mc.full((BK, e), 0.0)
        dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
        if split_e:  # the other consumer's last dQ GEMM has read my K before dK overwrites it
            plgpu.barrier_arrive(k_done.at[0])
            plgpu.barrier_wait(k_done.at[0])
        k_smem.at[wg][...] = (dk * plan.sm_scale).astype(dtype)
        v_smem.at[wg][...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[rows], commit_group=False)
        plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == mc.N_CONSUMERS)
    def _producer():
        def copies(j, slot):
            h = kh * group + lax.div(j, n_i)
            q0 = (cta_lo + lax.rem(j, n_i)) * bq
            rows = (b, pl.ds(q0, bq), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(lse2_ref.at[b, h, pl.ds(q0, bq)], lse_smem.at[slot], lse_bar.at[slot])
            if plan.has_seg:
                plgpu.copy_gmem_to_smem(qseg_ref.at[b, pl.ds(q0, bq)], qseg_smem.at[slot], qseg_bar.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_bar.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(q0, bq)], delta_smem.at[slot], delta_bar.at[slot])

        mc.producer_loop(group * n_i, stages, [(used, copies)])


def _dq_kernel(*refs, plan: AttentionPlan, bk: int, stages: int, group: int, e: int, dtype):
    if plan.has_seg:
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, qseg_ref, kseg_ref, dq_ref, smem, bars) = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref, smem, bars) = refs
        qseg_ref = kseg_ref = None
    q_smem, do_smem, lse_smem, delta_smem, qseg_smem, k_smem, v_smem, kseg_smem = smem
    q_bar, do_bar, lse_bar, delta_bar, qseg_bar, k_bar, v_bar, kseg_bar, k_used, v_used = bars
    b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    kh = lax.div(h, jnp.int32(group))
    cta_start = lax.axis_index("q_blocks") * (mc.N_CONSUMERS * BQ)
    _, n_cta = kv_loop_bounds(plan, cta_start + BQ, BQ, bk)
    scale = plan.sm_scale * LOG2E

    @pl.when(wg < mc.N_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(mc.CONSUMER_REGISTERS, action="increase")
        q_start = cta_start + wg * BQ
        rows = (b, pl.ds(q_start, BQ), h)
        vec = (b, h, pl.ds(q_start, BQ))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], do_bar.at[wg])
        plgpu.copy_gmem_to_smem(lse2_ref.at[vec], lse_smem.at[wg], lse_bar.at[wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[wg], delta_bar.at[wg])
        q_seg = None
        if plan.has_seg:
            q_seg = mc.owned_ids(qseg_ref.at[b, pl.ds(q_start, BQ)], qseg_smem.at[wg], qseg_bar.at[wg])
        for bar in (q_bar, do_bar, lse_bar, delta_bar):
            plgpu.barrier_wait(bar.at[wg])
        lse2 = mc.load_vector(lse_smem.at[wg], mc.ROW)
        delta = mc.load_vector(delta_smem.at[wg], mc.ROW)
        n_full, n_mine = kv_loop_bounds(plan, q_start, BQ, bk)

        def step(kb, dq, masked: bool):
            slot = lax.rem(kb, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])

            def scores(s_ref, dp_ref):
                # Both GEMMs in flight at once: P's exp2 runs while the tensor cores do dP = dO V^T.
                plgpu.wgmma(s_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(dp_ref, do_smem.at[wg], v_smem.at[slot].transpose((1, 0)))
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                p = jnp.exp2(s * scale - mc.rows(lse2, s.shape))
                if masked:
                    k_seg = None
                    if plan.has_seg:
                        plgpu.barrier_wait(kseg_bar.at[slot])
                        k_seg = mc.load_vector(kseg_smem.at[slot], mc.COL)
                    p = jnp.where(mc.tile_mask(plan, q_start, kb * bk, p.shape, q_seg, k_seg), p, 0.0)
                return p, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

            acc = plgpu.ACC((BQ, bk), jnp.float32)
            p, dp = pl.run_scoped(scores, acc, acc)
            plgpu.barrier_arrive(v_used.at[slot])
            ds = p * (dp - mc.rows(delta, p.shape))
            dq = mc.wgmma_accumulate(dq, ds.astype(dtype), k_smem.at[slot])
            plgpu.barrier_arrive(k_used.at[slot])
            return dq

        dq = mc.full((BQ, e), 0.0)
        dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(n_full, n_mine, functools.partial(step, masked=True), dq)
        data = (k_bar, v_bar) + ((kseg_bar,) if plan.has_seg else ())
        mc.drain(n_mine, n_cta, stages, data, (k_used, v_used))
        q_smem.at[wg][...] = (dq * plan.sm_scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == mc.N_CONSUMERS)
    def _producer():
        def copy_k(kb, slot):
            plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(kb * bk, bk), kh], k_smem.at[slot], k_bar.at[slot])
            if plan.has_seg:
                plgpu.copy_gmem_to_smem(kseg_ref.at[b, pl.ds(kb * bk, bk)], kseg_smem.at[slot],
                                        kseg_bar.at[slot])

        def copy_v(kb, slot):
            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kb * bk, bk), kh], v_smem.at[slot], v_bar.at[slot])

        mc.producer_loop(n_cta, stages, [(k_used, copy_k), (v_used, copy_v)])


def mosaic_attention_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, plan: AttentionPlan):
    """Padded inputs -> (dq [B, Tp, H, E], dk, dv [B, Sp, K, E]) in q.dtype."""
    b, t_pad, h, e = q.shape
    s_pad, kh = k.shape[1], k.shape[2]
    group = h // kh
    cfg = plan.mosaic
    n_c, dtype = mc.N_CONSUMERS, q.dtype
    delta, lse2 = backward_stats(o, do, lse, dlse)
    seg_args = [q_seg, kv_seg] if plan.has_seg else []
    seg_smem = lambda n, length: plgpu.SMEM((n, length), jnp.int32) if plan.has_seg else None
    vec_smem = lambda n, length: plgpu.SMEM((n, length), jnp.float32)

    bq, st = cfg.block_q_dkv, cfg.stages_bwd
    st = max(1, min(st, t_pad // bq))
    atomic = cfg.dq_atomic
    dq_cols = _dq_columns(e)
    split_e = atomic and dq_cols < e
    smem = (mc.tile_smem((n_c, BK, e), dtype), mc.tile_smem((n_c, BK, e), dtype), seg_smem(n_c, BK),
            mc.tile_smem((st, bq, e), dtype), mc.tile_smem((st, bq, e), dtype), vec_smem(st, bq),
            vec_smem(st, bq), seg_smem(st, bq),
            mc.tile_smem((2, n_c, BK, bq), dtype) if atomic else None,
            mc.tile_smem((n_c, bq, dq_cols), jnp.float32) if atomic else None)
    bars = (mc.barriers(n_c, 3) + mc.barriers(st, 5) + mc.barriers(st, 1, arrivals=n_c)
            + (mc.barriers(2, 1, arrivals=n_c) + mc.barriers(1, 1, arrivals=n_c) if split_e else (None, None)))
    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    # dQ summed over key blocks by TMA reduce-adds into a zeroed fp32 buffer that the kernel writes.
    dq_acc = [jax.new_ref(jnp.zeros((b, t_pad, h, e), jnp.float32))] if atomic else []
    dk, dv = mc.launch(
        functools.partial(_dkdv_kernel, plan=plan, bq=bq, stages=st, group=group, e=e, dtype=dtype,
                          dq_atomic=atomic, dq_cols=dq_cols),
        out_type=[kv_type, kv_type], scratch_types=[smem, bars],
        grid=(s_pad // (n_c * BK), b, kh), grid_names=("k_blocks", "batch", "kv_heads"),
        name="flash_attention_dkdv_mosaic", stages=("stages_bwd", cfg.stages_bwd),
    )(q, k, v, do, lse2, delta, *seg_args, *dq_acc)
    if atomic:
        return (dq_acc[0][...] * plan.sm_scale).astype(dtype), dk, dv

    bk, st = cfg.block_k_dq, cfg.stages_bwd
    st = max(1, min(st, s_pad // bk))
    smem = (mc.tile_smem((n_c, BQ, e), dtype), mc.tile_smem((n_c, BQ, e), dtype), vec_smem(n_c, BQ),
            vec_smem(n_c, BQ), seg_smem(n_c, BQ), mc.tile_smem((st, bk, e), dtype),
            mc.tile_smem((st, bk, e), dtype), seg_smem(st, bk))
    bars = mc.barriers(n_c, 5) + mc.barriers(st, 3) + mc.barriers(st, 2, arrivals=n_c)
    (dq,) = mc.launch(
        functools.partial(_dq_kernel, plan=plan, bk=bk, stages=st, group=group, e=e, dtype=dtype),
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype)], scratch_types=[smem, bars],
        grid=(h, t_pad // (n_c * BQ), b), grid_names=("heads", "q_blocks", "batch"),
        name="flash_attention_dq_mosaic", stages=("stages_bwd", cfg.stages_bwd),
    )(q, k, v, do, lse2, delta, *seg_args)
    return dq, dk, dv
