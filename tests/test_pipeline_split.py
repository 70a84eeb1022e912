"""The split backward of the zero-bubble schedules: B leaves the tapped sites' weight gradients to W, and W
computes them from what F and B kept, one matmul per site, without pulling back through the chunk again.

On one device, a middle chunk of the tiny fp32 model: the split B's and W's gradients add up to the unsplit B's
(1e-5 of each tensor's largest entry: one matmul's reduction order against the pullback's), W's share is the
site weights and nothing else, the compiled W holds one dot per site, and the memory estimate counts what the
stash keeps for W. The last chunk (its forward, head and loss run in its B) likewise.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from helpers import flatten, make_setup, single_device, tiny_config
from meshtrain.config import MATMUL_SITES
from meshtrain.planning.layout import Layout
from meshtrain.planning.memory_layer import tapped_site_bytes
from meshtrain.step.pipeline.ops import Stash, chunk_ops, chunk_weights
from meshtrain.step.pipeline.ticks import B, F, LAST, MID, W
from meshtrain.step.state import init_state, make_batches

LAYER_SITES = sorted(site for site in MATMUL_SITES if site.split(".")[0] in ("attn", "mlp"))


def test_split_backward_adds_up_to_the_pullback_and_w_is_one_matmul_per_site():
    setup = make_setup(single_device(tiny_config("model.n_layers=4")), 1)
    layers = chunk_weights(setup.model, jax.tree.map(lambda a: a[:2], init_state(setup).params["layers"]), 2)
    mb = jax.tree.map(lambda a: a[0], make_batches(setup).batch(0))
    b, t = mb.tokens.shape
    key_x, key_dy = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (b, t, setup.cfg.model.d_model))
    dy = jax.random.normal(key_dy, x.shape)
    scale = jnp.float32(1.0)

    def ops(split):  # jitted, as the executor runs them (the stash leaves out the weights the trace passes in)
        return {key: jax.jit(op) for key, op in chunk_ops(setup.model, 2, split, (layers, x, mb))[0].items()}

    whole, split = ops(False), ops(True)
    kept = whole[F, MID](layers, {}, x, None, mb, scale, [], None).kept
    want = whole[B, MID](layers, {}, None, dy, mb, scale, kept, None)

    filled = split[F, MID](layers, {}, x, None, mb, scale, [], None).kept
    b_out = split[B, MID](layers, {}, None, dy, mb, scale, filled, None)
    filled = Stash.written(filled, b_out.kept)
    w_out = split[W, MID](layers, {}, None, None, mb, scale, filled, None)

    np.testing.assert_allclose(b_out.message, want.message, rtol=1e-6, atol=1e-6)
    total = jax.tree.map(jnp.add, b_out.d_layers, w_out.d_layers)
    for name, g in flatten(want.d_layers).items():
        got = flatten(total)[name]
        np.testing.assert_allclose(got, g, atol=1e-5 * float(np.abs(g).max()), err_msg=name)
    # W makes exactly the site weights' gradients, B everything else (the norms' scales).
    for name, g in flatten(w_out.d_layers).items():
        is_site = any(name.endswith(site.replace(".", "/")) for site in LAYER_SITES)
        assert bool(np.any(g != 0)) == is_site, name
        assert bool(np.any(flatten(b_out.d_layers)[name] != 0)) != is_site, name

    # One dot per site and layer (the chunk's two layers run one by one): nothing is pulled back again.
    w_hlo = jax.jit(lambda kept: split[W, MID](layers, {}, None, None, mb, scale, kept, None)).lower(
        filled).compile().as_text()
    assert len(re.findall(r"= \S+ dot\(", w_hlo)) == 2 * len(LAYER_SITES), LAYER_SITES


def test_the_last_chunks_split_backward_adds_up_to_its_whole_backward():
    """Split, the last chunk's B returns the loss, the input gradient and the shared parameters' gradients as the
    unsplit one does, leaves its sites' inputs and output gradients in its stash slot, and its W makes exactly the
    site weights' gradients, which its B leaves out (ZB-H1 defers that W: ticks.py)."""
    setup = make_setup(single_device(tiny_config("model.n_layers=4")), 1)
    params = init_state(setup).params
    shared = {name: sub for name, sub in params.items() if name != "layers"}
    layers = chunk_weights(setup.model, jax.tree.map(lambda a: a[2:], params["layers"]), 2)
    mb = jax.tree.map(lambda a: a[0], make_batches(setup).batch(0))
    x = jax.random.normal(jax.random.key(0), (*mb.tokens.shape, setup.cfg.model.d_model))
    scale = jnp.float32(1.0)
    whole = {key: jax.jit(op) for key, op in chunk_ops(setup.model, 2, False, (layers, x, mb))[0].items()}
    split_ops, stash, _ = chunk_ops(setup.model, 2, True, (layers, x, mb))
    split = {key: jax.jit(op) for key, op in split_ops.items()}

    want = whole[B, LAST](layers, shared, x, None, mb, scale, [], None)
    empty = [jnp.zeros(a.shape, a.dtype) for a in stash.buffers]
    b_out = split[B, LAST](layers, shared, x, None, mb, scale, empty, None)
    filled = Stash.written(empty, b_out.kept)
    w_out = split[W, LAST](layers, shared, None, None, mb, scale, filled, None)

    assert float(b_out.loss) == float(want.loss) and float(b_out.count) == float(want.count)
    np.testing.assert_allclose(b_out.message, want.message, rtol=1e-6, atol=1e-6)
    for name, g in flatten(want.d_shared).items():
        np.testing.assert_allclose(flatten(b_out.d_shared)[name], g, atol=1e-6 * float(np.abs(g).max()), err_msg=name)
    total = jax.tree.map(jnp.add, b_out.d_layers, w_out.d_layers)
    for name, g in flatten(want.d_layers).items():
        np.testing.assert_allclose(flatten(total)[name], g, atol=1e-5 * float(np.abs(g).max()), err_msg=name)
        is_site = any(name.endswith(site.replace(".", "/")) for site in LAYER_SITES)
        assert bool(np.any(flatten(w_out.d_layers)[name] != 0)) == is_site, name
        assert bool(np.any(flatten(b_out.d_layers)[name] != 0)) != is_site, name


def test_the_memory_estimate_counts_what_the_stash_keeps_for_w():
    setup = make_setup(single_device(tiny_config("model.n_layers=4")), 1)
    layers = chunk_weights(setup.model, jax.tree.map(lambda a: a[:2], init_state(setup).params["layers"]), 2)
    mb = jax.tree.map(lambda a: a[0], make_batches(setup).batch(0))
    x = jax.ShapeDtypeStruct((*mb.tokens.shape, setup.cfg.model.d_model), jnp.float32)
    stash = chunk_ops(setup.model, 2, True, (layers, x, mb))[1]
    kept = jax.tree.leaves((stash.inputs, stash.grads))
    assert len(kept) == 2 * (4 + len(LAYER_SITES))  # per layer: the four distinct site inputs, a gradient per site
    per_layer = sum(a.size * a.dtype.itemsize for a in kept) / 2
    assert tapped_site_bytes(setup.cfg, Layout.of(setup.cfg)) == per_layer
