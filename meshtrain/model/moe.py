"""Mixture-of-experts FFN: an fp32 router picks top-k of X SwiGLU experts per token; shared experts
(if any) see every token. Shapes: B batch, T sequence, D model, X experts, K top-k, F expert ffn.

    x [B, T, D] ─┬─ router (fp32) ─> logits [B, T, X] ─> top-k: experts [B, T, K], weights [B, T, K]
                 ├─ routed experts (parallel/expert.py: all-to-all over ep, grouped matmuls)
                 └─ shared experts (a dense SwiGLU n_shared·F wide)          y = routed + shared

Routers: `softmax` probabilities or `sigmoid` per-expert scores (DeepSeek-V3). The top-k weights are
those values as they are (moe.top_k_weights=scores: Switch, OLMoE) or normalized to sum to 1 (normalized:
Mixtral, DeepSeek-V3; for softmax the same as a softmax over the top-k logits); auto: scores for softmax,
normalized for sigmoid.

Auxiliary losses go to the step through the one loss channel: the `losses` collection holds terms
already multiplied by their coefficients (the step adds them all); the `metrics` collection holds the
raw values for the logs. Both are per-token means over the whole (global) microbatch:
  aux_loss   X · Σ_x f_x · p_x, f_x the share of the N·K assignments that went to expert x and p_x the
             mean router probability of x (Switch/GShard); 1.0 when perfectly balanced
  z_loss     mean over tokens of logsumexp(logits)² (ST-MoE), keeps router logits small
  dropped    share of assignments that overflowed their expert's capacity (0 when dropless)
  load_max   the busiest expert's assignments over the mean per expert (1.0 = even load)
"""
from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain.config import ModelConfig, MoEConfig
from meshtrain.model.layers import SwiGLU, param, scaled_normal
from meshtrain.parallel.expert import W_IN, W_OUT, moe_ffn
from meshtrain.precision import Precision
from meshtrain.sharding import ShardingRules

LOSSES, METRICS = "losses", "metrics"  # the collections the step reads (train_step.SOWN)


def route(x_btd: jax.Array, w_router_dx: jax.Array, moe: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array,
                                                                               jax.Array]:
    """fp32 routing: (logits [B, T, X], probabilities [B, T, X], experts [B, T, K] int32, weights [B, T, K]).

    `probabilities` sum to 1 per token (the softmax, or the normalized sigmoid scores); they feed the
    load-balancing loss."""
    logits_btx = jnp.einsum("btd,dx->btx", x_btd.astype(jnp.float32), w_router_dx.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
    if moe.router == "softmax":
        probs_btx = jax.nn.softmax(logits_btx, axis=-1)
        weights_btk, experts_btk = jax.lax.top_k(probs_btx, moe.top_k)
    else:
        scores_btx = jax.nn.sigmoid(logits_btx)
        weights_btk, experts_btk = jax.lax.top_k(scores_btx, moe.top_k)
        probs_btx = scores_btx / jnp.sum(scores_btx, axis=-1, keepdims=True)
    if moe.normalize_top_k:
        weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
    return logits_btx, probs_btx, experts_btk.astype(jnp.int32), weights_btk


def router_stats(logits_btx: jax.Array, probs_btx: jax.Array, experts_btk: jax.Array,
                 kept_btk: jax.Array) -> dict[str, jax.Array]:
    """The module docstring's aux_loss, z_loss, dropped and load_max over all tokens (fp32 scalars)."""
    n_experts = logits_btx.shape[-1]
    counts_x = jnp.sum(jax.nn.one_hot(experts_btk, n_experts, dtype=jnp.float32), axis=(0, 1, 2))
    share_x = counts_x / jnp.sum(counts_x)
    mean_prob_x = jnp.mean(probs_btx, axis=(0, 1))
    z_bt = jax.nn.logsumexp(logits_btx, axis=-1)
    return dict(aux_loss=n_experts * jnp.sum(share_x * mean_prob_x), z_loss=jnp.mean(z_bt * z_bt),
                dropped=jnp.mean(1.0 - kept_btk), load_max=jnp.max(counts_x) / jnp.mean(counts_x))


class MoE(nn.Module):
    cfg: ModelConfig
    moe: MoEConfig
    policy: Precision
    rules: ShardingRules
    out_std: float
    # How the experts run, as the Execution decided (meshtrain/resolve.py): the dropless all-to-all,
    # the grouped GEMMs, and fp32 where XLA:CPU cannot compile the region in bf16.
    exchange: str = "padded"
    gemm: str = "ragged_dot"
    compute_fp32: bool = False

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        c, e, p, r = self.cfg, self.moe, self.policy, self.rules
        d, x, f = c.d_model, e.n_experts, e.expert_ffn(c)
        init = scaled_normal(c.init_std)
        # The router is small and every token reads all of it: replicated over ep.
        w_router_dx = param(self, "router", init, (d, x), ("embed", None), p.param_dtype)
        w_gate_xdf = param(self, "w_gate", init, (x, d, f), W_IN, p.param_dtype)
        w_up_xdf = param(self, "w_up", init, (x, d, f), W_IN, p.param_dtype)
        w_down_xfd = param(self, "w_down", scaled_normal(self.out_std), (x, f, d), W_OUT, p.param_dtype)

        logits_btx, probs_btx, experts_btk, weights_btk = route(x_btd, w_router_dx, e)
        y_btd, kept_btk = moe_ffn(x_btd, experts_btk, weights_btk, w_gate_xdf, w_up_xdf, w_down_xfd, rules=r,
                                  policy=p, capacity_factor=e.capacity_factor, exchange=self.exchange,
                                  grouped_matmul=self.gemm, compute_fp32=self.compute_fp32)
        stats = router_stats(logits_btx, probs_btx, experts_btk, kept_btk)
        self.sow(LOSSES, "moe_aux", e.aux_loss_coef * stats["aux_loss"])
        self.sow(LOSSES, "moe_z", e.z_loss_coef * stats["z_loss"])
        for name, value in stats.items():
            self.sow(METRICS, f"moe_{name}", value)
        if e.n_shared:  # the dense FFN, n_shared experts wide
            shared = SwiGLU(replace(c, d_ff=e.n_shared * f), p, r, self.out_std, name="shared")
            y_btd = y_btd + shared(x_btd)
        return y_btd
