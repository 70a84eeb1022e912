"""The jitted train step: pure, explicitly sharded, the input state donated.

One step = the strategy's gradient sums over `grad_accum` microbatches (step/accumulate.py), divided by
the step's total token count, then train.optimizer's update (clipping first). A step whose loss or gradient
norm is not finite leaves the parameters and optimizer state untouched and is counted; the host decides when
to give up.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from meshtrain.data import Batch
from meshtrain.precision import update_loss_scale
from meshtrain.sharding import replicated
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.lr_schedules import lr_schedule
from meshtrain.step.state import Setup, TrainState


def make_train_step(setup: Setup) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The jitted step: (state, Batch [A, m, T]) -> (state, metrics). The input state is donated."""
    grad_fn = make_grad_fn(setup)
    schedule = lr_schedule(setup.cfg.train)
    fp16 = setup.cfg.precision.compute == "float16"
    micro_tokens = setup.micro_batch * setup.cfg.data.seq_len

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        # fp16: differentiate loss_scale * (per-token mean loss of a microbatch), the usual scaled
        # objective; scaling the token *sum* would overflow fp16 cotangents. Other dtypes: no scaling.
        mult = state.loss_scale / micro_tokens if fp16 else 1.0
        grad_sum, loss_sum, n_tokens, model_state, logged = grad_fn(state.params, batch, mult, state.model_state)
        grads = jax.tree.map(lambda g: g / (n_tokens * mult), grad_sum)
        logged = {k: v / n_tokens for k, v in logged.items()}
        loss = loss_sum / n_tokens  # the objective, auxiliary losses included
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        # The scope names the fused update's kernels in a profile (meshtrain/profile/trace.py).
        with jax.named_scope("optimizer"):
            updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
            params = keep(optax.apply_updates(state.params, updates), state.params)
            opt_state = keep(opt_state, state.opt_state)
        applied = state.step - state.nonfinite_total  # the optimizer's own count: skipped steps don't move it
        scale, good = state.loss_scale, state.scale_good_steps
        if fp16:
            scale, good = update_loss_scale(scale, good, finite,
                                            growth_interval=setup.cfg.precision.loss_scale_growth_interval)
        # An fp16 overflow while the scale can still halve is the scaler finding its level, not a failing run:
        # skipped, but outside the streak that train.max_nonfinite stops. At scale 1 it counts.
        counts = ~finite & (state.loss_scale <= 1.0) if fp16 else ~finite
        new_state = TrainState(
            step=state.step + 1, params=params, model_state=keep(model_state, state.model_state), opt_state=opt_state,
            nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + counts.astype(state.nonfinite_run.dtype)),
            nonfinite_total=state.nonfinite_total + (~finite).astype(jnp.int32),
            loss_scale=scale, scale_good_steps=good)
        metrics = dict(objective=loss, grad_norm=grad_norm, lr=schedule(applied), finite=finite, tokens=n_tokens,
                       nonfinite_run=new_state.nonfinite_run, loss_scale=scale, **logged)  # logged: loss, moe_*
        return new_state, metrics

    return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, replicated(setup.mesh)), donate_argnums=0)
