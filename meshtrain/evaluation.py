"""Held-out loss: the training loss function, summed over `eval.batches` fixed batches, no gradients.

The eval batches are a pure function of (seed, i) like the training ones, and the same at every
evaluation (data.eval_path, the data.eval_fraction end of data.path, or the synthetic corpus's own
eval stream), so successive eval losses are comparable. Loss is the mean over labelled tokens
(exactly the training objective); perplexity is its exponential.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from meshtrain.data import Batch, Batches
from meshtrain.sharding import replicated
from meshtrain.step.loss import loss_sum_fn
from meshtrain.step.state import Setup


def make_eval_step(setup: Setup) -> Callable[[Any, Batch], tuple[jax.Array, jax.Array]]:
    """(params, the layer stack in the state's order; Batch [A, m, T]) -> (loss summed over labelled tokens, their
    count), jitted."""
    loss_sum = loss_sum_fn(setup.model)

    def step(params, batch: Batch):
        params = setup.to_model_order(params)  # the model runs its layers by depth (step/pipeline/layout.py)
        def body(acc, mb):
            _, n, logged = loss_sum(params, mb)  # the cross-entropy, not the objective with MoE's aux losses
            return (acc[0] + logged["loss"], acc[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (loss, n), _ = jax.lax.scan(body, (zero, zero), batch)
        return loss, n

    return jax.jit(step, in_shardings=(setup.state_shardings.params, setup.batch_sharding),
                   out_shardings=replicated(setup.mesh))


def evaluate(eval_step: Callable, params: Any, batches: Batches, n_batches: int) -> dict[str, float]:
    """{eval_loss, eval_ppl, eval_tokens, eval_s} over batches 0..n_batches-1 (one host sync at the end)."""
    start = time.perf_counter()
    sums = [eval_step(params, batches.batch(i)) for i in range(n_batches)]
    loss_sum = sum(float(loss) for loss, _ in jax.device_get(sums))
    tokens = sum(float(n) for _, n in jax.device_get(sums))
    loss = loss_sum / max(tokens, 1.0)
    return dict(eval_loss=loss, eval_ppl=math.exp(min(loss, 700.0)), eval_tokens=int(tokens),
                eval_s=time.perf_counter() - start)
