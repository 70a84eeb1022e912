"""linear_cross_entropy_sum (token chunks, the gradient made in the forward) against the jnp reference.

Tolerances (relative L2 error): fp32 1e-5 (the same fp32 math, summed chunk by chunk); bf16 1e-2 for the
gradients (dlogits rounded to bf16 before their two GEMMs: 2^-8 relative per element, as the plain head's
backward does), 1e-5 for the loss (fp32 logits from the same bf16 operands).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import loss_and_vjp, rel_l2

from pallas_kernels import linear_cross_entropy_reference, linear_cross_entropy_sum
from pallas_kernels.cross_entropy_sum import token_chunk


def _reference_sum(h, w, labels, vocab_size):
    """The plain head over the real columns only: what padding columns must not change."""
    return jnp.sum(linear_cross_entropy_reference(h, w[:, :vocab_size], labels))


@pytest.mark.parametrize("dtype,grad_tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,chunk,vocab_size", [
    (50, 16, 300),    # 4 chunks, the last padded with ignored rows
    (64, 64, 300),    # one chunk
    (48, 16, 250),    # columns 250..299 are padding, as when the vocabulary is padded to shard over tp
])
def test_matches_reference(dtype, grad_tol, n, chunk, vocab_size):
    d, v = 32, 300
    ks = jax.random.split(jax.random.PRNGKey(n + chunk + vocab_size), 3)
    h = jax.random.normal(ks[0], (n, d), jnp.float32).astype(dtype)
    # Padding columns get large weights: were they ever in the logsumexp, the loss would be far off.
    w = (jax.random.normal(ks[1], (d, v), jnp.float32) / 4).at[:, vocab_size:].set(8.0).astype(dtype)
    labels = jax.random.randint(ks[2], (n,), 0, vocab_size).at[::7].set(-100)
    g = jnp.float32(0.37)  # the cotangent of a summed loss: one scalar (1/token count in a train step)
    got = loss_and_vjp(lambda h, w, l: linear_cross_entropy_sum(h, w, l, vocab_size=vocab_size,
                                                                   tokens_per_chunk=chunk), h, w, labels, g)
    want = loss_and_vjp(lambda h, w, l: _reference_sum(h, w, l, vocab_size), h, w, labels, g)
    assert got[0].dtype == jnp.float32 and got[0].shape == ()
    for name, x, ref, tol in zip(("loss", "dh", "dw"), got, want, (1e-5, grad_tol, grad_tol)):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        err = rel_l2(x, ref)
        assert err < tol, f"{name}: relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(got[2], np.float32)[:, vocab_size:], 0.0)  # no gradient to padding
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[::7], 0.0)  # nor from ignored tokens


def test_without_differentiation_equals_the_differentiated_loss():
    """Evaluation runs the primal alone (no GEMMs for gradients); it must give the loss the train step sees."""
    h = jax.random.normal(jax.random.PRNGKey(0), (40, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 70))
    labels = jax.random.randint(jax.random.PRNGKey(2), (40,), 0, 70).at[3].set(-100)
    f = lambda h, w: linear_cross_entropy_sum(h, w, labels, tokens_per_chunk=16)  # noqa: E731
    plain = jax.jit(f)(h, w)
    differentiated, _ = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(plain, differentiated, rtol=1e-6)
    np.testing.assert_allclose(plain, _reference_sum(h, w, labels, 70), rtol=1e-5)


def test_weight_gradient_comes_back_in_its_dtype():
    """An fp32 master weight is cast to bf16 for the GEMMs; its gradient comes back fp32, as a cast's would."""
    h = jax.random.normal(jax.random.PRNGKey(0), (32, 16), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 64), jnp.float32)
    labels = jax.random.randint(jax.random.PRNGKey(2), (32,), 0, 64)
    dh, dw = jax.grad(lambda h, w: linear_cross_entropy_sum(h, w, labels), argnums=(0, 1))(h, w)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    want = jax.grad(lambda w: _reference_sum(h, w.astype(jnp.bfloat16), labels, 64))(w)
    assert rel_l2(dw, want) < 1e-2


def test_token_chunk_keeps_the_logits_tile_within_its_bytes():
    assert token_chunk(20480, 128256) == 4096  # Llama-3-8B, 5 sequences of 4096: 5 chunks of 2 GiB or less
    assert token_chunk(16384, 32000) == 16384  # the 1.36B config's 8 x 2048 tokens: one chunk
    assert token_chunk(100, 128256, tile_bytes=1) == 100  # never fewer than 128 rows, never more than N
    assert token_chunk(1000, 128256, tile_bytes=1) == 128


@pytest.mark.parametrize("kwargs,match", [
    (dict(h=(8, 16), w=(15, 40), labels=(8,)), r"matching D; got h.shape=\(8, 16\), w.shape=\(15, 40\)"),
    (dict(h=(8, 16), w=(16, 40), labels=(7,)), r"labels must have shape \(N,\) = \(8,\); got \(7,\)"),
    (dict(h=(8, 16), w=(16, 40), labels=(8,), vocab_size=41), r"vocab_size must be in \[1, 40\].*got 41"),
    (dict(h=(8, 16), w=(16, 40), labels=(8,), tokens_per_chunk=0), "tokens_per_chunk must be a positive int; got 0"),
])
def test_bad_arguments_raise(kwargs, match):
    h, w, labels = jnp.ones(kwargs.pop("h")), jnp.ones(kwargs.pop("w")), jnp.zeros(kwargs.pop("labels"), jnp.int32)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy_sum(h, w, labels, **kwargs)
    with pytest.raises(ValueError, match="labels must be integers"):
        linear_cross_entropy_sum(jnp.ones((8, 16)), jnp.ones((16, 40)), jnp.zeros((8,)))


@pytest.mark.gpu
def test_gpu_matches_reference_and_saves_memory():
    n, d, v = 16384, 1024, 32000
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    h = jax.random.normal(ks[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (d, v), jnp.float32) / 32).astype(jnp.bfloat16)
    labels = jax.random.randint(ks[2], (n,), 0, v).at[::11].set(-100)
    fused = lambda h, w, l: linear_cross_entropy_sum(h, w, l, tokens_per_chunk=2048)  # noqa: E731
    got = loss_and_vjp(fused, h, w, labels, jnp.float32(1.0 / n))
    want = loss_and_vjp(lambda h, w, l: _reference_sum(h, w, l, v), h, w, labels, jnp.float32(1.0 / n))
    for x, ref in zip(got, want):
        assert rel_l2(x, ref) < 1e-2

    def temp_bytes(fn):
        f = jax.jit(jax.value_and_grad(lambda h, w: fn(h, w, labels), argnums=(0, 1)))
        return f.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(fused) * 3 <= temp_bytes(lambda h, w, l: _reference_sum(h, w, l, v))
