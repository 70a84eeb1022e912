"""The train step's own guarantees: remat policies change memory, never values; non-finite steps
leave the state untouched and are counted; the host stops after train.max_nonfinite of them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import all_eqns, make_setup, run_cli, single_device, tiny_config, train_losses
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step


@pytest.fixture(scope="module")
def no_remat_losses():
    return train_losses(make_setup(single_device(tiny_config("train.remat=none")), 1), 3)


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_dots_attn", "save_attn", "names:qkv,mlp_hidden"])
def test_remat_policy_changes_no_value(policy, no_remat_losses):
    losses = train_losses(make_setup(single_device(tiny_config(f"train.remat={policy}")), 1), 3)
    np.testing.assert_allclose(losses, no_remat_losses, rtol=1e-6)


@pytest.mark.parametrize("policy,rotations", [("none", 4), ("save_dots", 6), ("save_dots_attn", 4)])
def test_save_dots_attn_keeps_the_rotated_q_and_k(policy, rotations):
    """RoPE rotates q and k in the forward and their gradients in the backward (a concatenation of the rotated
    halves each: 4 in the scanned block). save_dots reruns the forward's two to rebuild attention's inputs;
    save_dots_attn keeps the rotated q and k as `none` does."""
    setup = make_setup(single_device(tiny_config(f"train.remat={policy}")), 1)
    state = init_state(setup)
    jaxpr = jax.make_jaxpr(make_grad_fn(setup))(state.params, make_batches(setup).batch(0), 1.0, state.model_state)
    assert sum(e.primitive.name == "concatenate" for e in all_eqns(jaxpr.jaxpr)) == rotations


def test_tied_embeddings_train():
    setup = make_setup(tiny_config("model.tie_embeddings=true", "mesh.fsdp=2", "mesh.tp=4"), 8)
    assert "lm_head" not in init_state(setup).params
    losses = train_losses(setup, 5)
    assert losses[-1] < losses[0] - 0.1


def test_nonfinite_step_keeps_state_and_counts():
    # An absurd learning rate sends the weights to ~1e30 in one step; the next forward pass overflows.
    setup = make_setup(single_device(tiny_config("train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0")), 1)
    batches = make_batches(setup)
    step = make_train_step(setup)
    state, m = step(init_state(setup), batches.batch(0))
    assert bool(m["finite"])
    after_first = jax.tree.map(np.asarray, (state.params, state.opt_state))
    for i in range(1, 4):
        state, m = step(state, batches.batch(i))
        assert not bool(m["finite"])
        assert int(state.nonfinite_run) == i and int(state.nonfinite_total) == i
    assert int(state.step) == 4  # the data position moves on; the weights do not
    for a, b in zip(jax.tree.leaves(after_first), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_fp16_overflows_count_toward_the_streak_only_at_the_smallest_scale():
    """fp16: the scaler halves its scale one skipped step at a time; those skips are not a failing run. An
    overflow at scale 1 is (the values leave fp16's range whatever the scale)."""
    setup = make_setup(single_device(tiny_config("precision.compute=float16", "train.lr=1e30",
                                                 "train.warmup_steps=0", "train.grad_clip=0")), 1)
    batches = make_batches(setup)
    step = make_train_step(setup)
    state, m = step(init_state(setup), batches.batch(0))  # finite; it sends the weights out of fp16's range
    assert bool(m["finite"])
    state = state.replace(loss_scale=jnp.float32(4.0))
    runs, scales = [], []
    for i in range(1, 6):
        state, m = step(state, batches.batch(i))
        assert not bool(m["finite"]) and int(state.nonfinite_total) == i
        runs.append(int(state.nonfinite_run))
        scales.append(float(state.loss_scale))
    assert scales == [2.0, 1.0, 1.0, 1.0, 1.0]
    assert runs == [0, 0, 1, 2, 3]  # overflows at scales 4 and 2 are the scaler's; from scale 1 they count


def test_host_stops_after_max_nonfinite(tmp_path):
    proc = run_cli("train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0", "train.max_nonfinite=3",
                   "train.steps=20", f"run.dir={tmp_path}", check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "train.max_nonfinite=3" in proc.stderr and "Traceback" not in proc.stderr


def test_loss_scale_halves_on_overflow_and_grows_after_interval():
    import jax.numpy as jnp

    from meshtrain.precision import update_loss_scale
    scale, good = jnp.float32(1024.0), jnp.int32(0)
    scale, good = update_loss_scale(scale, good, jnp.bool_(False), growth_interval=3)
    assert (float(scale), int(good)) == (512.0, 0)
    for expect_good in (1, 2):
        scale, good = update_loss_scale(scale, good, jnp.bool_(True), growth_interval=3)
        assert (float(scale), int(good)) == (512.0, expect_good)
    scale, good = update_loss_scale(scale, good, jnp.bool_(True), growth_interval=3)
    assert (float(scale), int(good)) == (1024.0, 0)
    one, _ = update_loss_scale(jnp.float32(1.0), jnp.int32(0), jnp.bool_(False), growth_interval=3)
    assert float(one) == 1.0


def test_fp16_with_loss_scaling_tracks_fp32(no_remat_losses):
    """fp16 compute (loss scaled by 2^15) follows the fp32 run within fp16's ~1e-3 rounding, grown
    over 3 steps of training: rtol 2e-2."""
    setup = make_setup(single_device(tiny_config("precision.compute=float16")), 1)
    losses = train_losses(setup, 3)
    assert all(np.isfinite(losses))
    np.testing.assert_allclose(losses, no_remat_losses, rtol=2e-2)


def test_unscanned_layers_train():
    setup = make_setup(tiny_config("model.scan_layers=false", "mesh.fsdp=4", "mesh.tp=2"), 8)
    assert {"layer_0", "layer_1"} <= set(init_state(setup).params["layers"])
    losses = train_losses(setup, 5)
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("extra, every", [(["precision.matmul=fp8_delayed"], 1),
                                          (["model.preset=tiny_moe", "model.n_layers=4", "moe.every=2"], 2)],
                         ids=["dense-fp8-histories", "moe-every-2"])
def test_unrolled_layers_start_from_the_scanned_init(extra, every):
    """scan_layers changes the program, not the numbers: unrolled layer i holds the scanned stack's slice i
    (with MoE groups: member i % every of group i // every), in the tree the unrolled model declares."""
    import flax.linen as nn
    import jax.numpy as jnp
    scanned = init_state(make_setup(single_device(tiny_config(*extra)), 1))
    setup = make_setup(single_device(tiny_config("model.scan_layers=false", *extra)), 1)
    unrolled = init_state(setup)
    z = jnp.zeros((2, 16), jnp.int32)
    declared = nn.unbox(jax.eval_shape(lambda: setup.model.init(jax.random.key(0), z, z, z)))
    for name, tree in (("params", unrolled.params), ("fp8_meta", unrolled.model_state.get("fp8_meta"))):
        if tree is None:
            continue
        assert jax.tree.structure(tree) == jax.tree.structure(declared[name])
        jax.tree.map(lambda got, want: np.testing.assert_equal(got.shape, want.shape), tree, declared[name])
        stacked = scanned.params if name == "params" else scanned.model_state[name]
        n_layers = setup.cfg.model.n_layers
        for i in range(n_layers):
            want = stacked["layers"] if every == 1 else stacked["layers"][f"layer_{i % every}"]
            jax.tree.map(lambda got, w, i=i: np.testing.assert_array_equal(got, w[i // every]),
                         tree["layers"][f"layer_{i}"], want)
    np.testing.assert_array_equal(unrolled.params["embedding"], scanned.params["embedding"])


def test_padded_vocab_is_announced(tmp_path):
    out = run_cli("model.vocab_size=125", "train.steps=2", f"run.dir={tmp_path}").stdout
    assert "model.vocab_size=125 padded to 126" in out


def test_padded_vocab_columns_get_no_probability():
    import jax.numpy as jnp

    from meshtrain.model.loss import cross_entropy_sum
    from meshtrain.precision import Precision
    setup = make_setup(single_device(tiny_config()), 1)
    rng = np.random.default_rng(0)
    h_btd = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    head_dv = rng.normal(size=(8, 6)).astype(np.float32)
    head_dv[:, 5] = 50.0  # a pad column that would dominate the softmax if it were not masked
    labels_bt = jnp.asarray([[0, 1, 2], [3, 4, -100]])
    loss, n = cross_entropy_sum(h_btd, jnp.asarray(head_dv), labels_bt, policy=Precision.from_names("float32"),
                                rules=setup.layout.params, vocab_size=5)
    logits = np.asarray(h_btd) @ head_dv[:, :5]
    lse = np.log(np.exp(logits).sum(-1))
    want = sum(lse[b, t] - logits[b, t, lab] for b, row in enumerate([[0, 1, 2], [3, 4]]) for t, lab in enumerate(row))
    assert float(n) == 5
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def _attention_kernel_launches(jaxpr) -> int:
    """Launches of the flash-attention kernels, at any depth of the jaxpr: on the CPU each runs in
    Triton's interpreter through one pure_callback (forward; dK/dV and dQ in the backward)."""
    return sum(1 for e in all_eqns(jaxpr) if e.primitive.name == "pure_callback")


@pytest.mark.parametrize("policy,fwd_calls", [("save_dots", 2), ("save_dots_attn", 1)])
def test_save_dots_attn_keeps_the_attention_forward(policy, fwd_calls):
    """Under save_dots the backward reruns the fused attention forward (2 calls per layer in the gradient);
    save_dots_attn keeps its outputs (1 call), and the gradients stay the same."""
    from meshtrain.step.loss import loss_sum_fn
    from meshtrain.step.state import init_state, make_batches
    cfg = single_device(tiny_config("model.attention=pallas", "model.n_layers=1", f"train.remat={policy}"))
    setup = make_setup(cfg, 1)
    state, mb = init_state(setup), make_batches(setup).batch(0).microbatch(0)
    loss = loss_sum_fn(setup.model)
    grad = jax.grad(lambda p: loss(p, mb, state.model_state)[0])
    assert _attention_kernel_launches(jax.make_jaxpr(grad)(state.params).jaxpr) == fwd_calls + 2
    if policy == "save_dots_attn":
        ref = make_setup(single_device(tiny_config("model.attention=pallas", "model.n_layers=1", "train.remat=save_dots")), 1)
        want = jax.grad(lambda p: loss_sum_fn(ref.model)(p, mb, state.model_state)[0])(state.params)
        got = grad(state.params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("policy,fwd_calls", [("save_dots", 2), ("save_dots_attn", 1)])
def test_save_dots_attn_keeps_the_mosaic_attention_forward(policy, fwd_calls):
    """The same on a Hopper GPU with the Mosaic kernels (bf16, head dim 64), whose forward is one mpmd_map."""
    from meshtrain.step.loss import loss_sum_fn
    from meshtrain.step.state import init_state, make_batches
    from pallas_kernels.attention.mosaic_common import is_hopper
    if not (jax.default_backend() == "gpu" and is_hopper()):
        pytest.skip("needs a Hopper GPU")
    cfg = single_device(tiny_config("model.attention=pallas", "model.attention_kernel=mosaic", "model.n_layers=1",
                                    "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=1",
                                    "precision.compute=bfloat16", f"train.remat={policy}"))
    setup = make_setup(cfg, 1)
    state, mb = init_state(setup), make_batches(setup).batch(0).microbatch(0)
    loss = loss_sum_fn(setup.model)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, mb, state.model_state)[0]))(state.params).jaxpr
    names = [e.params.get("name") for e in all_eqns(jaxpr) if e.primitive.name == "mpmd_map"]
    assert names.count("flash_attention_fwd_mosaic") == fwd_calls, names
