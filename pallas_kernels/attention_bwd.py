"""Flash-attention backward: preprocess, dK/dV kernel, dQ kernel (Pallas, Triton lowering).

  preprocess  grid (T/bq, B, H):  delta = rowsum(o * do) - dlse,  lse2 = lse * log2(e)
              (the lse cotangent folds into delta: d lse_i / d s_ij = p_ij, so
               ds_ij = p_ij * (dp_ij - delta_i + dlse_i)).
  dkdv        grid (S/bk, B, K):  a program owns one key block of kv head kh and loops over the
              G = H/K query heads of its group and over their query blocks, so dK/dV of a kv head
              are summed in registers: no atomics, no [B, S, H, E] intermediate.
  dq          grid (T/bq, B, H):  like the forward, a program owns a query block and walks keys.
A row that saw no key has lse = -inf; lse2 = +inf there makes p = exp2(s - lse2) = 0 exactly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LOG2E, dot, triton_params
from pallas_kernels.attention_plan import AttentionPlan, block_mask, kv_loop_bounds, q_loop_bounds


def _preprocess_kernel(o_ref, do_ref, lse_ref, dlse_ref, delta_ref, lse2_ref):
    o = o_ref[...].astype(jnp.float32)
    do = do_ref[...].astype(jnp.float32)
    delta_ref[...] = jnp.sum(o * do, axis=1) - dlse_ref[...]
    lse = lse_ref[...]
    lse2_ref[...] = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


def _preprocess(o, do, lse, dlse, plan: AttentionPlan):
    b, t_pad, h, e = o.shape
    bq = plan.blocks.block_q_dq
    row = pl.BlockSpec((None, bq, None, e), lambda i, bi, hi: (bi, i, hi, 0))
    vec = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))
    stat = jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)
    return pl.pallas_call(
        _preprocess_kernel, grid=(t_pad // bq, b, h), in_specs=[row, row, vec, vec],
        out_specs=[vec, vec], out_shape=[stat, stat],
        compiler_params=triton_params(4, 1), interpret=plan.interpret,
        name="flash_attention_bwd_preprocess",
    )(o, do, lse, dlse)


def _dkdv_kernel(*refs, plan: AttentionPlan, bq: int, bk: int, group: int):
    if plan.has_seg:
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, qseg_ref, kseg_ref,
         dk_ref, dv_ref) = refs
        k_seg = kseg_ref[...]
    else:
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref = refs
        qseg_ref = k_seg = None
    k_start = pl.program_id(0) * bk
    k = k_ref[...]
    v = v_ref[...]
    e = k.shape[-1]
    scale = plan.sm_scale * LOG2E
    lo, mid, hi = q_loop_bounds(plan, k_start, bq, bk)

    # Work in the transposed orientation [bk, bq] (s^T = k q^T): p^T and ds^T are then the A
    # operands of the dV/dK matmuls as they sit in registers; only loaded tiles get transposed.
    def body(qb, carry, g: int, masked: bool):
        dk, dv = carry
        q_start = qb * bq
        qs = pl.ds(q_start, bq)
        q = q_ref[qs, g, :]
        do = do_ref[qs, g, :]
        s_t = dot(k, q, trans_b=True) * scale
        if masked:
            q_seg = qseg_ref[qs] if plan.has_seg else None
            mask = block_mask(plan, q_start, k_start, bq, bk, q_seg, k_seg, kv_valid=False,
                              transposed=True)
            s_t = jnp.where(mask, s_t, -jnp.inf)
        p_t = jnp.exp2(s_t - lse2_ref[g, qs][None, :])
        dv = dv + dot(p_t.astype(do.dtype), do)
        dp_t = dot(v, do, trans_b=True)
        ds_t = p_t * (dp_t - delta_ref[g, qs][None, :])
        dk = dk + dot(ds_t.astype(q.dtype), q)
        return dk, dv

    carry = (jnp.zeros((bk, e), jnp.float32), jnp.zeros((bk, e), jnp.float32))
    for g in range(group):  # static: the group is small and static indices lower to plain offsets
        carry = lax.fori_loop(lo, mid, functools.partial(body, g=g, masked=True), carry)
        carry = lax.fori_loop(mid, hi, functools.partial(body, g=g, masked=False), carry)
    dk, dv = carry
    dk_ref[...] = (dk * plan.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, plan: AttentionPlan, bq: int, bk: int):
    if plan.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, qseg_ref, kseg_ref, dq_ref = refs
        q_seg = qseg_ref[...]
    else:
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref = refs
        kseg_ref = q_seg = None
    qi = pl.num_programs(0) - 1 - pl.program_id(0)
    q_start = qi * bq
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse2_ref[...][:, None]
    delta = delta_ref[...][:, None]
    scale = plan.sm_scale * LOG2E

    def body(kb, dq, masked: bool):
        k_start = kb * bk
        ks = pl.ds(k_start, bk)
        k = k_ref[ks, :]
        s = dot(q, k, trans_b=True) * scale
        if masked:
            k_seg = kseg_ref[ks] if plan.has_seg else None
            mask = block_mask(plan, q_start, k_start, bq, bk, q_seg, k_seg, kv_valid=True)
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - lse2)
        dp = dot(do, v_ref[ks, :], trans_b=True)
        ds = p * (dp - delta)
        return dq + dot(ds.astype(k.dtype), k)

    n_safe, hi = kv_loop_bounds(plan, q_start, bq, bk)
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(0, n_safe, functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(n_safe, hi, functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * plan.sm_scale).astype(dq_ref.dtype)


def attention_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, plan: AttentionPlan):
    """Padded inputs and cotangents -> (dq, dk, dv) in the input dtypes."""
    b, t_pad, h, e = q.shape
    s_pad, kh = k.shape[1], k.shape[2]
    group = h // kh
    bs = plan.blocks
    delta, lse2 = _preprocess(o, do, lse, dlse, plan)

    bq, bk = bs.block_q_dkv, bs.block_k_dkv
    grp_rows = pl.BlockSpec((None, t_pad, group, e), lambda j, bi, ki: (bi, 0, ki, 0))
    grp_stat = pl.BlockSpec((None, group, t_pad), lambda j, bi, ki: (bi, ki, 0))
    kv_blk = pl.BlockSpec((None, bk, None, e), lambda j, bi, ki: (bi, j, ki, 0))
    in_specs = [grp_rows, kv_blk, kv_blk, grp_rows, grp_stat, grp_stat]
    args = [q, k, v, do, lse2, delta]
    if plan.has_seg:
        in_specs += [pl.BlockSpec((None, t_pad), lambda j, bi, ki: (bi, 0)),
                     pl.BlockSpec((None, bk), lambda j, bi, ki: (bi, j))]
        args += [q_seg, kv_seg]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, plan=plan, bq=bq, bk=bk, group=group),
        grid=(s_pad // bk, b, kh), in_specs=in_specs, out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=triton_params(bs.num_warps_dkdv, bs.num_stages_dkdv), interpret=plan.interpret,
        name="flash_attention_bwd_dkdv",
    )(*args)

    bq, bk = bs.block_q_dq, bs.block_k_dq
    nq = t_pad // bq
    q_blk = pl.BlockSpec((None, bq, None, e), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0))
    kv_all = pl.BlockSpec((None, s_pad, None, e), lambda i, bi, hi: (bi, 0, lax.div(hi, group), 0))
    stat = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, nq - 1 - i))
    in_specs = [q_blk, kv_all, kv_all, q_blk, stat, stat]
    args = [q, k, v, do, lse2, delta]
    if plan.has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, nq - 1 - i)),
                     pl.BlockSpec((None, s_pad), lambda i, bi, hi: (bi, 0))]
        args += [q_seg, kv_seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan, bq=bq, bk=bk),
        grid=(nq, b, h), in_specs=in_specs, out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(bs.num_warps_dq, bs.num_stages_dq), interpret=plan.interpret,
        name="flash_attention_bwd_dq",
    )(*args)
    return dq, dk, dv
