"""The embedding backwards (model.embedding_grad) against autodiff of a plain fp32 gather.

Every backward must give the fp32 table gradient: the sum, for each id, of the gradient rows of its
tokens, exactly zero for ids absent from the batch. The fp32-accumulating ones (sorted_segment_sum,
onehot) differ from an fp32 scatter only in summation order: 1e-5 of the largest entry. The scatter
baseline accumulates in the compute dtype: in bf16, 2e-2 of the largest entry (DESIGN.md's bf16 ~1e-2,
doubled for up to ~100 additions into one row).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_setup, single_device, tiny_config
from meshtrain.mesh import build_mesh
from meshtrain.model.embedding import EMBEDDING_GRADS, embedding_lookup, sorted_segment_sum
from meshtrain.sharding import make_rules
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import init_state, make_batches

V, D, B, T = 64, 16, 4, 64
FREQUENT = np.array([0, V - 1, 7, 8])  # the ends of the table, and two neighbours
ABSENT = np.arange(41, V - 1)  # never drawn: their rows must stay exactly zero


def skewed_tokens(seed: int) -> np.ndarray:
    """[B, T] ids: 90% from FREQUENT (each repeated ~60 times), the rest spread over [10, 41)."""
    rng = np.random.default_rng(seed)
    rare = rng.integers(10, 41, (B, T))
    return np.where(rng.random((B, T)) < 0.9, rng.choice(FREQUENT, (B, T)), rare).astype(np.int32)


def lookup_and_grad(grad: str, compute: jnp.dtype, table_vd, tokens_bt, w_btd):
    """(x [B, T, D], d(sum(x * w))/d table [V, D]) through the chosen backward."""
    def loss(table_vd):
        x_btd = embedding_lookup(table_vd, tokens_bt, compute_dtype=compute, grad=grad)
        return jnp.sum(x_btd.astype(jnp.float32) * w_btd), x_btd
    (_, x_btd), dtable_vd = jax.jit(jax.value_and_grad(loss, has_aux=True))(table_vd)
    return x_btd, dtable_vd


@pytest.mark.parametrize("compute", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grad", EMBEDDING_GRADS)
def test_matches_fp32_gather_gradient(grad, compute):
    k_table, k_w = jax.random.split(jax.random.key(0))
    table_vd = jax.random.normal(k_table, (V, D), jnp.float32)
    tokens_bt = jnp.asarray(skewed_tokens(1))
    w_btd = jax.random.normal(k_w, (B, T, D), jnp.float32)
    x_btd, dtable_vd = lookup_and_grad(grad, compute, table_vd, tokens_bt, w_btd)

    # Forward: the same gather of the compute-dtype table, bit for bit.
    np.testing.assert_array_equal(x_btd, jnp.take(table_vd.astype(compute), tokens_bt, axis=0))
    # Backward: the cotangent reaching the gather is w rounded to the compute dtype; sum it in fp32.
    g_btd = w_btd.astype(compute).astype(jnp.float32)
    want_vd = jax.grad(lambda t: jnp.sum(jnp.take(t, tokens_bt, axis=0) * g_btd))(table_vd)
    assert dtable_vd.dtype == jnp.float32 and dtable_vd.shape == (V, D)
    scale = float(jnp.max(jnp.abs(want_vd)))
    tol = 2e-2 if (grad == "scatter" and compute == jnp.bfloat16) else 1e-5
    np.testing.assert_allclose(dtable_vd, want_vd, rtol=tol, atol=tol * scale)
    np.testing.assert_array_equal(dtable_vd[ABSENT], 0.0)
    assert np.all(np.abs(np.asarray(dtable_vd)[FREQUENT]) > 0), "the repeated rows must carry gradient"


@pytest.mark.parametrize("grad", ["sorted_segment_sum", "onehot"])
def test_many_repeats_accumulate_in_fp32(grad):
    """8192 bf16 rows of ~1 into one id: a bf16 accumulator stalls at 256 (its spacing there is 2) and
    would be off by >90%; fp32 stays within 1e-4 of the float64 sum (sequential fp32 over 8192 terms)."""
    n = 8192
    tokens_bt = jnp.full((2, n // 2), 3, jnp.int32)
    w_btd = 1.0 + 0.1 * jax.random.normal(jax.random.key(2), (2, n // 2, 4), jnp.float32)
    _, dtable_vd = lookup_and_grad(grad, jnp.bfloat16, jnp.zeros((8, 4)), tokens_bt, w_btd)
    want_d = np.asarray(w_btd.astype(jnp.bfloat16), np.float64).sum(axis=(0, 1))
    np.testing.assert_allclose(dtable_vd[3], want_d, rtol=1e-4)
    np.testing.assert_array_equal(np.delete(np.asarray(dtable_vd), 3, axis=0), 0.0)


def test_sorted_segment_sum_unsorted_input_and_table_ends():
    """The sort is internal: ids in any order, including 0 and V-1, land in their own rows."""
    ids_n = jnp.array([5, 0, 9, 5, 0, 5], jnp.int32)
    g_nd = jnp.arange(12, dtype=jnp.float32).reshape(6, 2) + 1.0  # row i holds (2i+1, 2i+2): order shows
    got = np.asarray(sorted_segment_sum(ids_n, g_nd, 10))
    want = np.zeros((10, 2), np.float32)
    np.add.at(want, np.asarray(ids_n), np.asarray(g_nd))
    np.testing.assert_array_equal(got, want)


# Sequence parallelism splits the tokens over tp as well as the batch over fsdp, so the backward's
# per-shard sorts cut both token dims; fsdp=4, tp=2 is asymmetric so that a swapped split shows.
SHARDED = {"mesh.fsdp": 4, "mesh.tp": 2, "parallel.sequence_parallel": "true", "train.zero_stage": 3}


def loss_and_embedding_grad(setup) -> tuple[float, np.ndarray]:
    """Mean loss and its gradient wrt the embedding table, at the initial parameters, on the first batch."""
    state = init_state(setup)
    grads, loss, n, _, _ = jax.jit(make_grad_fn(setup))(state.params, make_batches(setup).batch(0), 1.0,
                                                        state.model_state)
    return float(loss) / float(n), np.asarray(grads["embedding"]) / float(n)


@pytest.fixture(scope="module")
def single_device_scatter():
    return loss_and_embedding_grad(make_setup(single_device(tiny_config("model.embedding_grad=scatter")), 1))


@pytest.mark.parametrize("grad", EMBEDDING_GRADS)
def test_sharded_model_matches_single_device(grad, single_device_scatter):
    """fp32 compute: under the mesh every backward gives the single-device autodiff loss and embedding
    gradient, to 1e-5 (of the largest entry): only the order of the fp32 sums differs."""
    overrides = [f"{k}={v}" for k, v in SHARDED.items()]
    loss, got = loss_and_embedding_grad(make_setup(tiny_config(f"model.embedding_grad={grad}", *overrides), 8))
    want_loss, want = single_device_scatter
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    scale = float(np.max(np.abs(want)))
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


COLLECTIVE = re.compile(r"\b(f32|bf16|f16)\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all|"
                        r"collective-permute)[-a-z]*\(")


def test_sorted_backward_moves_no_token_rows():
    """The sorts stay within each device's tokens: the only float collectives of the backward reduce
    [V, D] partial tables (split along V) and move pieces of the reduced table into the gradient's
    sharding. A sort over all tokens would gather every token's gradient row instead ([B*T, D] > [V, D])."""
    degrees = dict(pp=1, dp=1, fsdp=4, ep=1, cp=1, sp=1, tp=2)
    rules = make_rules(build_mesh(degrees, jax.devices()[:8]), zero_stage=3, sequence_parallel=True,
                       n_kv_heads=2).params
    tokens_bt = jax.device_put(jnp.asarray(skewed_tokens(3)), rules.sharding(("batch", "act_res_seq")))
    w_btd = jax.device_put(jnp.ones((B, T, D)), rules.sharding(("batch", "act_res_seq", None)))
    table_vd = jax.device_put(jnp.ones((V, D)), rules.sharding(("vocab", "embed")))

    def loss(table_vd, tokens_bt, w_btd):
        x_btd = embedding_lookup(table_vd, tokens_bt, compute_dtype=jnp.bfloat16, grad="sorted_segment_sum",
                                 rules=rules)
        return jnp.sum(x_btd.astype(jnp.float32) * w_btd)

    backward = jax.jit(jax.grad(loss), out_shardings=rules.sharding(("vocab", "embed")))
    hlo = backward.lower(table_vd, tokens_bt, w_btd).compile().as_text()
    found = COLLECTIVE.findall(hlo)
    assert found, "expected the partial tables to be reduced across devices"
    for dtype, dims, kind in found:
        assert kind != "all-gather", (dtype, dims, kind)
        assert np.prod([int(d) for d in dims.split(",")]) <= V * D, (dtype, dims, kind)


