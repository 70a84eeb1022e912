"""The gradient of one step, summed over its microbatches: the strategy that owns the microbatch loop.

    mesh.pp == 1   a lax.scan over the A microbatches: forward + backward of the whole model per step
                   of the scan, gradients (ZeRO-2/3: reduce-scattered over fsdp) added into one carry
    mesh.pp > 1    the pipeline executor (step/pipeline/): stages run the schedule's F/B/W ops

Both return the same `Accumulated`: sums over every labelled token of the step, which the step then
divides by the token count (so accumulation k × microbatch m equals one batch of k·m).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.data import Batch
from meshtrain.step.loss import Accumulated, GradFn, loss_sum_fn
from meshtrain.step.pipeline.executor import make_pipeline_grad_fn
from meshtrain.step.state import Setup


def make_grad_fn(setup: Setup) -> GradFn:
    """The step's gradient strategy (module docstring).

    The model state's "gradient" is its next value (the fp8 ops return the updated amax histories as
    their cotangent), so it is threaded through the microbatches instead of summed.
    """
    if setup.mesh.shape["pp"] > 1:
        return make_pipeline_grad_fn(setup)
    loss_sum = loss_sum_fn(setup.model)

    def scaled_loss_sum(params, mb, model_state, scale):
        loss, n, logged = loss_sum(params, mb, model_state)
        return loss * scale, (loss, n, logged)  # scale 1.0 (all but fp16) multiplies exactly

    def micro(params, mb, scale, model_state) -> Accumulated:
        (_, (loss, n, logged)), (grads, model_state) = jax.value_and_grad(
            scaled_loss_sum, argnums=(0, 2), has_aux=True)(params, mb, model_state, scale)
        # ZeRO-2/3: gradients leave the backward pass reduce-scattered over fsdp, not all-reduced.
        grads = jax.lax.with_sharding_constraint(grads, setup.grad_shardings)
        return Accumulated(grads, loss, n, model_state, logged)

    def grad_fn(params, batch: Batch, scale=1.0, model_state=None) -> Accumulated:
        model_state = {} if model_state is None else model_state
        if batch.tokens.shape[0] == 1:
            return micro(params, batch.microbatch(0), scale, model_state)

        def body(carry, mb):
            acc, state = carry
            out = micro(params, mb, scale, state)
            return (jax.tree.map(jnp.add, acc, (out.grads, out.loss, out.tokens, out.logged)), out.model_state), None

        logged = jax.eval_shape(loss_sum, params, batch.microbatch(0), model_state)[2]  # names only: traced, not run
        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                 {k: jnp.zeros((), jnp.float32) for k in logged})
        ((grads, loss, n, logged), model_state), _ = jax.lax.scan(body, (zeros, model_state), batch)
        return Accumulated(grads, loss, n, model_state, logged)

    return grad_fn
