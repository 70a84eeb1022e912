"""fp8 inside pipeline stages. fp8_delayed: each chunk's amax histories travel in its stage's carry and every
microbatch's amaxes are pushed onto them, in order (step/pipeline/executor.py). fp8 (current scaling): the chunks'
weights quantized once a step (below).

Against one device running the same microbatches by the scan. The two differ by design in one thing: the scan's
forward of microbatch i reads histories that already hold microbatch i-1's amaxes, a pipeline runs forwards of
later microbatches before the backwards of earlier ones, so some forwards read histories a few pushes older, and
a scale (a power of two from the history's maximum) can differ by one binade: an fp8 value then rounds
differently, by up to 12%, which no bf16 tolerance absorbs. So the comparison starts from histories whose maximum
the step cannot move (each filled with 4x its largest amax after two one-device steps): every forward of both
runs then reads the same scales, and the gradients agree at bf16 tolerance (the compute dtype). The histories
after the step must equal the scan's: every microbatch's amaxes pushed, in order, is what the pipeline carries.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import first_gradients, flatten, make_setup, model_order_grad_fn, single_device, tiny_config
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step

SMALL = ["model.n_layers=8", "model.d_model=32", "model.d_ff=64", "model.vocab_size=64", "data.seq_len=8",
         "precision.matmul=fp8_delayed", "train.grad_accum=8"]
WARM_STEPS = 2
CASES = {
    "interleaved-v2-pp4-tp2": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "mesh.pp=4",
                               "mesh.fsdp=1", "mesh.tp=2"],
    "dualpipe_v-pp4-tp2": ["pipeline.schedule=dualpipe_v", "pipeline.virtual_stages=2", "mesh.pp=4", "mesh.fsdp=1",
                           "mesh.tp=2"],
}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def reference():
    """One device: the state after WARM_STEPS steps, and there the next batch's loss, gradients (mean over tokens)
    and the histories after it."""
    setup = make_setup(single_device(tiny_config(*SMALL)), 1)
    batches, state, step = make_batches(setup), init_state(setup), make_train_step(setup)
    for i in range(WARM_STEPS):
        state, _ = step(state, batches.batch(i))
    assert np.max(flatten(host(state.model_state))["fp8_meta/layers/attn/wq/x"]) > 0, "the histories are filled"
    held = jax.tree.map(lambda h: np.full_like(h, 4 * np.max(h)), host(state.model_state))  # scales the step keeps
    grads, loss_sum, n, model_state, _ = jax.jit(make_grad_fn(setup))(state.params, batches.batch(WARM_STEPS), 1.0,
                                                                      held)
    return dict(params=host(state.params), model_state=held, loss=float(loss_sum / n),
                grads=jax.tree.map(lambda g: np.asarray(g) / float(n), grads), next_state=host(model_state))


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_delayed_in_the_stages_matches_one_device(case, reference):
    setup = make_setup(tiny_config(*SMALL, *CASES[case]), 8)
    params = jax.device_put(reference["params"], setup.state_shardings.params)
    model_state = jax.device_put(reference["model_state"], setup.state_shardings.model_state)
    grads, loss_sum, n, next_state, _ = model_order_grad_fn(setup)(params, make_batches(setup).batch(WARM_STEPS),
                                                                     1.0, model_state)
    np.testing.assert_allclose(float(loss_sum / n), reference["loss"], rtol=1e-2)
    got, want = flatten(host(grads)), flatten(reference["grads"])
    for name, w in want.items():  # bf16 compute: 2% of each tensor's largest entry
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(got[name] / float(n), w, rtol=2e-2, atol=2e-2 * scale, err_msg=name)
    # Every microbatch's amaxes pushed, in order: the histories after the step are the one device's.
    got_state, want_state = flatten(host(next_state)), flatten(reference["next_state"])
    assert got_state.keys() == want_state.keys()
    for name, w in want_state.items():
        np.testing.assert_allclose(got_state[name], w, rtol=2e-2, err_msg=name)
        assert not np.array_equal(w, flatten(reference["model_state"])[name]), f"{name}: the step must move it"


# Current scaling (`fp8`) in the stages: the chunks' weights are quantized once a step (ops.chunk_weights), each
# activation and gradient per microbatch from its own amax, as the scan does; fp32 compute, so the scales and fp8
# operands are the one device's and the first gradients agree to 1e-5 of each tensor's largest entry (as
# tests/test_precision_model.py's sharded fp8 against one device). interleaved has middle chunks (a B of their own);
# zb_h1 at pp=4 splits their backward, whose W finds no tapped site: every layer site is an fp8 one.
CURRENT = ["model.n_layers=8", "model.d_model=32", "model.d_ff=64", "model.vocab_size=64", "data.seq_len=8",
           "precision.matmul=fp8", "train.grad_accum=8", "train.global_batch=32"]
CURRENT_CASES = {
    "interleaved-v2-pp2-fsdp4": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "mesh.pp=2",
                                 "mesh.fsdp=4"],
    "zb_h1-pp4-fsdp2": ["pipeline.schedule=zb_h1", "mesh.pp=4", "mesh.fsdp=2"],
}


@pytest.mark.parametrize("case", list(CURRENT_CASES))
def test_fp8_in_the_stages_with_weights_quantized_once_matches_one_device(case):
    want = flatten(first_gradients(make_setup(single_device(tiny_config(*CURRENT)), 1)))
    got = flatten(first_gradients(make_setup(tiny_config(*CURRENT, *CURRENT_CASES[case]), 8)))
    assert got.keys() == want.keys()
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        assert scale > 0, name
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
