"""Pipeline stages over packed documents: pp=2 · fsdp=2 · cp=2 with ZeRO-3 and `data.document_mask` computes what
one device computes with the same documents masked.

As tests/test_pipeline.py does (fp32; losses to rtol 1e-5, first-step gradients to 1e-5 of each tensor's largest
entry), the case's gradient function is evaluated at the parameters a single-device run held before each of its
steps. The reference is that of test_pipeline.py with documents masked, so it is a fixture of its own. The end of
document id is the synthetic corpus's most frequent token at SMALL's vocabulary: a third of the rows start a new
document inside the row, and the reference checks that the mask changes the loss there (so a stage that dropped
the segment ids, or the restarted positions, would show).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import assert_grads_close, make_setup, single_device, tiny_config
from meshtrain.data import Batch, batch_fields
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step
from test_pipeline import N_STEPS, SMALL, host

EOS = 7  # of vocab 64: 25 of the first 4 steps' 512 tokens; 21 of their 64 rows start a new document inside the row
DOCUMENTS = ["data.document_mask=true", f"data.eos_id={EOS}"]
# The ring (parallel.cp_impl's default; its hop a swap within the stage's cp group) carries each K/V block's segment
# ids round the cp ranks.
LAYOUT = ["pipeline.schedule=1f1b", "mesh.pp=2", "mesh.fsdp=2", "mesh.cp=2", "train.zero_stage=3",
          "train.grad_accum=4"]


def mean_loss(grad_fn, params, batch: Batch) -> float:
    _, loss_sum, n, _, _ = grad_fn(params, batch)
    return float(loss_sum / n)


@pytest.fixture(scope="module")
def reference():
    """One device, documents masked: parameters before each of N_STEPS steps, the steps' losses, the first
    gradients (mean over tokens)."""
    setup = make_setup(single_device(tiny_config(*SMALL, *DOCUMENTS)), 1)
    batches, state, step = make_batches(setup), init_state(setup), make_train_step(setup)
    grad_fn = jax.jit(make_grad_fn(setup))
    grads, _, n, _, _ = grad_fn(state.params, batches.batch(0))
    params, losses = [], []
    for i in range(N_STEPS):
        params.append(host(state.params))
        state, metrics = step(state, batches.batch(i))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.1, "the reference must learn, or equal losses prove little"

    # The documents break inside the rows, and masking them changes the loss: the same rows unmasked (one
    # segment, positions 0..T-1, every target), and with only the attention mask dropped (segment ids all 0,
    # positions and ignored targets kept), each differ from the masked loss far beyond the tolerance.
    broken = [int((batches.local_fields(i)["segment_ids"].max(axis=-1) > 0).sum()) for i in range(N_STEPS)]
    assert min(broken) >= 4, f"rows holding a document boundary, per step (of 16): {broken}"
    fields = batches.local_fields(0)
    put = lambda f: Batch(**{k: jax.device_put(v, setup.batch_sharding) for k, v in f.items()})  # noqa: E731
    rows = batches.local_rows(0)
    a, r, t1 = rows.shape
    unmasked = {k: v.reshape(a, r, t1 - 1) for k, v in batch_fields(rows.reshape(a * r, t1)).items()}
    masked = mean_loss(grad_fn, params[0], put(fields))
    np.testing.assert_allclose(masked, losses[0], rtol=1e-6)
    for other in (unmasked, fields | {"segment_ids": np.zeros_like(fields["segment_ids"])}):
        assert abs(mean_loss(grad_fn, params[0], put(other)) - masked) > 1e-3 * masked
    return dict(params=params, losses=losses, grads=jax.tree.map(lambda g: np.asarray(g) / float(n), grads))


def test_pp2_fsdp2_cp2_zero3_with_documents_masked_matches_single_device(reference):
    setup = make_setup(tiny_config(*SMALL, *DOCUMENTS, *LAYOUT), 8)
    assert {a: setup.mesh.shape[a] for a in ("pp", "fsdp", "cp")} == {"pp": 2, "fsdp": 2, "cp": 2}
    assert setup.cfg.train.zero_stage == 3 and setup.cfg.data.document_mask
    grad_fn = jax.jit(make_grad_fn(setup))
    batches = make_batches(setup)
    losses = []
    for i, params in enumerate(reference["params"]):
        params = jax.device_put(params, setup.state_shardings.params)
        grads, loss_sum, n_tokens, _, _ = grad_fn(params, batches.batch(i))
        if i == 0:
            assert_grads_close(jax.tree.map(lambda g: np.asarray(g) / float(n_tokens), grads), reference["grads"])
        losses.append(float(loss_sum / n_tokens))
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
