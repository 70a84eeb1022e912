"""Causal grouped-query attention: the one dispatch point for every implementation.

All implementations take q [B, T, H, E] and k, v [B, T, K, E] with H % K == 0 (each kv head serves
H/K query heads), the tokens' positions and segment ids [B, T], and return o [B, T, H, E] in q's
dtype. Query t sees key s when both are in the same segment and position[s] <= position[t]:

  reference  jnp einsums, fp32 scores and softmax, masked by positions and segment ids; runs
             anywhere, in any sequence order (the context-parallel layouts), the numerical yardstick
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"): fused flash attention on NVIDIA
             GPUs; index-causal only, so no document masking (it takes no segment ids)
  pallas     pallas_kernels.flash_attention (Pallas GPU kernels; interpret mode on CPU); index-causal
             plus segment ids. model.attention_kernel picks its kernels: Mosaic GPU on Hopper (auto,
             mosaic) or Triton
  auto       decided once, with every other `auto`, by meshtrain/resolve.py (the Execution this
             dispatch reads): on a GPU with bf16/fp16 cudnn (measured fastest, docs/PERFORMANCE.md),
             or pallas when documents are masked or the sequence is split over cp/sp; reference elsewhere

With the sequence split over cp or sp (mesh.cp, mesh.sp > 1) attention runs through
parallel/sequence/ (Ulysses, ring), with the jnp block (reference) or the Pallas kernels (pallas).

cudnn and pallas read the causal mask from the index, which equals the position mask whenever the
sequence is in its natural order: always, outside context parallelism (parallel/ handles that).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.parallel.sequence import context
from meshtrain.resolve import Execution
from meshtrain.sharding import ShardingRules

def attention(q_bthe: jax.Array, k_btke: jax.Array, v_btke: jax.Array, positions_bt: jax.Array,
              segment_ids_bt: jax.Array, *, exe: Execution, document_mask: bool, rules: ShardingRules) -> jax.Array:
    """o [B, T, H, E] by the implementation `exe` decided (module docstring)."""
    impl = exe.attention
    if exe.sequence_sharded:  # sequence split over cp/sp: Ulysses and ring attention
        return context.context_attention(q_bthe, k_btke, v_btke, positions_bt, segment_ids_bt, impl=impl,
                                         document_mask=document_mask, cp_impl=exe.cp_impl, cp_layout=exe.cp_layout,
                                         rules=rules, attention_kernel=exe.attention_kernel,
                                         interpret=exe.interpret)
    if impl == "reference":
        return reference_attention(q_bthe, k_btke, v_btke, positions_bt, segment_ids_bt)
    from meshtrain.model.kernels import cudnn_attention, pallas_attention
    if impl == "cudnn":
        if document_mask:  # validate() refuses this; a direct caller gets the same message
            raise ValueError("model.attention=cudnn cannot mask documents; use model.attention=pallas or auto")
        if rules.mesh.manual_axes:  # a pipeline stage: GSPMD's rule for the cuDNN call does not apply there
            return cudnn_attention(q_bthe, k_btke, v_btke, rules)
        return jax.nn.dot_product_attention(q_bthe, k_btke, v_btke, is_causal=True, implementation="cudnn")
    return pallas_attention(q_bthe, k_btke, v_btke, segment_ids_bt if document_mask else None, rules,
                            exe.attention_kernel, exe.interpret)


def visible_mask(q_positions_bt: jax.Array, q_segment_ids_bt: jax.Array, kv_positions_bs: jax.Array,
                 kv_segment_ids_bs: jax.Array) -> jax.Array:
    """[B, T, S] bool: key s is visible to query t (same segment, not in its future)."""
    same_bts = q_segment_ids_bt[:, :, None] == kv_segment_ids_bs[:, None, :]
    return same_bts & (kv_positions_bs[:, None, :] <= q_positions_bt[:, :, None])


def reference_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, positions_bt: jax.Array,
                        segment_ids_bt: jax.Array) -> jax.Array:
    """Self-attention in fp32, masked by positions and segment ids (any sequence order)."""
    visible_bts = visible_mask(positions_bt, segment_ids_bt, positions_bt, segment_ids_bt)
    out_bthe, _ = masked_attention(q_bthe, k_bske, v_bske, visible_bts)
    return out_bthe.astype(q_bthe.dtype)


def masked_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array,
                     visible_bts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax attention under an explicit mask: (o [B, T, H, E] fp32, lse [B, H, T] fp32).

    A query that sees no key gets o = 0 and lse = -inf, so partial results over key blocks merge by
    log-sum-exp (ring attention) without special cases.
    """
    h, e = q_bthe.shape[2], q_bthe.shape[3]
    kv = k_bske.shape[2]
    # Repeat kv heads to query heads. (A [K, H/K] reshape of a tp-sharded head axis would make the
    # compiler split the tp axis in two; the repeat keeps the head axis whole and shardable.)
    k_bshe = jnp.repeat(k_bske, h // kv, axis=2)
    v_bshe = jnp.repeat(v_bske, h // kv, axis=2)
    # fp32 inputs get full-precision products (no TF32), matching the dense layers' policy.
    precision = jax.lax.Precision.HIGHEST if q_bthe.dtype == jnp.float32 else None
    scores_bhts = jnp.einsum("bthe,bshe->bhts", q_bthe, k_bshe, precision=precision,
                             preferred_element_type=jnp.float32) * (e ** -0.5)
    visible_bhts = visible_bts[:, None, :, :]
    # A finite fill keeps rows that see no key free of NaN in value and gradient.
    scores_bhts = jnp.where(visible_bhts, scores_bhts, jnp.finfo(jnp.float32).min)
    row_max_bht = jax.lax.stop_gradient(jnp.max(scores_bhts, axis=-1))
    exp_bhts = jnp.where(visible_bhts, jnp.exp(scores_bhts - row_max_bht[..., None]), 0.0)
    denom_bht = jnp.sum(exp_bhts, axis=-1)
    any_bht = denom_bht > 0
    probs_bhts = exp_bhts / jnp.where(any_bht, denom_bht, 1.0)[..., None]
    lse_bht = jnp.where(any_bht, row_max_bht + jnp.log(jnp.where(any_bht, denom_bht, 1.0)), -jnp.inf)
    out_bthe = jnp.einsum("bhts,bshe->bthe", probs_bhts.astype(v_bske.dtype), v_bshe, precision=precision,
                          preferred_element_type=jnp.float32)
    return out_bthe, lse_bht
