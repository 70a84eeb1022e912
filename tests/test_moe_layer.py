"""The MoE layer against a reference written as a loop over tokens and their chosen experts (fp32):
outputs, router weights, aux statistics and gradients; dropless and with capacity (drops checked
against a hand-worked case). Each case runs on one device and with the experts split over ep=2.

Tolerances: fp32 with HIGHEST-precision matmuls; the layer and the loop sum the same products in a
different order, so they agree to ~1e-6 relative: rtol 1e-5, atol 1e-5 of the largest entry.
"""
from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import all_eqns
from meshtrain.config import MESH_AXES, MoEConfig, build_config
from meshtrain.mesh import build_mesh
from meshtrain.model.moe import METRICS, MoE
from meshtrain.model.remat import remat_policy
from meshtrain.precision import Precision
from meshtrain.sharding import make_rules

POLICY = Precision.from_names("float32")
MOE_FIELDS = ("cfg", "moe", "policy", "rules", "out_std", "exchange", "gemm")
D, X, F = 8, 4, 6


def make_layer(ep: int, tp: int = 1, **moe_fields) -> MoE:
    cfg = build_config({}, ["model.d_model=8", "model.n_heads=2", "model.n_kv_heads=2", "precision.compute=float32"])
    mesh = build_mesh({a: {"ep": ep, "tp": tp}.get(a, 1) for a in MESH_AXES}, jax.devices()[:ep * tp])
    rules = make_rules(mesh, zero_stage=0, sequence_parallel=False, n_kv_heads=2).params
    moe = MoEConfig(**{"n_experts": X, "top_k": 2, "d_ff_expert": F, "dispatch": "padded", **moe_fields})
    gemm = "ragged_dot" if moe.grouped_matmul == "auto" else moe.grouped_matmul  # what resolve picks off a GPU
    return MoE(cfg.model, moe, POLICY, rules, out_std=0.3, exchange=moe.dispatch, gemm=gemm)


def init(layer: MoE, x_btd):
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(1), x_btd)["params"])
    # Larger than the init's 0.02 so that every expert's output and the router's choice matter.
    return jax.tree.map(lambda p: p * 20.0, params)


def apply(layer: MoE, params, x_btd):
    y, sown = layer.apply({"params": params}, x_btd, mutable=[METRICS])
    return y, {k: v[0] for k, v in sown[METRICS].items()}


def assert_close(got, want, err_msg=""):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0, f"{err_msg}: the reference is all zeros; the comparison would prove nothing"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=err_msg)


def swiglu(x_d, p, e):
    h = jax.nn.silu(x_d @ p["w_gate"][e]) * (x_d @ p["w_up"][e])
    return h @ p["w_down"][e]


def loop_reference(params, x_btd, moe: MoEConfig, kept=None, choices=None):
    """y[t] = Σ over t's top-k experts e of weight(t, e) · SwiGLU_e(x[t]), one token and expert at a time.
    `choices` fixes the experts (for differentiating: top-k is piecewise constant)."""
    b, t, _ = x_btd.shape
    xs = x_btd.reshape(b * t, -1)
    ys, weights, chosen = [], [], []
    for i in range(b * t):
        logits = xs[i] @ params["router"]
        if moe.router == "softmax":
            probs = jax.nn.softmax(logits)
            top = choices[i] if choices is not None else np.argsort(-np.asarray(probs), kind="stable")[: moe.top_k]
            w = [probs[e] for e in top]
        else:
            scores = jax.nn.sigmoid(logits)
            top = choices[i] if choices is not None else np.argsort(-np.asarray(scores), kind="stable")[: moe.top_k]
            total = sum(scores[e] for e in top)
            w = [scores[e] / total for e in top]
        y = jnp.zeros(xs.shape[1])
        for j, e in enumerate(top):
            if kept is None or kept[i % t][j]:
                y = y + w[j] * swiglu(xs[i], params, int(e))
        ys.append(y)
        weights.append(jnp.stack(w))
        chosen.append(top)
    return jnp.stack(ys).reshape(x_btd.shape), jnp.stack(weights), np.array(chosen)


@pytest.mark.parametrize("ep, router, dispatch", [(1, "softmax", "padded"), (2, "sigmoid", "padded"),
                                                  (2, "softmax", "allgather"), (4, "sigmoid", "allgather")])
