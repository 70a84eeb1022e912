"""Precision in the model: fp32 logits, fp8 recipes in training, sharded == unsharded, bitwise resume.

Tolerances:
- fp32 logits at the 1B head shape (K = d_model = 2048): the fp32 GEMM's error is a few 1e-6 here
  (rounding of 2048 fp32 additions, which behaves like a random walk of 2^-24 steps); a logit rounded
  to bf16 is off by up to 2^-9 of itself (0.03 at |logit| ~ 16). 1e-3 per token passes the first with
  a wide margin and fails the second (the test checks that it would).
- fp8 sharded vs one device, fp32 compute: amax is a max (independent of reduction order), so both
  runs quantize with the same scales and the same fp8 operands except where a reduction-order
  difference (~1e-7 relative) straddles a rounding boundary; first-step gradients agree to 1e-5 of
  each tensor's max, as for fp32 (measured <= 6e-7). Later steps are not compared: Adam's first update
  is lr * sign(g), so a gradient element near zero can flip and move its parameter by 2 lr, which the
  next fp8 roundings amplify (losses of 4 steps differ by up to 7e-4 relative).
- fp8 training: 100 steps of the tiny model in bf16 compute; the mean loss of the last 10 steps of each
  fp8 recipe within 2% of the bf16 recipe's (the acceptance bar; measured within 0.1%).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import all_eqns, first_gradients, flatten, make_setup, single_device, tiny_config, train_losses
from meshtrain.checkpoint import Checkpointer, abstract_state
from meshtrain.config import FP8_EXCLUDE_DEFAULT, MATMUL_SITES, ConfigError, validate
from meshtrain.model.layers import FP8_META
from meshtrain.model.loss import cross_entropy_sum
from meshtrain.model.moe import LOSSES, METRICS
from meshtrain.precision import Precision, cast_sites
from meshtrain.step.loss import cross_entropy, loss_sum_fn
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step

FP8 = ("fp8", "fp8_delayed", "fp8_blockwise")


def dots_of(jaxpr):
    return [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]


def test_head_gemm_returns_fp32_in_the_bf16_model():
    """The lm_head dot_general itself has an fp32 result (not a bf16 result cast afterwards)."""
    setup = make_setup(single_device(tiny_config("precision.compute=bfloat16", "model.vocab_size=200")), 1)
    state = init_state(setup)
    mb = make_batches(setup).batch(0).microbatch(0)
    jaxpr = jax.make_jaxpr(loss_sum_fn(setup.model))(state.params, mb, state.model_state).jaxpr
    vocab = setup.cfg.model.vocab_size
    head = [e for e in dots_of(jaxpr) if e.outvars[0].aval.shape[-1] == vocab]
    assert len(head) == 1
    assert head[0].outvars[0].aval.dtype == jnp.float32
    assert {v.aval.dtype for v in head[0].invars} == {jnp.dtype(jnp.bfloat16)}
    # The other dense matmuls with [B, T, D|F] inputs (the scanned block: wq, wk, wv, w_gate, w_up, w_down)
    # stay in the compute dtype.
    dense = [e for e in dots_of(jaxpr) if e not in head and e.invars[0].aval.ndim == 3]
    assert len(dense) == 6 and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in dense)


def test_head_gemm_backward_stays_in_the_compute_dtype():
    """The fp32 logits' cotangent is rounded to bf16 before the two backward GEMMs, so no dot of the
    gradient mixes fp32 and bf16 operands (XLA would run it as an fp32/TF32 GEMM); dW still
    accumulates in fp32."""
    setup = make_setup(single_device(tiny_config("precision.compute=bfloat16", "model.vocab_size=200")), 1)
    state = init_state(setup)
    mb = make_batches(setup).batch(0).microbatch(0)
    loss = loss_sum_fn(setup.model)
    grad = jax.grad(lambda p: loss(p, mb, state.model_state)[0])
    dots = dots_of(jax.make_jaxpr(grad)(state.params).jaxpr)
    vocab = setup.cfg.model.vocab_size
    head = [e for e in dots if vocab in e.invars[0].aval.shape + e.invars[1].aval.shape]
    assert len(head) == 3  # forward logits, dX, dW
    for e in head:
        assert {v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.bfloat16)}, e


def test_wide_result_einsum_gradients_match_fp32():
    """The head GEMM's custom backward against autodiff of the same product in fp32 on the same bf16
    operands: both gradients within bf16 rounding (the cotangent and the results are rounded once to
    bf16, 2^-8 relative each; 1e-2 of the norm leaves room and fails on a transposed or missing term)."""
    policy = Precision.from_names("bfloat16")
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 5, 48), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    w = jax.random.normal(kw, (48, 72), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    g = jax.random.normal(kg, (2, 5, 72), jnp.float32)

    def got(x, w):
        return policy.einsum("btd,dv->btv", x, w, site="lm_head", out_dtype=jnp.float32)

    y, vjp = jax.vjp(got, x, w)
    assert y.dtype == jnp.float32
    y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum("btd,dv->btv", x, w, precision="highest"), x, w)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)  # bf16-exact operands, fp32 accumulation
    for a, b in zip(vjp(g), vjp_ref(g)):
        assert a.shape == b.shape and a.dtype == jnp.float32
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2


def test_loss_at_the_1b_head_shape_matches_float64():
    """d_model 2048, vocab 32000 (configs/llama1b_h100.yaml), 4 token rows, bf16 compute."""
    d, v, rows = 2048, 32000, 4
    rng = np.random.default_rng(0)
    h = rng.normal(size=(1, rows, d)).astype(np.float32)
    w = (rng.normal(size=(d, v)) * 0.1).astype(np.float32)  # logits of std ~4.5, max ~20: a trained model's
    labels = rng.integers(0, v, size=(1, rows))
    setup = make_setup(single_device(tiny_config()), 1)
    loss_fn = jax.jit(lambda h, w, y: cross_entropy_sum(h, w, y, policy=Precision.from_names("bfloat16"),
                                                         rules=setup.layout.params, vocab_size=v)[0])
    got = float(loss_fn(jnp.asarray(h, jnp.bfloat16), jnp.asarray(w), jnp.asarray(labels)))
    # float64 on the same bf16-rounded operands: what an exact GEMM and softmax would give.
    h64 = np.asarray(jnp.asarray(h, jnp.bfloat16), np.float64)[0]
    w64 = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)

    def loss(logits):
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        return float(np.sum(lse - logits[np.arange(rows), labels[0]]))

    logits = h64 @ w64
    want = loss(logits)
    assert abs(got - want) <= 1e-3 * rows
    bf16_logits = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64)
    assert abs(loss(bf16_logits) - want) > 1e-3 * rows, "the bound must be tight enough to catch bf16 logits"


@pytest.fixture(scope="module")
def curves():
    out = {}
    for recipe in ("bf16",) + FP8:
        cfg = single_device(tiny_config(f"precision.matmul={recipe}", "precision.compute=bfloat16", "train.lr=3e-3",
                                        "train.warmup_steps=10", "train.steps=100"))
        out[recipe] = train_losses(make_setup(cfg, 1), 100)  # bf16 falls by 3.6 in 100 steps
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", FP8)
def test_fp8_training_ends_within_2_percent_of_bf16(curves, recipe):
    base, got = np.mean(curves["bf16"][-10:]), np.mean(curves[recipe][-10:])
    assert curves["bf16"][0] - base > 3.0, "the bf16 run must learn, or equal losses prove little"
    assert abs(got - base) <= 0.02 * base, (recipe, got, base)
    assert curves[recipe] != curves["bf16"], "the recipe must change the numerics"


@pytest.mark.parametrize("recipe", FP8)
def test_fp8_sharded_equals_one_device(recipe):
    cfg = tiny_config(f"precision.matmul={recipe}", "mesh.fsdp=2", "mesh.tp=4", "train.zero_stage=3")
    one, eight = make_setup(single_device(cfg), 1), make_setup(cfg, 8)
    want, got = flatten(first_gradients(one)), flatten(first_gradients(eight))
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        assert scale > 0, name
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_fp8_delayed_resumes_bitwise(tmp_path):
    """3 steps, save, restore into a fresh state (through Orbax on disk), 3 more == 6 uninterrupted;
    the amax histories (stacked on layers) round-trip exactly."""
    cfg = tiny_config("precision.matmul=fp8_delayed", "precision.fp8_amax_history=4", "mesh.fsdp=2", "mesh.tp=4",
                      "train.steps=6")
    setup = make_setup(cfg, 8)
    batches, step = make_batches(setup), make_train_step(setup)
    state, full = init_state(setup), []
    for i in range(6):
        state, m = step(state, batches.batch(i))
        full.append(float(m["loss"]))

    state = init_state(setup)
    for i in range(3):
        state, _ = step(state, batches.batch(i))
    hist = state.model_state["fp8_meta"]["layers"]["mlp"]["w_down"]["g"]
    assert hist.shape == (2, 4) and np.all(np.asarray(hist)[:, :3] > 0), "3 steps of gradient amax per layer"
    saved = jax.tree.map(np.asarray, state.model_state)
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
    ckpt.save(3, state, cfg.to_dict())
    ckpt.wait()
    restored = ckpt.restore(3, abstract_state(setup.state_shardings, jax.eval_shape(lambda: init_state(setup))))
    ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.model_state), saved)
    resumed = []
    for i in range(3, 6):
        restored, m = step(restored, batches.batch(i))
        resumed.append(float(m["loss"]))
    assert resumed == full[3:]


def test_fp8_delayed_unrolled_with_remat_keeps_a_history_per_layer():
    cfg = single_device(tiny_config("precision.matmul=fp8_delayed", "model.scan_layers=false", "train.remat=full",
                                    "precision.fp8_amax_history=2"))
    setup = make_setup(cfg, 1)
    batches, step, state = make_batches(setup), make_train_step(setup), init_state(setup)
    for i in range(2):
        state, _ = step(state, batches.batch(i))
    hists = flatten(jax.tree.map(np.asarray, state.model_state["fp8_meta"]))
    assert len(hists) == 2 * 7 * 3  # layers x sites x (input, weight, gradient)
    assert all(np.all(h > 0) for h in hists.values()), [k for k, h in hists.items() if not np.all(h > 0)]
    assert not np.array_equal(hists["layers/layer_0/attn/wq/x"], hists["layers/layer_1/attn/wq/x"])


@pytest.mark.parametrize("overrides, message", [
    (["precision.fp8_amax_history=0"], "precision.fp8_amax_history=0: must be >= 1"),
    (["precision.matmul=fp8_delayed", "precision.fp8_exclude=moe.*"], "lm_head run fp8_delayed"),
    (["precision.matmul=fp8", "precision.fp8_exclude=", "model.loss=fused"], "model.loss=fused"),
    (["precision.matmul=fp4"], "precision.matmul='fp4': must be one of bf16, fp8, fp8_delayed, fp8_blockwise"),
])
def test_precision_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(tiny_config(*overrides), 8)
    assert any(message in p for p in e.value.problems), e.value.problems


def test_a_pattern_that_matches_no_site_is_one_config_error():
    """A typo in fp8_exclude would leave its site in fp8 unnoticed: it is named, with the real sites."""
    with pytest.raises(ConfigError) as e:
        validate(tiny_config("precision.matmul=fp8", "precision.fp8_exclude=lm_head,atn.*"), 8)
    assert len(e.value.problems) == 1, e.value.problems
    problem = e.value.problems[0]
    assert "precision.fp8_exclude" in problem and "'atn.*'" in problem
    assert all(site in problem for site in MATMUL_SITES)


def test_the_default_exclusions_name_real_sites_and_keep_experts_plain():
    for matmul in ("bf16",) + FP8:
        validate(tiny_config(f"precision.matmul={matmul}"), 8)  # passes: every default pattern matches a site
        validate(tiny_config("model.preset=tiny_moe", f"precision.matmul={matmul}"), 8)
    assert tiny_config().precision.fp8_exclude == ",".join(FP8_EXCLUDE_DEFAULT)
    recipes = Precision.from_names("bfloat16", matmul="fp8").recipes()
    assert {s for s, r in recipes.items() if r == "bf16"} == {"lm_head", "moe.w_gate", "moe.w_up", "moe.w_down"}


def test_fp8_cannot_reach_the_expert_gemms():
    """The grouped expert GEMMs have no fp8 recipe: an MoE config that takes moe.* out of the exclusions
    is refused instead of running its experts in bf16 behind the user's back."""
    with pytest.raises(ConfigError) as e:
        validate(tiny_config("model.preset=tiny_moe", "precision.matmul=fp8", "precision.fp8_exclude=lm_head"), 8)
    assert any("moe.w_gate, moe.w_up, moe.w_down run fp8" in p for p in e.value.problems), e.value.problems
    validate(tiny_config("precision.matmul=fp8", "precision.fp8_exclude=lm_head"), 8)  # a dense model has no experts


