"""parallel/tensor.py: the tp rings equal the plain matmuls, values and gradients, and move
activations only by collective-permutes over tp. (The whole model with parallel.tp_overlap=collective_matmul
against one device is in tests/test_equivalence.py.)

fp32 with HIGHEST precision: the rings only reorder the sums over tp, so 1e-5 relative."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_setup, tiny_config, train_losses
from meshtrain.config import ConfigError, validate
from meshtrain.mesh import build_mesh
from meshtrain.parallel import tensor as cm
from meshtrain.sharding import make_rules

B, T, D, F = 4, 16, 8, 24
HI = jax.lax.Precision.HIGHEST
X_NAMES, H_NAMES = ("batch", "act_res_seq", None), ("batch", "act_seq", "act_mlp")
W_DOWN = ("down_mlp", "down_embed")  # as the model names w_down: ZeRO-3 splits its rows inside each tp block


def rules_for(fsdp: int, tp: int, sequence_parallel: bool = True):
    degrees = dict(pp=1, dp=1, fsdp=fsdp, ep=1, cp=1, sp=1, tp=tp)
    return make_rules(build_mesh(degrees, jax.devices()[:fsdp * tp]), zero_stage=3,
                      sequence_parallel=sequence_parallel, n_kv_heads=tp).params


def inputs(seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    # Values that encode their position, plus noise: a misplaced chunk changes the result.
    x = jnp.arange(B * T * D, dtype=jnp.float32).reshape(B, T, D) / (B * T * D) + jax.random.normal(ks[0], (B, T, D))
    return x, jax.random.normal(ks[1], (D, F)), jax.random.normal(ks[2], (D, F)), jax.random.normal(ks[3], (F, D))


@pytest.mark.parametrize("fsdp,tp", [(2, 4), (4, 2)])
def test_rings_equal_plain_matmuls_and_their_gradients(fsdp, tp):
    rules = rules_for(fsdp, tp)
    x, w1, w2, w_down = inputs()
    put = lambda a, names: jax.device_put(a, rules.sharding(names))  # noqa: E731
    x_s, w1_s, w2_s, wd_s = put(x, X_NAMES), put(w1, ("embed", "mlp")), put(w2, ("embed", "mlp")), put(w_down, W_DOWN)

    def ring(x, w1, w2, w_down):
        def up(x_chunk, ws):
            return [jnp.einsum("btd,df->btf", x_chunk, w, precision=HI) for w in ws]
        a, b = cm.gather_matmuls(x, [w1, w2], [("embed", "mlp")] * 2, [H_NAMES] * 2, up, rules)
        h = jnp.tanh(a) * b
        return cm.matmul_scatter(h, w_down, H_NAMES, W_DOWN,
                                 lambda h_chunk, w: jnp.einsum("btf,fd->btd", h_chunk, w, precision=HI), rules)

    def plain(x, w1, w2, w_down):
        h = jnp.tanh(jnp.einsum("btd,df->btf", x, w1, precision=HI)) * jnp.einsum("btd,df->btf", x, w2, precision=HI)
        return jnp.einsum("btf,fd->btd", h, w_down, precision=HI)

    cotangent = jax.random.normal(jax.random.PRNGKey(9), (B, T, D))
    loss = lambda f: lambda *a: jnp.vdot(f(*a), cotangent)  # noqa: E731
    got, got_grads = jax.jit(jax.value_and_grad(loss(ring), argnums=(0, 1, 2, 3)))(x_s, w1_s, w2_s, wd_s)
    want, want_grads = jax.value_and_grad(loss(plain), argnums=(0, 1, 2, 3))(x, w1, w2, w_down)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(ring)(x_s, w1_s, w2_s, wd_s), plain(x, w1, w2, w_down), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_the_gather_moves_activations_by_permutes_over_tp_only():
    rules = rules_for(2, 4)
    x, w1, _, _ = inputs()
    x_s = jax.device_put(x, rules.sharding(X_NAMES))
    w_s = jax.device_put(w1, rules.sharding(("embed", "mlp")))
    fn = jax.jit(lambda x, w: cm.gather_matmuls(x, [w], [("embed", "mlp")], [H_NAMES],
                                                lambda xc, ws: [xc @ ws[0]], rules)[0])
    hlo = fn.lower(x_s, w_s).compile().as_text()
    permutes = [line for line in hlo.splitlines() if "collective-permute" in line and "source_target_pairs=" in line]
    assert permutes, "expected the chunks of x to travel by collective-permute"
    # The activation itself is never all-gathered: only the (fsdp-sharded) weight may be.
    for line in hlo.splitlines():
        if re.search(r"all-gather[-a-z]*\(", line):
            assert f",{T},{D}]" not in line.split("=")[1].split("all-gather")[0], line  # a whole-sequence x
    mesh_shape = rules.mesh.devices.shape
    tp_dim = rules.mesh.axis_names.index("tp")
    for line in permutes:
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
        assert pairs, line
        for a, b in pairs:
            ca, cb = np.unravel_index(a, mesh_shape), np.unravel_index(b, mesh_shape)
            assert [c for i, c in enumerate(ca) if i != tp_dim] == [c for i, c in enumerate(cb) if i != tp_dim], line


def test_active_only_where_the_sequence_is_split_over_tp():
    assert cm.active("collective_matmul", rules_for(2, 4))
    assert not cm.active("none", rules_for(2, 4))
    assert not cm.active("collective_matmul", rules_for(2, 4, sequence_parallel=False))
    assert not cm.active("collective_matmul", rules_for(8, 1))


@pytest.mark.parametrize("overrides, expected", [
    (["mesh.fsdp=4", "mesh.tp=2"], "needs parallel.sequence_parallel=true"),
    (["mesh.fsdp=2", "mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true"], "mesh.cp=2"),
    (["mesh.fsdp=4", "mesh.tp=2", "parallel.sequence_parallel=true", "precision.matmul=fp8"], "precision.matmul=fp8"),
])
def test_where_the_ring_cannot_run_is_a_config_error(overrides, expected):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(*overrides, "parallel.tp_overlap=collective_matmul"), 8)
    problems = [p for p in err.value.problems if "tp_overlap" in p]
    assert len(problems) == 1 and expected in problems[0] and "parallel.tp_overlap=none" in problems[0], problems


def test_ring_under_remat_and_unrolled_layers_matches_plain_tp():
    """The rings inside rematerialized, unrolled layers (as the GPU configs run them) train like GSPMD's
    tp + SP: fp32 losses over 3 steps to 1e-5."""
    base = ["mesh.fsdp=4", "mesh.tp=2", "parallel.sequence_parallel=true", "train.zero_stage=3",
            "model.scan_layers=false", "train.remat=save_dots"]
    plain = train_losses(make_setup(tiny_config(*base), 8), 3)
    ring = train_losses(make_setup(tiny_config(*base, "parallel.tp_overlap=collective_matmul"), 8), 3)
    np.testing.assert_allclose(ring, plain, rtol=1e-5)
