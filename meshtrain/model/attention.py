"""Causal grouped-query attention: the one dispatch point for every implementation.

All implementations take q [B, T, H, E] and k, v [B, S, K, E] with H % K == 0 (each kv head serves
H/K query heads) and return o [B, T, H, E] in q's dtype:

  reference  jnp einsums, fp32 scores and softmax; runs anywhere, the numerical yardstick
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"): fused flash attention on NVIDIA GPUs
  pallas     pallas_kernels.flash_attention (Pallas GPU kernel; interpret mode on CPU)
  auto       cudnn on a GPU with bf16/fp16 inputs (measured fastest: docs/PERFORMANCE.md), else reference
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.sharding import ShardingRules

IMPLEMENTATIONS = ("auto", "reference", "cudnn", "pallas")


def resolve(impl: str, dtype: jnp.dtype) -> str:
    if impl != "auto":
        return impl
    fused_ok = jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
    return "cudnn" if fused_ok else "reference"


def attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, *, impl: str,
              rules: ShardingRules) -> jax.Array:
    impl = resolve(impl, q_bthe.dtype)
    if impl == "reference":
        return reference_attention(q_bthe, k_bske, v_bske)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q_bthe, k_bske, v_bske, is_causal=True, implementation="cudnn")
    if impl == "pallas":
        from meshtrain.model.kernels import pallas_attention
        return pallas_attention(q_bthe, k_bske, v_bske, rules)
    raise ValueError(f"model.attention={impl!r}: must be one of {', '.join(IMPLEMENTATIONS)}")


def reference_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array) -> jax.Array:
    """Causal softmax attention in fp32; the mask is bottom-right aligned when T != S."""
    _, t, h, e = q_bthe.shape
    s, kv = k_bske.shape[1], k_bske.shape[2]
    # Repeat kv heads to query heads. (A [K, H/K] reshape of a tp-sharded head axis would make the
    # compiler split the tp axis in two; the repeat keeps the head axis whole and shardable.)
    k_bshe = jnp.repeat(k_bske, h // kv, axis=2)
    v_bshe = jnp.repeat(v_bske, h // kv, axis=2)
    # fp32 inputs get full-precision products (no TF32), matching the dense layers' policy.
    precision = jax.lax.Precision.HIGHEST if q_bthe.dtype == jnp.float32 else None
    scores_bhts = jnp.einsum("bthe,bshe->bhts", q_bthe, k_bshe, precision=precision,
                             preferred_element_type=jnp.float32)
    scores_bhts = scores_bhts * (e ** -0.5)
    visible_ts = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
    # A finite fill keeps rows that see no key (T > S) free of NaN in value and gradient.
    scores_bhts = jnp.where(visible_ts, scores_bhts, jnp.finfo(jnp.float32).min)
    probs_bhts = jnp.where(visible_ts, jax.nn.softmax(scores_bhts, axis=-1), 0.0)
    out_bthe = jnp.einsum("bhts,bshe->bthe", probs_bhts.astype(v_bske.dtype), v_bshe, precision=precision,
                          preferred_element_type=jnp.float32)
    return out_bthe.astype(q_bthe.dtype)
