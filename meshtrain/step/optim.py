"""AdamW with linear warmup and cosine decay, global-norm clipping, no decay on norm scales.

The schedule's length is `train.schedule_steps` (default `train.steps`), so a run stopped early and
resumed with a larger `train.steps` keeps the learning rate it would have had.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshtrain.config import TrainConfig


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    # A warmup longer than the whole schedule is cut to it (a short trial run of a long config).
    warmup = min(t.warmup_steps, t.total_schedule_steps)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.total_schedule_steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)
    # Step i trains with the rate at i + 1: the first step already moves (lr/warmup), the last warmup
    # step reaches the peak.
    return lambda count: base(count + 1)


def _decay_mask(params):
    # Norm scales (leaf name "scale") are not decayed; every matrix is.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=_decay_mask,
                        mu_dtype=jnp.bfloat16 if t.adam_mu_dtype == "bfloat16" else None)
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
