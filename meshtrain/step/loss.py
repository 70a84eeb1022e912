"""The loss of one microbatch, assembled in one place for every strategy (the scan and the pipeline).

    objective = cross-entropy summed over labelled tokens + n · Σ auxiliary losses

Auxiliary losses (MoE load balance, router z-loss) come from the model's `losses` collection, the one
loss channel: each is a per-token mean, so it enters the microbatch's sum weighted by its token count
n. The `metrics` collection is logged beside the loss, token-weighted the same way, so that the step's
division by the total token count turns every logged sum into a per-token mean.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from meshtrain.data import Batch
from meshtrain.model.layers import FP8_META
from meshtrain.model.loss import cross_entropy_sum
from meshtrain.model.moe import LOSSES, METRICS
from meshtrain.model.transformer import Decoder
from meshtrain.precision import cast_sites

# (params, one microbatch [B, T] each field, model_state) -> (objective sum, token count, sums to log)
LossSum = Callable[[Any, Batch, Any], tuple[jax.Array, jax.Array, dict]]


class Accumulated(NamedTuple):
    """What a step strategy (step/accumulate.py) returns for one step's batch: sums over its microbatches."""

    grads: Any  # params-shaped: the gradient of scale · objective
    loss: jax.Array  # the objective (auxiliary losses included) summed over labelled tokens
    tokens: jax.Array  # the labelled token count
    model_state: Any  # the next model state (fp8 amax histories), threaded through the microbatches
    logged: dict  # token-weighted sums to log: `loss` the cross-entropy, the model's sown metrics


# (params, Batch [A, m, T], scale=1.0, model_state={}) -> Accumulated
GradFn = Callable[..., Accumulated]


def cross_entropy(model: Decoder, h_btd: jax.Array, head_dv: jax.Array, targets_bt: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy summed over labelled tokens, their count) of the final hidden states under the head."""
    return cross_entropy_sum(h_btd, head_dv, targets_bt, policy=model.policy, rules=model.rules,
                             vocab_size=model.cfg.vocab_size, impl=model.exe.loss)


def objective(ce: jax.Array, n: jax.Array, sown: dict) -> tuple[jax.Array, dict]:
    """(the objective summed over the microbatch's tokens, token-weighted sums to log) from its
    cross-entropy sum, token count and the collections the model sowed."""
    logged = {"loss": ce} | {k: v * n for k, v in sown_means(sown.get(METRICS, {})).items()}
    return ce + aux_loss(sown) * n, logged


def aux_loss(sown: dict) -> jax.Array:
    """The sown auxiliary losses, summed (each already a per-token mean times its coefficient)."""
    return sum((jnp.sum(x) for x in jax.tree.leaves(sown.get(LOSSES, {}))), jnp.zeros((), jnp.float32))


def sown_sums(tree: Any) -> dict[str, tuple[jax.Array, int]]:
    """A sown collection -> {name: (sum over every layer that sowed it, how many layers did)}."""
    groups: dict[str, list[Any]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
        groups.setdefault(name, []).append(leaf)
    return {k: (sum((jnp.sum(x) for x in v), jnp.zeros((), jnp.float32)), sum(int(x.size) for x in v))
            for k, v in groups.items()}


def sown_means(tree: Any) -> dict[str, jax.Array]:
    """A sown collection -> {name: mean over every layer that sowed it}."""
    return {k: total / count for k, (total, count) in sown_sums(tree).items()}


def site_weights(model: Decoder, params: Any, fp8_meta: Any = None) -> Any:
    """The params as the model's matmul sites read them, made once, outside the rematerialized blocks: where a
    microbatch's loss starts, or a pipeline stage's step (step/pipeline/ops.py chunk_weights). The bf16 sites'
    weights in the compute dtype, the fp8 ones quantized (precision.cast_sites), except under tp's rings, which
    move the weights themselves: their fp8 sites quantize inside."""
    return cast_sites(model.policy, params, fp8_meta, quantize_fp8=not model.exe.tp_ring)


def loss_sum_fn(model: Decoder) -> LossSum:
    """The whole model's loss of one microbatch: (params, mb, model_state) -> (objective sum, labelled
    token count, token-weighted sums to log: `loss` the cross-entropy, and the model's sown metrics)."""

    def loss_sum(params, mb: Batch, model_state=None):
        model_state = model_state or {}
        variables = {"params": site_weights(model, params, model_state.get(FP8_META)), **model_state}
        (h_btd, head_dv), sown = model.apply(variables, mb.tokens, mb.positions, mb.segment_ids,
                                             mutable=(LOSSES, METRICS))
        ce, n = cross_entropy(model, h_btd, head_dv, mb.targets)
        total, logged = objective(ce, n, sown)
        return total, n, logged

    return loss_sum