def test_dropless_matches_loop(ep, router, dispatch):
    layer = make_layer(ep, router=router, dispatch=dispatch)
    x_btd = jax.random.normal(jax.random.key(0), (max(2, ep), 5, D))  # ep splits the batch
    params = init(layer, x_btd)
    y, stats = jax.jit(lambda p, x: apply(layer, p, x))(params, x_btd)
    want, want_w, chosen = loop_reference(params, x_btd, layer.moe)
    assert_close(y, want)
    assert len(set(chosen.reshape(-1).tolist())) == X, "every expert should be used, or some path goes untested"

    # Router weights and the statistics, from the router alone.
    from meshtrain.model.moe import route
    _, probs_btx, experts_btk, weights_btk = route(x_btd, params["router"], layer.moe)
    np.testing.assert_array_equal(experts_btk.reshape(-1, 2), chosen)
    np.testing.assert_allclose(weights_btk.reshape(-1, 2), want_w, rtol=1e-6)
    counts = np.bincount(chosen.reshape(-1), minlength=X)
    aux = X * np.sum(counts / counts.sum() * np.asarray(probs_btx).reshape(-1, X).mean(0))
    np.testing.assert_allclose(stats["moe_aux_loss"], aux, rtol=1e-6)
    np.testing.assert_allclose(stats["moe_load_max"], counts.max() / counts.mean(), rtol=1e-6)
    assert float(stats["moe_dropped"]) == 0.0

    # Gradients of a fixed projection of the output, for every parameter and the input.
    g_btd = jax.random.normal(jax.random.key(2), y.shape)
    got = jax.jit(jax.grad(lambda p, x: jnp.sum(apply(layer, p, x)[0] * g_btd), argnums=(0, 1)))(params, x_btd)

    def ref_loss(p, x):
        return jnp.sum(loop_reference(p, x, layer.moe, choices=chosen)[0] * g_btd)

    want_g = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x_btd)
    for name in params:
        assert_close(got[0][name], want_g[0][name], name)
    assert_close(got[1], want_g[1], "input")


# Hand-worked capacity case: 4 tokens, 4 experts, top-2, capacity_factor 1 -> C = ceil(1·4·2/4) = 2 slots.
# Router logits (token x_i is the unit vector i, so row i of the router is token i's logits):
ROUTER_LOGITS = np.array([[3, 2, 0, -1],   # t0: e0, e1
                          [3, 2, -1, 0],   # t1: e0, e1
                          [3, -1, 2, 0],   # t2: e0, e2
                          [2, 3, -1, 0]],  # t3: e1, e0
                         np.float32)
# Queues, first choices first: e0 <- t0 t1 | t2 (dropped, first choice) ... t3 (second choice, dropped);
# e1 <- t3 (first) t0 (second) | t1 (second, dropped); e2 <- t2 (second). Kept [token, choice]:
KEPT = np.array([[1, 1], [1, 0], [0, 1], [1, 0]], bool)


@pytest.mark.parametrize("ep", [1, 2])
def test_capacity_drops_match_hand_worked_case(ep):
    layer = make_layer(ep, capacity_factor=1.0)
    # One sequence per ep rank, each the same 4 tokens: every rank has the hand-worked queues.
    x_btd = jnp.tile(jnp.eye(4, D)[None], (ep, 1, 1))
    params = init(layer, x_btd)
    params["router"] = jnp.zeros((D, X)).at[:4].set(ROUTER_LOGITS)
    y, stats = jax.jit(lambda p, x: apply(layer, p, x))(params, x_btd)
    want, _, chosen = loop_reference(params, x_btd, layer.moe, kept=KEPT)
    np.testing.assert_array_equal(chosen[:4], [[0, 1], [0, 1], [0, 2], [1, 0]])
    assert_close(y, want)
    np.testing.assert_allclose(stats["moe_dropped"], 3 / 8, rtol=1e-6)

    # A capacity that fits everything drops nothing and equals the dropless layer.
    roomy = replace(layer, moe=replace(layer.moe, capacity_factor=2.0))
    y2, stats2 = jax.jit(lambda p, x: apply(roomy, p, x))(params, x_btd)
    assert_close(y2, loop_reference(params, x_btd, layer.moe)[0])
    assert float(stats2["moe_dropped"]) == 0.0


@pytest.mark.parametrize("ep, tp, capacity_factor, dispatch", [(1, 1, 1.0, "padded"), (2, 2, 0.0, "padded"),
                                                               (2, 2, 0.0, "allgather")])
