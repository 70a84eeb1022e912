"""Flash attention's Triton backend: the kernels of `triton_kernels.py` launched on jax arrays.

  forward   grid (Tp/bq, B, H)   -> o [B, Tp, H, E], lse [B, H, Tp] fp32 (natural log)
  backward  XLA: delta, lse2 (`plan.backward_stats`); then
            dK/dV  grid (Sp/bk, B, KH): a program per key block of a kv head, summing over its GQA group
            dQ     grid (Tp/bq, B, H):  a program per query block, recomputing p and dp
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import LOG2E
from pallas_kernels.attention.plan import AttentionPlan, backward_stats
from pallas_kernels.triton_launch import launch

_KERNELS = "pallas_kernels.attention.triton_kernels"


def _static(plan: AttentionPlan, q, k) -> dict:
    """The plan as the kernels' constexprs."""
    b, t_pad, h, e = q.shape
    return dict(H=h, KH=k.shape[2], E=e, T_PAD=t_pad, S_PAD=k.shape[1], T_REAL=plan.t_real, S_REAL=plan.s_real,
                CAUSAL=plan.causal, HAS_SEG=plan.has_seg, SCALE2=plan.sm_scale * LOG2E, SM_SCALE=plan.sm_scale,
                # fp32 inputs get fp32 products on the GPU (tf32 would be the default there); 16-bit ones ignore it.
                PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")


def _segments(q_seg, kv_seg):
    """The id arguments; without segment ids the kernels never read them, so one-element stand-ins."""
    if q_seg is None:
        dummy = jnp.zeros((1,), jnp.int32)
        return [dummy, dummy]
    return [q_seg, kv_seg]


def triton_attention_forward(q, k, v, q_seg, kv_seg, plan: AttentionPlan):
    """Padded inputs -> (o [B, Tp, H, E] in q.dtype, lse [B, H, Tp] fp32, natural log)."""
    b, t_pad, h, _ = q.shape
    bs = plan.blocks
    o, lse = launch(_KERNELS, "fwd_kernel", q, k, v, *_segments(q_seg, kv_seg),
                    out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                               jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)],
                    grid=(t_pad // bs.block_q, b, h), num_warps=bs.num_warps_fwd, num_stages=bs.num_stages_fwd,
                    interpret=plan.interpret, BQ=bs.block_q, BK=bs.block_k, **_static(plan, q, k))
    return o, lse


def triton_attention_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, plan: AttentionPlan):
    """Padded inputs and cotangents -> (dq, dk, dv) in the input dtypes."""
    b, t_pad, h, _ = q.shape
    s_pad, kh = k.shape[1], k.shape[2]
    bs = plan.blocks
    delta, lse2 = backward_stats(o, do, lse, dlse)
    args = [q, k, v, do, lse2, delta, *_segments(q_seg, kv_seg)]
    static = _static(plan, q, k)
    dk, dv = launch(_KERNELS, "dkdv_kernel", *args,
                    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                    grid=(s_pad // bs.block_k_dkv, b, kh), num_warps=bs.num_warps_dkdv,
                    num_stages=bs.num_stages_dkdv, interpret=plan.interpret, BQ=bs.block_q_dkv, BK=bs.block_k_dkv,
                    **static)
    (dq,) = launch(_KERNELS, "dq_kernel", *args, out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
                   grid=(t_pad // bs.block_q_dq, b, h), num_warps=bs.num_warps_dq, num_stages=bs.num_stages_dq,
                   interpret=plan.interpret, BQ=bs.block_q_dq, BK=bs.block_k_dq, **static)
    return dq, dk, dv
