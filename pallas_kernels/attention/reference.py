"""Plain-jnp attention with the exact semantics of `flash_attention`, plus the shared argument checks.

Semantics (both implementations):
  * q [B, T, H, E], k/v [B, S, K, E], H % K == 0; query head h reads kv head h // (H // K).
  * causal masks are bottom-right aligned: query i sees key j iff j <= i + (S - T).
  * segment_ids is either one [B, T] int array (then T must equal S) or a pair
    (q_segment_ids [B, T], kv_segment_ids [B, S]); a query sees a key iff their ids are equal.
  * a query that sees no key returns o = 0 and lse = -inf; its gradients are zero, never NaN.
  * softmax and accumulation in fp32; o in the input dtype, lse [B, H, T] fp32 (natural log).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype

SegmentIds = jax.Array | tuple[jax.Array, jax.Array] | None


def check_attention_args(q, k, v, segment_ids: SegmentIds, sm_scale):
    """Validates shapes/dtypes; returns (q_seg [B,T] | None, kv_seg [B,S] | None, sm_scale)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be rank 4 ([B, T, H, E], [B, S, K, E]); got q.shape={q.shape}, "
            f"k.shape={k.shape}, v.shape={v.shape}")
    b, t, h, e = q.shape
    bk, s, kh, ek = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k.shape={k.shape}, v.shape={v.shape}")
    if bk != b or ek != e:
        raise ValueError(
            f"k/v must be [B={b}, S, K, E={e}] to match q.shape={q.shape}; got k.shape={k.shape}")
    if t < 1 or s < 1:
        raise ValueError(f"sequence lengths must be >= 1; got T={t}, S={s}")
    if kh < 1 or h % kh != 0:
        raise ValueError(f"query heads H={h} must be a multiple of kv heads K={kh} (GQA)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_dtype(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    q_seg = kv_seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    f"segment_ids as a sequence must be (q_segment_ids, kv_segment_ids); got {len(segment_ids)} items")
            q_seg, kv_seg = segment_ids
        else:
            if t != s:
                raise ValueError(
                    f"a single segment_ids array needs T == S (got T={t}, S={s}); pass "
                    f"(q_segment_ids [B, T], kv_segment_ids [B, S]) instead")
            q_seg = kv_seg = segment_ids
        if q_seg.shape != (b, t) or kv_seg.shape != (b, s):
            raise ValueError(
                f"segment ids must be q: [B, T]=({b}, {t}) and kv: [B, S]=({b}, {s}); got "
                f"{q_seg.shape} and {kv_seg.shape}")
        if not (jnp.issubdtype(q_seg.dtype, jnp.integer) and jnp.issubdtype(kv_seg.dtype, jnp.integer)):
            raise ValueError(f"segment ids must be integers; got {q_seg.dtype} and {kv_seg.dtype}")
        q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(e)
    return q_seg, kv_seg, float(sm_scale)


def attention_mask(t: int, s: int, causal: bool, q_seg, kv_seg):
    """Boolean mask broadcastable to [B, 1, 1, T, S] (True = may attend), or None."""
    mask = None
    if causal:
        qi = jnp.arange(t)[:, None]
        kj = jnp.arange(s)[None, :]
        mask = (kj <= qi + (s - t))[None, None, None]
    if q_seg is not None:
        seg = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]
        mask = seg if mask is None else mask & seg
    return mask


def flash_attention_reference(q, k, v, *, causal: bool = True, segment_ids: SegmentIds = None,
                              sm_scale: float | None = None, return_lse: bool = False):
    """Materializes the [B, K, G, T, S] scores in fp32; same contract as `flash_attention`."""
    q_seg, kv_seg, sm_scale = check_attention_args(q, k, v, segment_ids, sm_scale)
    b, t, h, e = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    q_btkge = q.reshape(b, t, kh, g, e).astype(jnp.float32)
    scores = jnp.einsum("btkge,bske->bkgts", q_btkge, k.astype(jnp.float32)) * sm_scale
    mask = attention_mask(t, s, causal, q_seg, kv_seg)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    # The max only shifts the exponent; stop_gradient keeps -inf rows out of the derivative.
    m = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    safe_l = jnp.where(empty, 1.0, l)  # log/divide by 1, not 0: keeps the gradient finite
    o = jnp.einsum("bkgts,bske->btkge", p / safe_l, v.astype(jnp.float32))
    o = o.reshape(b, t, h, e).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(safe_l))[..., 0]  # [B, K, G, T]
    return o, lse.reshape(b, h, t)
