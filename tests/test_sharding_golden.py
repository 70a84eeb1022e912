"""Pins where every parameter, gradient and optimizer moment lives for one reference layout.

A change to the rules table or to a layer's logical names shows up as a diff of the golden file;
regenerate it deliberately with MESHTRAIN_UPDATE_GOLDEN=1 and review the diff. Independently of the
file, no large array of the training state may end up replicated by accident.
"""
import json
import os
from pathlib import Path

import jax

from helpers import make_setup, tiny_config
from meshtrain.step.state import init_state

GOLDEN = Path(__file__).parent / "golden" / "shardings_fsdp4_tp2_zero3.json"
LARGE = 4096  # elements; norm scales are smaller and may stay replicated


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def layout_table(setup) -> dict:
    shapes = flat(jax.eval_shape(lambda: init_state(setup)).params)
    params, grads = flat(setup.state_shardings.params), flat(setup.grad_shardings)
    return {name: {"shape": list(shapes[name].shape), "param": str(params[name].spec), "grad": str(grads[name].spec)}
            for name in params}


def test_param_shardings_match_golden():
    setup = make_setup(tiny_config("mesh.fsdp=4", "mesh.tp=2", "train.zero_stage=3"), 8)
    got = layout_table(setup)
    if os.environ.get("MESHTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(GOLDEN.read_text())


def test_no_large_array_is_replicated():
    for zero in (1, 2, 3):
        setup = make_setup(tiny_config("mesh.fsdp=4", "mesh.tp=2", f"train.zero_stage={zero}"), 8)
        shapes = flat(jax.eval_shape(lambda: init_state(setup)))
        for name, sh in flat(setup.state_shardings).items():
            if shapes[name].size < LARGE:
                continue
            # Weights shard over tp at least; optimizer moments over fsdp from ZeRO-1, weights from ZeRO-3.
            assert any(a is not None for a in sh.spec), f"ZeRO-{zero}: {name} {shapes[name].shape} is replicated"
            if ".opt_state" in name or zero == 3:
                assert "fsdp" in str(sh.spec), f"ZeRO-{zero}: {name} is not sharded over fsdp: {sh.spec}"
        for name, sh in flat(setup.grad_shardings).items():
            if zero >= 2 and shapes[".params" + name].size >= LARGE:
                assert "fsdp" in str(sh.spec), f"ZeRO-{zero}: gradient {name} is not sharded over fsdp"


def test_row_parallel_weights_split_their_leading_dim_where_it_divides():
    """ZeRO-3 splits wo [H, E, D] and w_down [F, D] along their leading dim inside each tp block, so a gather
    or reduce-scatter over fsdp moves whole rows; where that dim does not divide over tp x fsdp (4 heads or a
    width of 100 over 8), along their `embed` dim, as the column-parallel weights are split."""
    cases = {(4, "mesh.fsdp=2", "mesh.tp=2"): ("P(None, ('tp', 'fsdp'), None, None)", "P(None, ('tp', 'fsdp'), None)"),
             (8, "mesh.fsdp=4", "mesh.tp=2"): ("P(None, 'tp', None, 'fsdp')", "P(None, ('tp', 'fsdp'), None)"),
             (8, "mesh.fsdp=8", "model.d_ff=100"): ("P(None, 'tp', None, 'fsdp')", "P(None, 'tp', 'fsdp')")}
    for (n_devices, *overrides), (wo, w_down) in cases.items():
        setup = make_setup(tiny_config(*overrides, "train.zero_stage=3"), n_devices)
        params, grads = flat(setup.state_shardings.params), flat(setup.grad_shardings)
        for name, want in (("['layers']['attn']['wo']", wo), ("['layers']['mlp']['w_down']", w_down)):
            assert str(params[name].spec) == want == str(grads[name].spec), (overrides, name, params[name].spec)
