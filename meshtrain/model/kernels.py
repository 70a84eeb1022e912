"""The Pallas kernels (pallas_kernels/) as model building blocks: each call runs shard-locally.

`model.attention=pallas`, `model.norm=pallas` and `model.loss=fused` route here, and cuDNN attention
inside a pipeline stage. On a CPU the same
kernels run interpreted (Triton's interpreter; slow, for tests): the caller passes the Execution's `interpret`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from meshtrain.parallel.shard_local import shard_local, tp_shard_kv_head
from meshtrain.sharding import HEAD_IN, KV, Q, RESIDUAL, SEQ, ShardingRules


def pallas_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, segment_ids_bt: jax.Array | None,
                     rules: ShardingRules, backend: str, interpret: bool) -> jax.Array:
    """Causal flash attention on each device's shard; segment ids (if given) mask documents. backend:
    the kernels (mosaic or triton, as the Execution decided)."""
    def flash(q, k, v, seg):
        return pk.flash_attention(q, k, v, causal=True, segment_ids=seg, interpret=interpret, backend=backend)

    return per_shard_attention(flash, q_bthe, k_bske, v_bske, segment_ids_bt, rules)


def cudnn_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, rules: ShardingRules) -> jax.Array:
    """cuDNN's fused attention on each device's shard. Inside a pipeline stage (a region manual over pp)
    its partitioning rule does not apply, so the stage calls it per shard, as it calls the Pallas kernels."""
    def cudnn(q, k, v, seg):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    return per_shard_attention(cudnn, q_bthe, k_bske, v_bske, None, rules)


def per_shard_attention(attend, q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array,
                        segment_ids_bt: jax.Array | None, rules: ShardingRules) -> jax.Array:
    """attend(q, k, v, segment ids or None) on each device's shard of q [B, T, H, E] and k, v [B, S, K, E]."""
    h, kv = q_bthe.shape[2], k_bske.shape[2]
    tp = rules.mesh.shape["tp"]
    kv_split = kv % tp == 0  # otherwise every tp shard holds all kv heads (replicated, Megatron style)

    def local(q, k, v, *seg):
        if not kv_split and tp > 1:
            k, v = tp_shard_kv_head(k, h, tp), tp_shard_kv_head(v, h, tp)
        return attend(q, k, v, seg[0] if seg else None)

    if segment_ids_bt is None:
        return shard_local(local, rules, (Q, KV, KV), Q)(q_bthe, k_bske, v_bske)
    return shard_local(local, rules, (Q, KV, KV, SEQ), Q)(q_bthe, k_bske, v_bske, segment_ids_bt)


def pallas_rms_norm(x_btd: jax.Array, scale_d: jax.Array, eps: float, out_dtype: jnp.dtype,
                    rules: ShardingRules, interpret: bool) -> jax.Array:
    def local(x, w):
        return pk.rms_norm(x.astype(out_dtype), w, eps=eps, interpret=interpret)

    return shard_local(local, rules, (RESIDUAL, (None,)), RESIDUAL)(x_btd, scale_d)


def fused_cross_entropy_sum(h_btd: jax.Array, head_dv: jax.Array, labels_bt: jax.Array, vocab_size: int,
                            rules: ShardingRules) -> jax.Array:
    """The loss summed over labelled tokens (fp32 scalar) without materializing the [B, T, V] logits.

    Each device sums its own tokens' losses, the gradient made in the forward (pallas_kernels.cross_entropy_sum);
    its sum comes out as a [1, 1] block of a [batch shards, sequence shards] array, which the caller's sum
    finishes. The kernel needs the whole vocabulary for its logsumexp, so a tp-sharded head is gathered (one
    [D, V] copy per device); cast first, so that a ZeRO-3 gather moves the compute dtype.
    """
    def local(h, w, labels):
        b, t, d = h.shape
        loss = pk.linear_cross_entropy_sum(h.reshape(b * t, d), w, labels.reshape(b * t), vocab_size=vocab_size)
        return loss.reshape(1, 1)

    head_dv = head_dv.astype(h_btd.dtype)
    return jnp.sum(shard_local(local, rules, (HEAD_IN, (None, None), SEQ), SEQ)(h_btd, head_dv, labels_bt))
