"""Flash-attention forward on Mosaic GPU (Hopper): TMA, asynchronous wgmma, warp specialization.

One CTA owns 2 x 64 query rows of one (batch, head): consumer warpgroup w holds its q tile in SMEM
and its accumulator, row max and row sum in registers; the producer warpgroup streams the K/V
blocks of kv head h // (H/K) (GQA without repeating K/V) through `stages` SMEM slots:

  producer   K0 V0 K1 V1 K2 V2 ...        (waits for a slot's release before refilling it)
  wg 0       S0=QK0  softmax0  O+=P0V0  S1=QK1  softmax1 ...
  wg 1          S0=QK0  softmax0  O+=P0V0  S1=QK1 ...

The two consumers take turns on the tensor cores through a schedule barrier (FA3's ping-pong):
wg 1 starts one round late, so one warpgroup's softmax runs while the other's GEMMs do.

Per consumer the key blocks split into [0, n_full) with no mask, [n_full, n_mine) with the causal /
padding / segment mask, and [n_mine, n_cta) that only the later rows of the CTA see (drained).
Scores are prescaled by sm_scale * log2(e) so the online softmax uses exp2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._common import LN2, LOG2E
from pallas_kernels.attention.plan import AttentionPlan, kv_loop_bounds
from pallas_kernels.attention import mosaic_common as mc

BQ = mc.ROWS_PER_WARPGROUP


def _fwd_kernel(*refs, plan: AttentionPlan, bk: int, stages: int, group: int, e: int, dtype):
    if plan.has_seg:
        (q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, smem, bars) = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref, smem, bars) = refs
        qseg_ref = kseg_ref = None
    qo_smem, k_smem, v_smem, lse_smem, qseg_smem, kseg_smem = smem
    q_bar, qseg_bar, k_bar, v_bar, kseg_bar, k_used, v_used, turn = bars
    b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    kh = lax.div(h, jnp.int32(group))
    cta_start = lax.axis_index("q_blocks") * (mc.N_CONSUMERS * BQ)
    # The CTA's later rows see the most keys: the producer streams what they need.
    _, n_cta = kv_loop_bounds(plan, cta_start + BQ, BQ, bk)
    scale = plan.sm_scale * LOG2E

    def take_turn():  # one round of the ping-pong between the consumers
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < mc.N_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(mc.CONSUMER_REGISTERS, action="increase")
        q_start = cta_start + wg * BQ
        q_smem = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, BQ), h], q_smem, q_bar.at[wg])
        q_seg = None
        if plan.has_seg:
            q_seg = mc.owned_ids(qseg_ref.at[b, pl.ds(q_start, BQ)], qseg_smem.at[wg], qseg_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        n_full, n_mine = kv_loop_bounds(plan, q_start, BQ, bk)

        def step(kb, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(kb, stages)
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                take_turn()
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((BQ, bk), jnp.float32))
            k_seg = None
            if plan.has_seg:
                plgpu.barrier_wait(kseg_bar.at[slot])
                k_seg = mc.load_vector(kseg_smem.at[slot], mc.COL)
            plgpu.barrier_arrive(k_used.at[slot])
            if masked:
                s = jnp.where(mc.tile_mask(plan, q_start, kb * bk, s.shape, q_seg, k_seg), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * scale)
            # A row whose keys so far are all masked has m_new = -inf: shift by 0 so exp2 gives 0, not NaN.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            p = jnp.exp2(s * scale - mc.rows(m_use, s.shape))
            alpha = jnp.exp2(m - m_use)
            l = l * alpha + p.sum(axis=1)
            acc = acc * mc.rows(alpha, acc.shape)
            p_c = p.astype(dtype)
            plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours
            acc = mc.wgmma_accumulate(acc, p_c, v_smem.at[slot])
            plgpu.barrier_arrive(v_used.at[slot])
            return acc, m_new, l

        carry = (mc.full((BQ, e), 0.0), mc.full((BQ,), -jnp.inf, mc.ROW), mc.full((BQ,), 0.0, mc.ROW))
        pl.when(wg == 1)(take_turn)
        carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
        acc, m, l = lax.fori_loop(n_full, n_mine, functools.partial(step, masked=True), carry)
        data = (k_bar, v_bar, kseg_bar) if plan.has_seg else (k_bar, v_bar)
        # Two turns per drained step, as `step` takes, so the rounds keep pairing up.
        mc.drain(n_mine, n_cta, stages, data, (k_used, v_used), extra=lambda: (take_turn(), take_turn()))
        pl.when(wg == 0)(take_turn)

        empty = l == 0.0
        inv_l = 1.0 / jnp.where(empty, 1.0, l)
        q_smem[...] = (acc * mc.rows(inv_l, acc.shape)).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(q_start, BQ), h], commit_group=False)
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q_start, BQ)], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == mc.N_CONSUMERS)
    def _producer():
        def copy_k(kb, slot):
            plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(kb * bk, bk), kh], k_smem.at[slot], k_bar.at[slot])
            if plan.has_seg:  # released with K: the consumer reads them before it releases K
                plgpu.copy_gmem_to_smem(kseg_ref.at[b, pl.ds(kb * bk, bk)], kseg_smem.at[slot],
                                        kseg_bar.at[slot])

        def copy_v(kb, slot):
            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kb * bk, bk), kh], v_smem.at[slot], v_bar.at[slot])

        mc.producer_loop(n_cta, stages, [(k_used, copy_k), (v_used, copy_v)])


def mosaic_attention_forward(q, k, v, q_seg, kv_seg, plan: AttentionPlan):
    """Padded inputs -> (o [B, Tp, H, E] in q.dtype, lse [B, H, Tp] fp32, natural log)."""
    b, t_pad, h, e = q.shape
    s_pad, kh = k.shape[1], k.shape[2]
    cfg = plan.mosaic
    bk, stages = cfg.block_k, cfg.stages
    stages = max(1, min(stages, s_pad // bk))
    n_c = mc.N_CONSUMERS
    smem = (mc.tile_smem((n_c, BQ, e), q.dtype), mc.tile_smem((stages, bk, e), q.dtype),
            mc.tile_smem((stages, bk, e), q.dtype), plgpu.SMEM((n_c, BQ), jnp.float32),
            plgpu.SMEM((n_c, BQ), jnp.int32) if plan.has_seg else None,
            plgpu.SMEM((stages, bk), jnp.int32) if plan.has_seg else None)
    # q, q ids | k, v, k ids | k released, v released | the consumers' turns
    bars = (mc.barriers(n_c, 2) + mc.barriers(stages, 3) + mc.barriers(stages, 2, arrivals=n_c)
            + mc.barriers(1, 1, arrivals=n_c))
    args = [q, k, v] + ([q_seg, kv_seg] if plan.has_seg else [])
    o, lse = mc.launch(
        functools.partial(_fwd_kernel, plan=plan, bk=bk, stages=stages, group=h // kh, e=e, dtype=q.dtype),
        out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)],
        scratch_types=[smem, bars],
        grid=(h, t_pad // (n_c * BQ), b), grid_names=("heads", "q_blocks", "batch"),
        name="flash_attention_fwd_mosaic", stages=("stages", cfg.stages),
    )(*args)
    return o, lse