def test_site_weights_are_cast_once_outside_the_recomputed_blocks():
    """Under train.remat=full the backward reruns each block; the blocks' bf16 weights come from one cast of
    the stacked params per step (precision.cast_sites), not from a cast inside the block that the rerun repeats."""
    setup = make_setup(single_device(tiny_config("precision.compute=bfloat16", "train.remat=full",
                                                 "model.vocab_size=200")), 1)  # no weight shares a layer weight's shape
    state = init_state(setup)
    mb = make_batches(setup).batch(0).microbatch(0)
    loss = loss_sum_fn(setup.model)
    grad = jax.grad(lambda p: loss(p, mb, state.model_state)[0])
    casts = [e for e in all_eqns(jax.make_jaxpr(grad)(state.params).jaxpr)
             if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == jnp.bfloat16
             and e.invars[0].aval.dtype == jnp.float32]
    layers = jax.tree_util.tree_leaves_with_path(state.params["layers"])
    sites = {a.shape for path, a in layers if "norm" not in jax.tree_util.keystr(path)}  # wq ... w_down
    assert len(sites) >= 4
    stacked = [e for e in casts if e.invars[0].aval.shape in sites]
    per_layer = [e for e in casts if (setup.cfg.model.n_layers, *e.invars[0].aval.shape) in sites]
    assert stacked and not per_layer, (len(stacked), [e.invars[0].aval.shape for e in per_layer])


