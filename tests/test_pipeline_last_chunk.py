"""The pipeline's last chunk and its own remat policy (`pipeline.last_chunk_remat`, config/pipeline.py): the last
chunk runs its forward and backward in one op, so what it keeps never waits in the stash.

What `auto` decides, that the op runs the decided policy (the rerun is in its program, or not), that the memory
estimate counts that chunk's activations under it, the banner line and the config error. That a pipeline with
another policy in its last chunk computes what one device computes is tests/test_pipeline.py's
(`zb_h1-pp2-dp2-tp2-save_dots_attn`, `1f1b-pp4-fsdp2-zero3-full-last-none`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from helpers import make_setup, single_device, tiny_config
from meshtrain.config import ConfigError, validate
from meshtrain.config.pipeline import last_chunk_remat
from meshtrain.planning.layout import Layout
from meshtrain.planning.memory import estimate
from meshtrain.planning.memory_layer import layer_activation_bytes
from meshtrain.resolve import resolve
from meshtrain.step.pipeline.ops import chunk_ops, chunk_weights
from meshtrain.step.pipeline.ticks import B, LAST
from meshtrain.step.state import init_state, make_batches


@pytest.mark.parametrize("train_remat, setting, want", [
    ("none", "auto", "none"),
    ("save_dots", "auto", "none"),
    ("save_dots_attn", "auto", "none"),
    ("full", "auto", "full"),  # chosen to fit memory: kept
    ("save_attn", "auto", "save_attn"),  # reruns the MLP's matmuls: kept
    ("names:qkv", "auto", "names:qkv"),
    ("save_dots_attn+names:attn_in,mlp_in", "auto", "none"),  # a part keeps every matmul output
    ("none", "full", "full"),  # an explicit setting wins
    ("full", "none", "none"),
])
def test_auto_keeps_everything_where_train_remat_reruns_no_matmul(train_remat, setting, want):
    assert last_chunk_remat(setting, train_remat) == want


def test_the_last_chunks_op_runs_its_own_policy():
    """train.remat=full: the last chunk's op reruns each of its layers (a remat in its program) under the model's
    policy, and none with last_remat='none'."""
    setup = make_setup(single_device(tiny_config("model.n_layers=4", "train.remat=full")), 1)
    params = init_state(setup).params
    layers = chunk_weights(setup.model, jax.tree.map(lambda a: a[:2], params["layers"]), 2)
    shared = {name: sub for name, sub in params.items() if name != "layers"}
    mb = jax.tree.map(lambda a: a[0], make_batches(setup).batch(0))
    x = jnp.zeros((*mb.tokens.shape, setup.cfg.model.d_model))

    def reruns(last_remat):
        op = chunk_ops(setup.model, 2, False, (layers, x, mb), last_remat=last_remat)[0][B, LAST]
        return str(jax.make_jaxpr(op)(layers, shared, x, x, mb, jnp.float32(1), [], None)).count("remat")

    assert reruns(None) == 2  # one per layer of the chunk
    assert reruns("none") == 0


def test_the_memory_estimate_counts_the_last_chunk_under_its_policy():
    """A recomputing policy counts as the rest of the stage's; kept whole, the chunk counts what XLA keeps of one
    computation's forward for its backward: the matmul and attention outputs (memory.py)."""
    over = ["model.n_layers=4", "mesh.pp=2", "mesh.fsdp=1", "train.grad_accum=4", "train.remat=full"]
    lay = Layout.of(tiny_config(*over))

    def activations(last):
        return estimate(tiny_config(*over, f"pipeline.last_chunk_remat={last}"), lay, "flash").activations

    def per_layer(remat):
        return layer_activation_bytes(tiny_config(*over), lay, "flash", remat=remat)

    assert per_layer("full") < per_layer("save_dots_attn") < per_layer("none")
    assert activations("save_dots_attn") - activations("full") == pytest.approx(
        2 * (per_layer("save_dots_attn") - per_layer("full")))  # the chunk's two layers
    assert activations("none") == activations("save_dots_attn")


def test_the_banner_names_the_last_chunks_policy():
    cfg = tiny_config("model.n_layers=4", "mesh.pp=2", "mesh.fsdp=1", "train.grad_accum=4", "train.remat=save_dots")
    exe = resolve(cfg, validate(cfg, 2), "cpu")
    assert exe.pipeline.last_chunk_remat == "none"
    assert "last chunk remat none" in exe.describe()


def test_a_misspelled_policy_is_one_config_error_naming_the_field():
    cfg = tiny_config("model.n_layers=4", "mesh.pp=2", "mesh.fsdp=1", "train.grad_accum=4",
                      "pipeline.last_chunk_remat=save_dot")
    with pytest.raises(ConfigError) as err:
        validate(cfg, 2)
    lines = [line for line in str(err.value).splitlines() if "pipeline.last_chunk_remat" in line]
    assert len(lines) == 1 and "'save_dot'" in lines[0] and "auto, none, full" in lines[0], str(err.value)
