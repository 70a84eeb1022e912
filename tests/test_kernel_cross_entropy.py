"""linear_cross_entropy (vocab-blocked, never [N, V] at once) against the jnp reference.

Tolerances (relative L2 error): fp32 1e-5 (same fp32 math; the online logsumexp sums in a
different order); bf16 1e-2 for gradients (the kernel rounds dlogits to bf16 before its two
matmuls: 2^-8 relative per element), 1e-5 for the loss (fp32 logits from the same bf16 operands).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import loss_and_vjp, rel_l2

from pallas_kernels import (LinearCrossEntropyBlockSizes, linear_cross_entropy,
                            linear_cross_entropy_reference)


@pytest.mark.parametrize("dtype,grad_tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("v,chunk", [(300, 128), (512, 128), (100, 4096)])  # tail step / exact / one step
def test_matches_reference(dtype, grad_tol, v, chunk):
    n, d = 50, 64
    ks = jax.random.split(jax.random.PRNGKey(v + chunk), 4)
    h = jax.random.normal(ks[0], (n, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (d, v), jnp.float32) / 8).astype(dtype)
    labels = jax.random.randint(ks[2], (n,), 0, v).at[::7].set(-100)
    dloss = jax.random.normal(ks[3], (n,), jnp.float32)
    bs = LinearCrossEntropyBlockSizes(vocab_chunk=chunk)
    got = loss_and_vjp(lambda h, w, l: linear_cross_entropy(h, w, l, block_sizes=bs, interpret=True),
               h, w, labels, dloss)
    want = loss_and_vjp(linear_cross_entropy_reference, h, w, labels, dloss)
    loss = np.asarray(got[0])
    assert got[0].dtype == jnp.float32 and got[0].shape == (n,)
    np.testing.assert_array_equal(loss[::7], 0.0)  # ignored tokens
    assert (loss[1::7] > 0).all()
    for name, g, ref, tol in zip(("loss", "dh", "dw"), got, want, (1e-5, grad_tol, grad_tol)):
        assert g.shape == ref.shape and g.dtype == ref.dtype, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        err = rel_l2(g, ref)
        assert err < tol, f"{name}: relative error {err:.2e}"


def test_custom_ignore_index():
    h = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 40))
    labels = jnp.array([0, 3, 39, 5, 5, 1, 2, 7])
    got = linear_cross_entropy(h, w, labels, ignore_index=5,
                               block_sizes=LinearCrossEntropyBlockSizes(vocab_chunk=16))
    np.testing.assert_array_equal(np.asarray(got)[3:5], 0.0)
    assert rel_l2(got, linear_cross_entropy_reference(h, w, labels, ignore_index=5)) < 1e-5


@pytest.mark.parametrize("h_shape,w_shape,l_shape,match", [
    ((8, 16), (15, 40), (8,), r"matching D; got h.shape=\(8, 16\), w.shape=\(15, 40\)"),
    ((8, 16), (16, 40), (7,), r"labels must have shape \(N,\) = \(8,\); got \(7,\)"),
    ((2, 8, 16), (16, 40), (8,), r"h.shape=\(2, 8, 16\)"),
])
def test_bad_shapes_raise(h_shape, w_shape, l_shape, match):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(jnp.ones(h_shape), jnp.ones(w_shape), jnp.zeros(l_shape, jnp.int32))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="labels must be integers"):
        linear_cross_entropy(jnp.ones((8, 16)), jnp.ones((16, 40)), jnp.zeros((8,)))
    with pytest.raises(ValueError, match="vocab_chunk must be a positive int; got 0"):
        LinearCrossEntropyBlockSizes(vocab_chunk=0)


@pytest.mark.gpu
def test_gpu_matches_reference_and_saves_memory():
    n, d, v = 4096, 1024, 32000
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    h = jax.random.normal(ks[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (d, v), jnp.float32) / 32).astype(jnp.bfloat16)
    labels = jax.random.randint(ks[2], (n,), 0, v).at[::11].set(-100)
    dloss = jax.random.normal(ks[3], (n,), jnp.float32)
    got = loss_and_vjp(linear_cross_entropy, h, w, labels, dloss)
    want = loss_and_vjp(linear_cross_entropy_reference, h, w, labels, dloss)
    for g, ref in zip(got, want):
        assert rel_l2(g, ref) < 1e-2

    def temp_bytes(fn):
        f = jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(fn(h, w, labels)), argnums=(0, 1)))
        return f.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(linear_cross_entropy) * 4 <= temp_bytes(linear_cross_entropy_reference)