@pytest.mark.parametrize("sequence_parallel,zero_stage", [(True, 3), (False, 3), (True, 1)])
def test_partial_tables_are_summed_along_the_vocabulary(sequence_parallel, zero_stage):
    """Under ZeRO-3 (the table's D split over fsdp) the sum of the per-shard tables is split along V
    over fsdp, not left for the compiler to reduce-scatter along D (which makes the scatter write
    D-major); with the table's D whole (ZeRO-1) the compiler's all-reduce is left alone."""
    from meshtrain.model import embedding

    degrees = dict(pp=1, dp=1, fsdp=4, ep=1, cp=1, sp=1, tp=2)
    rules = make_rules(build_mesh(degrees, jax.devices()[:8]), zero_stage=zero_stage,
                       sequence_parallel=sequence_parallel, n_kv_heads=2).params
    tokens_bt = jax.device_put(jnp.asarray(skewed_tokens(4)), rules.sharding(("batch", "act_res_seq")))
    g_btd = jax.device_put(jnp.ones((B, T, D), jnp.bfloat16), rules.sharding(("batch", "act_res_seq", None)))
    sums = jax.jit(lambda t, g: embedding._per_shard_sorted_sums(t, g, V, rules))
    dtable_vd = sums(tokens_bt, g_btd)
    v_split = jax.sharding.NamedSharding(rules.mesh, jax.sharding.PartitionSpec("fsdp", None))
    assert dtable_vd.sharding.is_equivalent_to(v_split, 2) == (zero_stage == 3), dtable_vd.sharding.spec
    want = sorted_segment_sum(jnp.asarray(skewed_tokens(4)).reshape(-1), jnp.ones((B * T, D)), V)
    np.testing.assert_allclose(np.asarray(dtable_vd), np.asarray(want), rtol=1e-6)