@pytest.fixture(scope="module", params=["fp8-scanned", "fp8-unrolled", "fp8_delayed-scanned", "fp8_delayed-unrolled"])
def quantized_once(request):
    """(setup, params, model state with random amax histories, one microbatch) of the tiny model under remat=full."""
    recipe, stack = request.param.split("-")
    setup = make_setup(single_device(tiny_config(f"precision.matmul={recipe}", "train.remat=full",
                                                 f"model.scan_layers={stack == 'scanned'}",
                                                 "precision.compute=bfloat16", "model.vocab_size=200")), 1)
    state = init_state(setup)
    leaves, tree = jax.tree.flatten(state.model_state)  # histories of 0 would make every delayed scale 1
    keys = jax.random.split(jax.random.key(0), max(len(leaves), 1))
    model_state = jax.tree.unflatten(tree, [jax.random.uniform(k, a.shape, minval=0.01, maxval=4.0)
                                            for k, a in zip(keys, leaves)])
    return setup, state.params, model_state, make_batches(setup).batch(0).microbatch(0)


def site_loss(setup, mb, quantize_fp8: bool):
    """The microbatch's loss as step/loss.py assembles it, with the fp8 weights quantized once or at their sites."""
    model = setup.model

    def loss(params, model_state):
        sites = cast_sites(model.policy, params, model_state.get(FP8_META), quantize_fp8=quantize_fp8)
        (h_btd, head_dv), _ = model.apply({"params": sites, **model_state}, mb.tokens, mb.positions,
                                          mb.segment_ids, mutable=(LOSSES, METRICS))
        return cross_entropy(model, h_btd, head_dv, mb.targets)[0]
    return loss


