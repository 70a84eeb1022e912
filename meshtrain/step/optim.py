"""The optimizer (train.optimizer), built from optax's own: adamw, adafactor, lion or muon.

Common to all: global-norm clipping first (train.grad_clip), the rate of train.lr_schedule
(step/lr_schedules.py), decoupled weight decay scaled by the rate as in AdamW (p -= lr_t * wd * p) on
every matrix and never on norm scales, and train.adam_mu_dtype for the first moment where there is one.

    adamw      optax.adamw
    adafactor  optax.adafactor: a factored second moment (a row and a column statistic per matrix), no
               first moment. Its update is not multiplied by the parameter's RMS (optax's default
               relative step), so train.lr is an absolute step as for the others.
    lion       optax.lion with b1, b2 = train.b1, train.b2: the sign of an interpolated momentum. Every
               element moves by lr, so Lion usually wants a 3-10x smaller lr than AdamW.
    muon       optax.contrib.muon on the blocks' matrices, the same AdamW as above on the rest (embedding,
               head, norm scales, MoE router): see `muon_dimension_numbers` for the stacked layers.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from meshtrain.config import TrainConfig
from meshtrain.step.lr_schedules import lr_schedule

# Muon's update RMS scaled to 0.2, AdamW's typical RMS (Liu et al. 2025, "Muon is Scalable for LLM
# Training"): train.lr and train.weight_decay then carry over from AdamW unchanged.
MUON_CONSISTENT_RMS = 0.2
# Leading logical axes that index independent matrices: the scanned layer stack, the MoE experts.
MATRIX_BATCH_AXES = ("layers", "experts")
# The logical axes a block's matmul weight is made of; a weight with another axis (vocab, an unnamed one)
# is not one of the blocks' hidden matrices.
MATRIX_AXES = frozenset({"embed", "heads", "kv_heads", "head_dim", "mlp", "o_heads", "o_embed", "down_mlp",
                         "down_embed"})


def make_optimizer(t: TrainConfig, logical: Any) -> optax.GradientTransformation:
    """`logical`: the params tree of logical PartitionSpecs (the model's axis names), which muon reads."""
    schedule = lr_schedule(t)
    mu_dtype = jnp.bfloat16 if t.adam_mu_dtype == "bfloat16" else None
    if t.optimizer == "adamw":
        core = _adamw(t, schedule, mu_dtype)
    elif t.optimizer == "adafactor":
        # optax adds adafactor's decay after the rate is applied: scaling it by the rate here makes it AdamW's.
        core = optax.adafactor(schedule, multiply_by_parameter_scale=False, weight_decay_mask=_decay_mask,
                               weight_decay_rate=lambda count: t.weight_decay * schedule(count))
    elif t.optimizer == "lion":
        core = optax.lion(schedule, b1=t.b1, b2=t.b2, mu_dtype=mu_dtype, weight_decay=t.weight_decay,
                          mask=_decay_mask)
    else:
        core = _muon(t, schedule, mu_dtype, logical)
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), core) if t.grad_clip > 0 else core


def _adamw(t: TrainConfig, schedule: optax.Schedule, mu_dtype) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=_decay_mask, mu_dtype=mu_dtype)


def _decay_mask(params):
    # Norm scales (leaf name "scale") are not decayed; every matrix is.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def _muon(t: TrainConfig, schedule: optax.Schedule, mu_dtype, logical: Any) -> optax.GradientTransformation:
    dims = jax.tree.map(muon_dimension_numbers, logical, is_leaf=lambda x: isinstance(x, P))
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))
    # optax's muon gives the leaves it does not orthogonalize to an AdamW of its own (Nesterov, no decay
    # mask); the partition hands them to ours instead, so they train exactly as under train.optimizer=adamw.
    muon = optax.contrib.muon(schedule, beta=0.95, weight_decay=t.weight_decay, mu_dtype=mu_dtype,
                              muon_weight_dimension_numbers=dims, consistent_rms=MUON_CONSISTENT_RMS)
    return optax.partition({"muon": muon, "adamw": _adamw(t, schedule, mu_dtype)}, labels)


def muon_dimension_numbers(names: P) -> optax.contrib.MuonDimensionNumbers | None:
    """How Muon sees one weight, from its logical axis names; None: not a hidden matrix (AdamW trains it).

    Scanned layers stack every block's weight on a leading `layers` axis ([L, D, F]; MoE experts add
    [L, X, D, F]). Those leading axes are Muon's batch axes: optax vmaps the Newton-Schulz iteration over
    them, so each layer's (and each expert's) matrix is orthogonalized on its own, exactly as an unrolled
    stack would be. Of the axes left, the model's own order says which side is the input: `embed` first
    is a projection out of the residual stream (wq [D, H, E], w_up [D, F]: reduction D, output the rest),
    `o_embed` or `down_embed` last is one back into it (wo [H, E, D], w_down [F, D]: reduction the rest,
    output D). So the attention projections are orthogonalized as whole D x (H*E) matrices, not head by head.
    """
    names = tuple(names)
    n_batch = next((i for i, n in enumerate(names) if n not in MATRIX_BATCH_AXES), len(names))
    rest = names[n_batch:]
    if len(rest) < 2 or not set(rest) <= MATRIX_AXES:
        return None
    axes = tuple(range(n_batch, len(names)))
    if rest[0] == "embed":
        return optax.contrib.MuonDimensionNumbers(reduction_axis=axes[:1], output_axis=axes[1:])
    if rest[-1] in ("o_embed", "down_embed"):
        return optax.contrib.MuonDimensionNumbers(reduction_axis=axes[:-1], output_axis=axes[-1:])
    return None
