"""Activation recomputation policies by name (`train.remat`).

The block marks its intermediate values with `checkpoint_name` (see CHECKPOINT_POINTS in config);
a policy says which of them the backward pass keeps instead of recomputing.

  none       keep everything (fastest, most memory)
  full       keep only the block input; recompute the whole block in the backward pass
  save_dots  keep every matmul output without a batch dim (projections), recompute the rest
  save_attn  keep the q/k/v projections and the attention output (attention is the costly part)
  names:a,b  keep exactly the named points
"""
from __future__ import annotations

import jax

from meshtrain.config import CHECKPOINT_POINTS


def remat_policy(name: str):
    """The jax.checkpoint policy for `name`, or None when the block is not rematerialized at all."""
    cp = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if name == "save_attn":
        return cp.save_only_these_names("qkv", "attn_out")
    if name.startswith("names:"):
        points = tuple(name[len("names:"):].split(","))
        unknown = [p for p in points if p not in CHECKPOINT_POINTS]
        if unknown:
            raise ValueError(f"train.remat={name!r}: unknown points {unknown}; known: {CHECKPOINT_POINTS}")
        return cp.save_only_these_names(*points)
    raise ValueError(f"train.remat={name!r}: unknown policy")