def test_fp8_weights_quantized_once_equal_quantized_at_their_sites(quantized_once):
    """The same scales, the same e4m3 weights, the same GEMMs: loss, gradients and the next amax histories
    (the histories' cotangent) are bit for bit those of the weights quantized inside each block."""
    setup, params, model_state, mb = quantized_once
    want, got = (jax.jit(jax.value_and_grad(site_loss(setup, mb, q), argnums=(0, 1)))(params, model_state)
                 for q in (False, True))
    assert float(got[0]) == float(want[0])
    assert jax.tree.structure(got[1]) == jax.tree.structure(want[1])
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fp8_weights_are_quantized_once_outside_the_recomputed_blocks(quantized_once):
    """Under train.remat=full the backward reruns each block; the step's loss (step/loss.py) quantizes each layer
    site's fp32 weight to e4m3 once, from the stacked (or each unrolled) weight, and no block quantizes one again;
    quantized at their sites, the rerun quantized every weight a second time."""
    setup, params, model_state, mb = quantized_once
    loss = loss_sum_fn(setup.model)
    weights = [(path, a) for path, a in jax.tree_util.tree_leaves_with_path(params["layers"])
               if "norm" not in jax.tree_util.keystr(path)]  # wq wk wv wo w_gate w_up w_down, per layer or stacked
    n_layers = setup.cfg.model.n_layers
    layer_sizes = {a.size // (n_layers if setup.cfg.model.scan_layers else 1) for _, a in weights}

    def quantized_weights(fn):
        """The fp32 -> e4m3 casts of a layer weight: as stored (stacked or not), or one layer's as a site sees it
        ([K, N]; the activations' shapes differ from every weight's)."""
        jaxpr = jax.make_jaxpr(jax.grad(fn))(params).jaxpr
        return [a.shape for a in (e.invars[0].aval for e in all_eqns(jaxpr) if e.primitive.name == "convert_element_type"
                                  and e.params["new_dtype"] == jnp.float8_e4m3fn)
                if a.dtype == jnp.float32 and (a.shape in {w.shape for _, w in weights}
                                               or (a.ndim == 2 and a.size in layer_sizes))]

    once = quantized_weights(lambda p: loss(p, mb, model_state)[0])
    inside = quantized_weights(lambda p: site_loss(setup, mb, False)(p, model_state))
    assert len(weights) in (7, 7 * n_layers)
    assert sorted(once) == sorted(a.shape for _, a in weights), once
    assert len(inside) == 2 * len(once), inside
