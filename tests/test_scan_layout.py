"""A checkpoint saved with one `model.scan_layers` read with the other (meshtrain/scan_layout.py): the state's every
`layers` subtree (parameters, Adam's moments, the fp8 histories) moved between [L, ...] leaves and `layer_i`
subtrees, bit for bit, on another mesh too, into a pipeline's stage order, and on the readers' params-only path; a
state that does not stack per layer refused by a config error, the step left where it was. No train step is
compiled: states are made, saved and read back (tests/test_resume.py resumes a run across the change)."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import serialization

from helpers import make_setup, tiny_config
from meshtrain.checkpoint import Checkpointer, abstract_state
from meshtrain.config import ConfigError
from meshtrain.model.transformer import stacked_layers, unrolled_layers
from meshtrain.resume import check_compatible
from meshtrain.scan_layout import Stack
from meshtrain.step.state import abstract_params, init_state

MOE = ["model.n_layers=4", "moe.n_experts=4", "moe.top_k=2", "moe.every=2"]  # two groups of a dense and an MoE layer


def distinct(state):
    """The state with every leaf's values telling its position and its leaf apart (init's moments are zeros)."""
    leaves, tree = jax.tree.flatten(state)
    ramp = lambda i, x: (i + 1) * 1e-3 * np.arange(x.size, dtype=np.float32).reshape(x.shape)  # noqa: E731
    return jax.tree.unflatten(tree, [x + ramp(i, x).astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else x
                                     for i, x in enumerate(leaves)])


def save(directory, overrides, n_devices=8):
    """A distinct state of the config saved as step 3; returns it, on the host, as a state dict."""
    writer = make_setup(tiny_config(*overrides), n_devices)
    state = distinct(init_state(writer))
    ckpt = Checkpointer(str(directory), keep=2, async_save=False)
    ckpt.save(3, state, writer.cfg.to_dict(), writer.layers_order)
    ckpt.wait()
    ckpt.close()
    return serialization.to_state_dict(jax.device_get(state))


def resumed(directory, overrides, n_devices=8):
    """(the state dict a run of this config resumes from, on the host, its setup)."""
    reader = make_setup(tiny_config(*overrides), n_devices)
    ckpt = Checkpointer(str(directory), keep=2, async_save=False)
    try:
        target = abstract_state(reader.state_shardings, jax.eval_shape(lambda: init_state(reader)))
        compatible = lambda saved, s: check_compatible(reader.cfg, saved, ckpt.directory, s)  # noqa: E731
        state, step, _ = ckpt.restore_verified(target, compatible, reader.layers_order, Stack.of(reader.cfg))
    finally:
        ckpt.close()
    assert step == 3
    return serialization.to_state_dict(jax.device_get(state)), reader


def relaid(state_dict, stack: Stack, to_scanned: bool):
    """A state dict's `layers` subtrees moved on the host: the expected values."""
    def move(layers):
        if to_scanned:
            return stacked_layers(layers, stack.n_layers, stack.every, lambda *xs: np.stack(xs))
        return unrolled_layers(layers, stack.n_layers, stack.every)

    def walk(d):
        return {k: move(v) if k == "layers" else walk(v) for k, v in d.items()} if isinstance(d, dict) else d
    return walk(state_dict)


def assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("model", [["precision.matmul=fp8_delayed"], MOE], ids=["dense_fp8_delayed", "moe_groups"])
def test_a_scanned_step_is_read_unrolled_and_back_on_other_meshes(tmp_path, model):
    scanned = [*model, "mesh.fsdp=4", "mesh.tp=2"]
    unrolled = [*model, "model.scan_layers=false", "mesh.fsdp=2", "mesh.tp=2", "mesh.dp=2"]
    saved = save(tmp_path / "a", scanned)
    got, reader = resumed(tmp_path / "a", unrolled)
    assert_same(got, relaid(saved, Stack.of(reader.cfg), to_scanned=False))
    saved = save(tmp_path / "b", unrolled)
    got, reader = resumed(tmp_path / "b", scanned)
    assert_same(got, relaid(saved, Stack.of(reader.cfg), to_scanned=True))


def test_an_interleaved_pipelines_order_to_unrolled_layers_and_back(tmp_path):
    """pp=2 with two chunks per stage keeps the stack in its stages' order: put in the model's before it is split;
    an unrolled step stacked, then moved into the stages' order."""
    pipelined = ["model.n_layers=4", "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2", "pipeline.schedule=interleaved",
                 "pipeline.virtual_stages=2", "train.grad_accum=2"]
    unrolled = ["model.n_layers=4", "model.scan_layers=false", "mesh.fsdp=8"]
    saved = save(tmp_path / "a", pipelined)
    got, reader = resumed(tmp_path / "a", unrolled)
    order = np.asarray(make_setup(tiny_config(*pipelined), 8).layers_order)  # the model's layer at each stored row
    assert not np.array_equal(order, np.arange(len(order)))
    in_model_order = jax.tree.map(lambda x: x[np.argsort(order)], saved["params"]["layers"])
    assert_same(got["params"], relaid({**saved["params"], "layers": in_model_order}, Stack.of(reader.cfg), False))

    saved = save(tmp_path / "b", unrolled)
    got, reader = resumed(tmp_path / "b", pipelined)
    want = relaid(saved, Stack.of(reader.cfg), to_scanned=True)
    for g, w in zip(jax.tree.leaves(got["params"]["layers"]), jax.tree.leaves(want["params"]["layers"])):
        np.testing.assert_array_equal(g, w[order])


def test_the_readers_load_params_into_the_other_layout(tmp_path):
    saved = save(tmp_path, MOE)
    reader = make_setup(tiny_config(*MOE, "model.scan_layers=false"), 4)
    ckpt = Checkpointer(str(tmp_path), keep=2, async_save=False)
    params, step = ckpt.restore_params_verified(3, abstract_params(reader), fall_back=False, stack=Stack.of(reader.cfg))
    ckpt.close()
    assert step == 3
    assert_same(jax.device_get(params), relaid(saved, Stack.of(reader.cfg), to_scanned=False)["params"])


def test_a_state_that_does_not_stack_per_layer_is_a_config_error(tmp_path):
    adafactor = ["train.optimizer=adafactor", "model.d_model=128", "model.d_ff=256"]  # dims Adafactor factors
    save(tmp_path, adafactor)
    with pytest.raises(ConfigError, match=r"model.scan_layers=false: step 3 .* saved with model.scan_layers=true.*"
                                          r"resume with model.scan_layers=true"):
        resumed(tmp_path, [*adafactor, "model.scan_layers=false"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"], "the step stays where it was: it is not damaged"
