"""The split backward's weight gradients, from what the matmul sites recorded (model/layers.py `tap_sites`).

A zero-bubble schedule splits a chunk's backward into B (the input gradient, which the previous stage waits
for) and W (the weight gradients, which nobody waits for). Pulling back through the chunk twice would make W
cost as much as B again: a weight's gradient needs its output's gradient, and that flows back through every
layer after it. Instead B pulls back once, with a zero perturbation added to every site's output, and keeps
the perturbations' gradients (each site's dY); F keeps each site's input X. Then W is one matmul per site:

    dW[x..., y...] = Σ over (b, t) of X[b, t, x...] · dY[b, t, y...]

(every site's weight is laid out as its input's feature axes, then its output's), batched over the stacked
layer axis when the chunk scans its layers. B's own gradients then leave out those weights: they are W's.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util


def weight_grad(x: jax.Array, dy: jax.Array, w: jax.Array) -> jax.Array:
    """One site's weight gradient: x [*L, b, T, *in], dy [*L, b, T, *out] -> [*L, *in, *out] like w, in fp32."""
    stacked = x.ndim + dy.ndim - w.ndim - 4  # the leading layer axes the three share
    batch = tuple(range(stacked))
    tokens = (stacked, stacked + 1)
    dw = jax.lax.dot_general(x, dy, ((tokens, tokens), (batch, batch)), preferred_element_type=jnp.float32)
    if dw.shape != w.shape:
        raise AssertionError(f"a site's weight {w.shape} is not its input's features then its output's: {dw.shape}")
    return dw


def site_weight_grads(layers: Any, inputs: Any, grads: Any) -> Any:
    """A gradient shaped like `layers`: each tapped site's weight gradient from its input (`inputs`, named by the
    weights that read it, "wq+wk+wv") and its output's gradient (`grads`, named like the weight); zeros elsewhere
    (B computed those; a quantized fp8 weight's zeros are a QuantizedWeight of them)."""
    grad_of = traverse_util.flatten_dict(grads)
    input_of = {(*path[:-1], name): x for path, x in traverse_util.flatten_dict(inputs).items()
                for name in path[-1].split("+")}
    flat = traverse_util.flatten_dict(layers)
    return traverse_util.unflatten_dict({
        path: weight_grad(input_of[path], grad_of[path], w) if path in grad_of else jax.tree.map(jnp.zeros_like, w)
        for path, w in flat.items()})


def without_site_grads(d_layers: Any, grads: Any) -> Any:
    """The pullback's gradient of `layers` with the tapped sites' weights zeroed: W adds them. The compiler drops
    the pullback's matmuls that computed them."""
    tapped = set(traverse_util.flatten_dict(grads))
    return traverse_util.unflatten_dict({path: jnp.zeros_like(g) if path in tapped else g
                                         for path, g in traverse_util.flatten_dict(d_layers).items()})
