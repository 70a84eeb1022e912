"""Flash-attention forward kernel (Pallas, Triton lowering on the GPU).

Grid (T/bq, B, H); program (i, b, h) keeps q[b, i*bq:(i+1)*bq, h] and an fp32 accumulator in
registers and streams k/v of kv head h // (H/K) block by block (GQA without repeating K/V).
Scores are prescaled by sm_scale*log2(e) so the online softmax uses exp2. Query blocks are
launched last-first: under a causal mask the late blocks do the most work, and starting them
first evens out the tail of the launch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2, LOG2E, dot, triton_params
from pallas_kernels.attention_plan import AttentionPlan, block_mask, kv_loop_bounds


def _fwd_kernel(*refs, plan: AttentionPlan, bq: int, bk: int):
    if plan.has_seg:
        q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref = refs
        q_seg = qseg_ref[...]
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        kseg_ref = q_seg = None
    qi = pl.num_programs(0) - 1 - pl.program_id(0)
    q_start = qi * bq
    q = q_ref[...]
    e = q.shape[-1]
    scale = plan.sm_scale * LOG2E

    def body(kb, carry, masked: bool):
        acc, m, l = carry
        k_start = kb * bk
        ks = pl.ds(k_start, bk)
        s = dot(q, k_ref[ks, :], trans_b=True) * scale
        if masked:
            k_seg = kseg_ref[ks] if plan.has_seg else None
            mask = block_mask(plan, q_start, k_start, bq, bk, q_seg, k_seg, kv_valid=True)
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row whose keys so far are all masked has m_new = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(v_ref.dtype), v_ref[ks, :])
        return acc, m_new, l

    n_safe, hi = kv_loop_bounds(plan, q_start, bq, bk)
    carry = (jnp.zeros((bq, e), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    carry = lax.fori_loop(0, n_safe, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(n_safe, hi, functools.partial(body, masked=True), carry)
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    o_ref[...] = (acc * inv_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)


def attention_forward(q, k, v, q_seg, kv_seg, plan: AttentionPlan):
    """Padded inputs -> (o [B, Tp, H, E] in q.dtype, lse [B, H, Tp] fp32, natural log)."""
    b, t_pad, h, e = q.shape
    s_pad, kh = k.shape[1], k.shape[2]
    group = h // kh
    bs = plan.blocks
    bq, bk = bs.block_q, bs.block_k
    nq = t_pad // bq

    def q_map(i, bi, hi):
        return (bi, nq - 1 - i, hi, 0)

    def kv_map(i, bi, hi):
        return (bi, 0, lax.div(hi, group), 0)

    in_specs = [
        pl.BlockSpec((None, bq, None, e), q_map),
        pl.BlockSpec((None, s_pad, None, e), kv_map),
        pl.BlockSpec((None, s_pad, None, e), kv_map),
    ]
    args = [q, k, v]
    if plan.has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, nq - 1 - i)),
                     pl.BlockSpec((None, s_pad), lambda i, bi, hi: (bi, 0))]
        args += [q_seg, kv_seg]
    out_specs = [pl.BlockSpec((None, bq, None, e), q_map),
                 pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, nq - 1 - i))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)]
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan, bq=bq, bk=bk),
        grid=(nq, b, h),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(bs.num_warps_fwd, bs.num_stages_fwd),
        interpret=plan.interpret,
        name="flash_attention_fwd",
    )(*args)
    return o, lse
