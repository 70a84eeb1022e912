"""The one-pass fp8 cast (pallas_kernels/fp8_cast.py) in Triton's interpreter: bit for bit the jnp cast, and the
fp8 recipes' values unchanged when it quantizes their operands."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_setup, tiny_config
from meshtrain import fp8
from meshtrain.precision import Precision
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step
from pallas_kernels.fp8_cast import Fp8CastBlockSizes, cast_transpose, cast_transpose_reference

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def spread(shape, dtype, seed=0):
    """Normal values times e^(4 N(0,1)): magnitudes over ~20 binades, so rounding meets subnormals, ties near
    binade edges and saturation; plus the special values at the front."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(4 * jax.random.normal(k2, shape, jnp.float32))
    flat = x.reshape(-1)
    flat = flat.at[:6].set(jnp.array([1e9, -1e-30, jnp.inf, -jnp.inf, -0.0, 7.86], jnp.float32))
    return flat.reshape(shape).astype(dtype)


def bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cast_transpose_equals_the_jnp_cast_bit_for_bit(dtype, x_dtype):
    """Leading dims, rows and columns off the tile grid; both layouts and the amax."""
    x = spread((3, 70, 200), x_dtype)
    scale = jnp.float32(0.25)
    q, q_t, amax = cast_transpose(x, scale, dtype, amax=True, interpret=True)
    want_q, want_t, want_amax = cast_transpose_reference(x, scale, dtype, amax=True)
    assert q.dtype == want_q.dtype and q_t.shape == (3, 200, 70)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(q_t), bits(want_t))
    assert float(amax) == float(want_amax) == float("inf")


@pytest.mark.parametrize("blocks", [Fp8CastBlockSizes(16, 32, 2), Fp8CastBlockSizes(128, 16, 4)])
def test_tiles_and_options_do_not_change_the_values(blocks):
    """Other tile shapes, a scale that is not 1/4, no transpose, no amax; the amax of finite values."""
    x = jax.random.normal(jax.random.key(3), (130, 33), jnp.float32) * 300.0
    scale = jnp.float32(2.0 ** -3)
    q, q_t, amax = cast_transpose(x, scale, E4M3, transpose=False, block_sizes=blocks, interpret=True)
    assert q_t is None and amax is None
    np.testing.assert_array_equal(bits(q), bits(cast_transpose_reference(x, scale, E4M3)[0]))
    _, _, amax = cast_transpose(x, scale, E5M2, amax=True, block_sizes=blocks, interpret=True)
    assert float(amax) == float(jnp.max(jnp.abs(x)))


def test_bad_arguments_say_what_is_wrong():
    x = jnp.ones((4, 4), jnp.float32)
    with pytest.raises(ValueError, match="dtype must be float8_e4m3fn or float8_e5m2"):
        cast_transpose(x, 1.0, jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="at least 2 dims"):
        cast_transpose(jnp.ones((4,)), 1.0, E4M3, interpret=True)
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        Fp8CastBlockSizes(block_rows=48)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_recipes_give_the_same_values_with_either_cast(recipe):
    """y, dx, dw and the next amax histories of a site, bf16 compute, with XLA's casts and with the kernel's."""
    x = spread((64, 256), jnp.bfloat16, seed=1)
    x = jnp.where(jnp.isfinite(x) & (jnp.abs(x) < 1e4), x, 1.0)  # a step with inf would be dropped anyway
    w = jax.random.normal(jax.random.key(2), (256, 96), jnp.float32) * 0.02
    g = jax.random.normal(jax.random.key(4), (64, 96), jnp.bfloat16) * 1e-3
    meta = {k: jnp.asarray(v, jnp.float32) for k, v in
            {"x": [0.0, 9.0, 3.0], "w": [0.5, 0.1, 0.0], "g": [2e-3, 0.0, 1e-3]}.items()}
    meta = meta if recipe == "fp8_delayed" else None

    def run(cast):
        policy = Precision.from_names("bfloat16", matmul=recipe, fp8_cast=cast)
        y, vjp = jax.vjp(lambda x, w, meta: policy.einsum("md,dn->mn", x, w, site="mlp.w_up", meta=meta), x, w, meta)
        return (y, *vjp(g))

    got, want = run("interpret"), run("xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert float(jnp.max(jnp.abs(got[0].astype(jnp.float32)))) > 0
    with pytest.raises(ValueError, match="cast must be one of"):
        fp8.per_tensor_matmul(x, w, meta, jnp.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_cast_transpose_equals_the_jnp_cast_bit_for_bit(dtype):
    """Compiled by Triton on the GPU (its own fp8 conversion after the rounding in fp32): the same bits as XLA's."""
    x = spread((2, 1000, 3000), jnp.bfloat16, seed=5)
    q, q_t, amax = jax.jit(lambda x: cast_transpose(x, jnp.float32(0.5), dtype, amax=True))(x)
    want_q, want_t, want_amax = jax.jit(lambda x: cast_transpose_reference(x, jnp.float32(0.5), dtype, amax=True))(x)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(q_t), bits(want_t))
    assert float(amax) == float(want_amax)


def test_the_train_step_with_the_kernel_equals_the_step_with_xlas_casts():
    """precision.fp8_cast=triton reaches every fp8 site of the model (on a CPU, Triton's interpreter): two steps of
    the tiny model under fp8_delayed, bf16 compute, give XLA's casts' losses exactly, and the histories after them."""
    def run(cast):
        setup = make_setup(tiny_config("precision.compute=bfloat16", "precision.matmul=fp8_delayed",
                                       f"precision.fp8_cast={cast}"), 1)
        assert setup.model.policy.fp8_cast == ("interpret" if cast == "triton" else "xla")
        batches, state, step = make_batches(setup), init_state(setup), make_train_step(setup)
        losses = []
        for i in range(2):
            state, metrics = step(state, batches.batch(i))
            losses.append(float(metrics["loss"]))
        return losses, state.model_state

    (got, got_meta), (want, want_meta) = run("triton"), run("xla")
    assert got == want and np.isfinite(got).all()
    for a, b in zip(jax.tree.leaves(got_meta), jax.tree.leaves(want_meta)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(float(jnp.max(a)) > 0 for a in jax.tree.leaves(got_meta))  # the histories were pushed
