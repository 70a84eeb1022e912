"""Next-token cross-entropy, summed over tokens, with the count of tokens that carry a label.

Returning (sum, count) instead of a mean lets gradient accumulation normalize by the total token
count of the whole step, so k microbatches of m equal one batch of k*m exactly.
Logits (the head GEMM's own output), softmax and loss are fp32 whatever the compute dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.precision import Precision
from meshtrain.sharding import ShardingRules

IGNORE = -100  # label value that contributes no loss


def label_count(labels_bt: jax.Array) -> jax.Array:
    """The tokens that carry a label (fp32): the count every loss sum is divided by."""
    return jnp.sum(labels_bt >= 0, dtype=jnp.float32)


def cross_entropy_sum(h_btd: jax.Array, head_dv: jax.Array, labels_bt: jax.Array, *, policy: Precision,
                      rules: ShardingRules, vocab_size: int, impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    n_tokens = label_count(labels_bt)
    if impl == "fused":  # ignored tokens are left out inside the kernel
        from meshtrain.model.kernels import fused_cross_entropy_sum
        return fused_cross_entropy_sum(h_btd, head_dv, labels_bt, vocab_size, rules), n_tokens

    # The GEMM itself returns fp32 (accumulated in fp32, never rounded to the compute dtype): a bf16
    # logit between 16 and 32 is off by up to 1/16, which moves the loss by as much.
    logits_btv = policy.einsum("btd,dv->btv", h_btd, head_dv, site="lm_head", out_dtype=jnp.float32)
    logits_btv = rules.constrain(logits_btv, ("batch", "act_seq", "act_vocab"))
    vocab_ids_v = jnp.arange(logits_btv.shape[-1])
    if logits_btv.shape[-1] != vocab_size:  # columns added to shard the vocabulary evenly over tp
        logits_btv = jnp.where(vocab_ids_v < vocab_size, logits_btv, -jnp.inf)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    # A masked sum instead of a gather keeps the vocab axis sharded: each tp shard reduces its own
    # columns and one all-reduce of [B, T] finishes the job.
    label_logit_bt = jnp.sum(jnp.where(vocab_ids_v == labels_bt[..., None], logits_btv, 0.0), axis=-1)
    loss_bt = jnp.where(labels_bt >= 0, lse_bt - label_logit_bt, 0.0)
    return jnp.sum(loss_bt), n_tokens
