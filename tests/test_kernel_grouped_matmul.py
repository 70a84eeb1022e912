"""gmm (Triton kernels; Triton's interpreter on the CPU) against jax.lax.ragged_dot and a per-group jnp loop:
output, d_lhs and d_rhs.

Tolerances (relative L2 error): fp32 1e-5 (the same fp32 products, summed in another order);
bf16/fp16 1e-2 (outputs and gradients rounded once to 8/11 mantissa bits, plus the cotangent cast to
the input dtype before the backward kernels).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_grad_prints_no_deprecation, compile_for_sm90
from pallas_kernels import GroupedMatmulBlockSizes, gmm, grouped_matmul_reference

# 16-wide tiles so that the small shapes below still span several tiles in every dim.
SMALL = GroupedMatmulBlockSizes(block_m=16, block_n=16, block_k=16, block_m_t=16, block_k_t=16, block_n_t=16)
HIGHEST = jax.lax.Precision.HIGHEST

CASES = {
    # empty groups (first, middle, last), sizes not multiples of 16, sum 55 < M = 70
    "empty_and_ragged": (70, 24, 40, [0, 5, 17, 0, 0, 30, 3, 0]),
    # one group holds every row; M, K, N not multiples of the tile
    "one_group_all": (37, 20, 18, [0, 0, 37, 0]),
    # several groups inside one tile, every row owned
    "many_small": (48, 16, 32, [3, 1, 2, 9, 0, 16, 17]),
}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30)


def _inputs(m, k, n, sizes, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[1], (len(sizes), k, n), jnp.float32).astype(dtype)
    dy = jax.random.normal(ks[2], (m, n), jnp.float32).astype(dtype)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


@functools.partial(jax.jit, static_argnums=0)
def _out_and_grads(fn, x, w, sizes, dy):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (out,) + vjp(dy.astype(out.dtype))


def _kernel(x, w, s, **kw):
    return gmm(x, w, s, block_sizes=SMALL, interpret=True, **kw)


def _ragged_dot(x, w, s):
    return jax.lax.ragged_dot(x, w, s, precision=HIGHEST)


def _check(got, want, tol):
    for name, g, r in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape, g.dtype, r.dtype)
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        err = _rel(g, r)
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_matches_ragged_dot_and_loop(case):
    m, k, n, sizes = CASES[case]
    x, w, s, dy = _inputs(m, k, n, sizes, jnp.float32)
    got = _out_and_grads(_kernel, x, w, s, dy)
    _check(got, _out_and_grads(_ragged_dot, x, w, s, dy), 1e-5)
    _check(got, _out_and_grads(grouped_matmul_reference, x, w, s, dy), 1e-5)
    out, d_lhs, d_rhs = (np.asarray(a) for a in got)
    total = sum(sizes)
    assert not out[total:].any() and not d_lhs[total:].any()  # rows no group owns: exact zeros
    for g, size in enumerate(sizes):
        if size == 0:  # an empty group's weights get exactly zero gradient
            assert not d_rhs[g].any(), g


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_matches_loop(dtype):
    m, k, n, sizes = CASES["empty_and_ragged"]
    x, w, s, dy = _inputs(m, k, n, sizes, dtype, seed=1)
    _check(_out_and_grads(_kernel, x, w, s, dy), _out_and_grads(grouped_matmul_reference, x, w, s, dy), 1e-2)


def test_preferred_element_type_fp32_from_bf16():
    m, k, n, sizes = CASES["many_small"]
    x, w, s, dy = _inputs(m, k, n, sizes, jnp.bfloat16, seed=2)
    out = _kernel(x, w, s, preferred_element_type=jnp.float32)
    want = jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32)
    assert out.dtype == want.dtype == jnp.float32
    assert _rel(out, want) < 1e-5  # bf16 products are exact in fp32; only the summation order differs


def test_bad_arguments_raise():
    x, w = jnp.ones((8, 16)), jnp.ones((2, 16, 16))
    with pytest.raises(ValueError, match="lhs.dtype=float32 and rhs.dtype=bfloat16 must match"):
        gmm(x, w.astype(jnp.bfloat16), jnp.array([4, 4]))
    with pytest.raises(ValueError, match=r"rhs \[G, K, N\]"):
        gmm(x, jnp.ones((2, 8, 16)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        gmm(x, w, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16; got 24"):
        GroupedMatmulBlockSizes(block_k=24)


# The compiled path lowered in a fresh process, each kernel compiled by Triton for an H100 (helpers.compile_for_sm90).
_LOWER_GMM = """
from pallas_kernels import gmm

m, k, n, g, dtype = 1000, 200, 96, 8, jnp.dtype(sys.argv[1])  # nothing a tile multiple
def f(x, w, s, dy):
    out, vjp = jax.vjp(lambda x, w: gmm(x, w, s, interpret=False), x, w)
    return out, vjp(dy)
jax.jit(f).lower(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
                 jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((m, n), dtype))
print("compiled:", *compiled)
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiles_for_sm90_without_a_gpu(dtype):
    """The compiled path (interpret=False) through the launcher, each kernel compiled by Triton for an H100
    from the CPU: catches an operation, type or shape Triton's compiler rejects before a GPU ever sees it.
    Three kernels: gmm forward, gmm for d_lhs (rhs read transposed), tgmm for d_rhs."""
    compiled = compile_for_sm90(_LOWER_GMM, dtype)
    assert compiled == ["gmm_kernel", "gmm_kernel", "tgmm_kernel"], compiled


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("m,k,n,g", [(4096, 512, 256, 8), (3000, 1024, 512, 16)])
def test_gpu_matches_ragged_dot(m, k, n, g):
    """The compiled kernel (default tiles) against XLA's ragged_dot, bf16, uneven groups with empties."""
    rng = np.random.default_rng(m + g)
    sizes = rng.multinomial(m - 100, rng.dirichlet(np.ones(g)))
    sizes[0], sizes[1] = sizes[0] + sizes[1], 0  # one empty group; 100 rows past the sum
    x, w, s, dy = _inputs(m, k, n, [int(v) for v in sizes], jnp.bfloat16, seed=3)
    w = (w / np.sqrt(k)).astype(w.dtype)  # a numpy float64 scalar would promote bf16 to fp32
    got = _out_and_grads(gmm, x, w, s, dy)
    want = _out_and_grads(jax.lax.ragged_dot, x, w, s, dy)
    _check(got, want, 2e-2)


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_path_prints_no_deprecation_warning(capfd):
    # jax-triton's calls are not Pallas's Triton lowering, which jax 0.11 reports as deprecated at each call.
    x, w, s, dy = _inputs(1000, 256, 128, [300, 0, 500, 150], jnp.bfloat16, seed=4)
    loss = lambda x, w: jnp.vdot(gmm(x, w, s).astype(jnp.float32), dy.astype(jnp.float32))  # noqa: E731
    assert_grad_prints_no_deprecation(loss, (x, w), capfd)