def test_pallas_grouped_matmul_matches_ragged_dot(ep, tp, capacity_factor, dispatch):
    """moe.grouped_matmul=pallas (the kernel in interpret mode) against ragged_dot: outputs and gradients.
    tp=2 takes the kernel's tp-manual path (each rank half of every expert's width, outputs summed)."""
    _check_pallas_matches_ragged_dot(ep, tp, capacity_factor, (2 * ep, 5, D), dispatch)


@pytest.mark.gpu
@pytest.mark.triton
def test_compiled_pallas_grouped_matmul_matches_ragged_dot():
    """The same on one GPU with the compiled kernel (fp32: IEEE dots in the kernel, HIGHEST in XLA)."""
    _check_pallas_matches_ragged_dot(1, 1, 0.0, (2, 64, D))


def _check_pallas_matches_ragged_dot(ep, tp, capacity_factor, shape, dispatch="padded"):
    fields = dict(capacity_factor=capacity_factor, dispatch=dispatch)
    ref, kern = (make_layer(ep, tp, grouped_matmul=g, **fields) for g in ("ragged_dot", "pallas"))
    x_btd = jax.random.normal(jax.random.key(0), shape)
    params = init(ref, x_btd)
    g_btd = jax.random.normal(jax.random.key(2), x_btd.shape)

    def out_and_grads(layer):
        loss = lambda p, x: jnp.sum(apply(layer, p, x)[0] * g_btd)  # noqa: E731
        return jax.jit(lambda p, x: (apply(layer, p, x)[0], jax.grad(loss, argnums=(0, 1))(p, x)))(params, x_btd)

    (y_r, g_r), (y_k, g_k) = out_and_grads(ref), out_and_grads(kern)
    assert_close(y_k, y_r)
    for name in params:
        assert_close(g_k[0][name], g_r[0][name], name)
    assert_close(g_k[1], g_r[1], "input")


@pytest.mark.gpu
def test_allgather_exchange_matches_padded_on_gpus():
    """On GPUs (NCCL's collectives), the all-gather exchange gives what the padded all-to-all gives."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    padded, allgather = make_layer(2, dispatch="padded"), make_layer(2, dispatch="allgather")
    x_btd = jax.random.normal(jax.random.key(0), (2, 64, D))
    params = init(padded, x_btd)
    g_btd = jax.random.normal(jax.random.key(2), x_btd.shape)

    def out_and_grads(layer):
        loss = lambda p, x: jnp.sum(apply(layer, p, x)[0] * g_btd)  # noqa: E731
        return jax.jit(lambda p, x: (apply(layer, p, x)[0], jax.grad(loss, argnums=(0, 1))(p, x)))(params, x_btd)

    (y_p, g_p), (y_a, g_a) = out_and_grads(padded), out_and_grads(allgather)
    assert_close(y_a, y_p)
    for name in params:
        assert_close(g_a[0][name], g_p[0][name], name)
    assert_close(g_a[1], g_p[1], "input")


@pytest.mark.parametrize("dispatch", ["allgather", "padded"])
def test_the_expert_points_keep_the_grouped_gemms_out_of_the_recomputation(dispatch):
    """train.remat=names:moe_in,moe_hidden,moe_out: the backward of a rematerialized MoE layer reruns none
    of its three grouped GEMMs (under `full` it reruns all three), and its gradients are `full`'s."""
    layer = make_layer(ep=2, dispatch=dispatch)
    x_btd = jax.random.normal(jax.random.key(0), (2, 8, D), jnp.float32)
    params = init(layer, x_btd)
    policies = {"full": "full", "points": "names:moe_in,moe_hidden,moe_out"}
    counts, grads = {}, {}
    for name, remat in policies.items():
        block = nn.remat(type(layer), policy=remat_policy(remat))(**{f: getattr(layer, f) for f in MOE_FIELDS})
        loss = lambda p: jnp.sum(block.apply({"params": p}, x_btd, mutable=[METRICS])[0] ** 2)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
        counts[name] = sum(e.primitive.name.startswith("ragged_dot") for e in all_eqns(jaxpr))
        grads[name] = jax.jit(jax.grad(loss))(params)
    # forward 3; backward 4 (dW of each, dX of the down GEMM; x is not differentiated here); `full` adds the
    # forward's 3 again
    assert (counts["full"], counts["points"]) == (10, 7), counts
    for k in params:
        assert_close(grads["points"][k], grads["full"][k], err_msg=k)
