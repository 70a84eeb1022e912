"""Explicit positions and segment ids: how packed rows become (tokens, targets, positions, segment
ids), and that with `data.document_mask` no token attends across documents in any attention
implementation that accepts segment ids (a packed row computes what its documents compute alone)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_setup, single_device, tiny_config
from meshtrain.config import ConfigError, validate
from meshtrain.data import batch_fields
from meshtrain.model.loss import IGNORE
from meshtrain.parallel.sequence.zigzag import sequence_order
from meshtrain.step.state import init_state

EOS = 7


def test_fields_without_document_mask_are_one_segment():
    rows = np.arange(2 * 9).reshape(2, 9)
    f = batch_fields(rows)
    np.testing.assert_array_equal(f["tokens"], rows[:, :-1])
    np.testing.assert_array_equal(f["targets"], rows[:, 1:])
    np.testing.assert_array_equal(f["positions"], np.tile(np.arange(8), (2, 1)))
    np.testing.assert_array_equal(f["segment_ids"], np.zeros((2, 8)))


def test_documents_restart_positions_after_eos_and_ignore_the_cross_document_target():
    row = np.array([[3, 4, EOS, 5, 6, 8, EOS, EOS, 9]])  # documents: [3 4 EOS] [5 6 8 EOS] [EOS] [9]
    f = batch_fields(row, document_mask=True, eos_id=EOS)
    np.testing.assert_array_equal(f["segment_ids"][0], [0, 0, 0, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(f["positions"][0], [0, 1, 2, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(f["targets"][0], [4, EOS, IGNORE, 6, 8, EOS, IGNORE, IGNORE])


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_permutes_all_fields_alike(cp):
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 10, size=(3, 17))
    plain = batch_fields(rows, document_mask=True, eos_id=EOS)
    laid = batch_fields(rows, document_mask=True, eos_id=EOS, cp=cp)
    order = sequence_order(16, cp)
    assert sorted(order) == list(range(16)) and not np.array_equal(order, np.arange(16))
    # Rank 0 holds the first and the last chunk.
    chunk = 16 // (2 * cp)
    np.testing.assert_array_equal(order[:2 * chunk], np.r_[0:chunk, 16 - chunk:16])
    for name in plain:
        np.testing.assert_array_equal(laid[name], plain[name][:, order], err_msg=name)


def _hidden(setup, params, tokens, positions, segments):
    h, _ = setup.model.apply({"params": params}, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    return np.asarray(h)


@pytest.mark.parametrize("attention", ["reference", "pallas"])
def test_packed_row_equals_its_documents_alone(attention):
    """Hidden states of a packed row of three documents equal each document run alone: nothing leaks."""
    setup = make_setup(single_device(tiny_config(f"model.attention={attention}", "data.document_mask=true",
                                                 f"data.eos_id={EOS}")), 1)
    params = init_state(setup).params
    docs = [np.array([3, 9, 11, EOS]), np.array([5, 6, 2, 8, 1, EOS]), np.array([12, 4, 4, 13, 9, 3])]
    row = np.concatenate(docs + [[0]])[None, :]  # one extra token: the last target
    f = batch_fields(row, document_mask=True, eos_id=EOS)
    packed = _hidden(setup, params, f["tokens"], f["positions"], f["segment_ids"])
    start = 0
    for doc in docs:
        n = len(doc)
        alone = _hidden(setup, params, doc[None], np.arange(n)[None], np.zeros((1, n), np.int32))
        np.testing.assert_allclose(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    # Without the mask the later documents do see the earlier ones: the check above can fail.
    leaky = _hidden(setup, params, f["tokens"], np.arange(16)[None], np.zeros((1, 16), np.int32))
    assert np.abs(leaky[:, 4:] - packed[:, 4:]).max() > 1e-3


def test_document_mask_config_errors():
    cfg = single_device(tiny_config("data.document_mask=true"))
    with pytest.raises(ConfigError, match=r"data.eos_id=-1: .* set data.eos_id"):
        validate(cfg, 1)
    cfg = single_device(tiny_config("data.document_mask=true", "data.eos_id=3", "model.attention=cudnn"))
    with pytest.raises(ConfigError, match=r"model.attention=cudnn cannot mask documents .* model.attention=pallas"):
        validate(cfg, 1)
