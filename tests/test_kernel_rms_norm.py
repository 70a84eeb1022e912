"""rms_norm (its Triton kernels; on the CPU in Triton's interpreter, where bf16 computes in fp32) against the
jnp reference.

Tolerances (relative L2 error): fp32 1e-5 (same fp32 math, only reduction order differs);
bf16 1e-2 (the kernel adds ds to dx in fp32 and rounds once; the reference rounds the norm's
gradient and the sum separately: one extra bf16 rounding, 2^-8 relative).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_grad_prints_no_deprecation, compile_for_sm90
from pallas_kernels import RmsNormBlockSizes, rms_norm, rms_norm_reference

# The default backward scheme (persistent grid, prefetch) at a small size: 12 chunks of 4 rows
# over 5 programs (3,3,2,2,2 chunks each) for 39 and 40 rows.
SMALL = RmsNormBlockSizes(block_rows=4, block_rows_bwd=16, chunk_rows_bwd=4, programs_bwd=5, prefetch_bwd=True)
# Other backward variants: one program per 16-row block (with and without prefetch); persistent
# without prefetch; more programs than chunks (64 asked, 24 chunks of 2 rows: clamped to 24).
BWD_VARIANTS = {
    "grid": RmsNormBlockSizes(block_rows=4, block_rows_bwd=16, chunk_rows_bwd=4, programs_bwd=0,
                              prefetch_bwd=False),
    "grid_prefetch": RmsNormBlockSizes(block_rows=4, block_rows_bwd=16, chunk_rows_bwd=4, programs_bwd=0),
    "persistent5": RmsNormBlockSizes(block_rows=4, block_rows_bwd=16, chunk_rows_bwd=4, programs_bwd=5,
                                     prefetch_bwd=False),
    "persistent64_prefetch": RmsNormBlockSizes(block_rows=4, block_rows_bwd=16, chunk_rows_bwd=2,
                                               programs_bwd=64),
}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30)


def _run(fn, x, r, w, cts, with_res):
    def f(x, r, w):
        out, vjp = jax.vjp(lambda x, r, w: fn(x, w, residual=r if with_res else None), x, r, w)
        return out, vjp(cts)
    return jax.jit(f)(x, r, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("shape", [(3, 13, 96), (40, 64)])  # 39 rows (not a block multiple), D not 2^k
def test_matches_reference(dtype, with_res, shape):
    _check_against_reference(dtype, with_res, shape, SMALL)


@pytest.mark.parametrize("variant", sorted(BWD_VARIANTS))
@pytest.mark.parametrize("dtype,with_res", [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True)])
def test_backward_variants_match_reference(variant, dtype, with_res):
    _check_against_reference(dtype, with_res, (3, 13, 96), BWD_VARIANTS[variant])


def _check_against_reference(dtype, with_res, shape, block_sizes):
    ks = jax.random.split(jax.random.PRNGKey(sum(shape) + with_res), 5)
    x = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    r = jax.random.normal(ks[1], shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.2 * jax.random.normal(ks[2], shape[-1:], jnp.float32)).astype(dtype)
    dy = jax.random.normal(ks[3], shape, jnp.float32).astype(dtype)
    ds = jax.random.normal(ks[4], shape, jnp.float32).astype(dtype)
    cts = (dy, ds) if with_res else dy
    kern = lambda x, w, residual: rms_norm(x, w, residual=residual, block_sizes=block_sizes, interpret=True)
    out, grads = _run(kern, x, r, w, cts, with_res)
    out_ref, grads_ref = _run(rms_norm_reference, x, r, w, cts, with_res)
    outs, outs_ref = jax.tree.leaves(out), jax.tree.leaves(out_ref)
    assert len(outs) == (2 if with_res else 1)
    names = ["y", "s"][:len(outs)] + ["dx", "dresidual", "dw"]
    grads, grads_ref = list(grads), list(grads_ref)
    if not with_res:  # residual unused: the reference's cotangent is zeros, the kernel's None->zeros
        grads, grads_ref = [grads[0], grads[2]], [grads_ref[0], grads_ref[2]]
        names = ["y", "dx", "dw"]
    for name, g, want in zip(names, outs + grads, outs_ref + grads_ref):
        assert g.shape == want.shape and g.dtype == want.dtype, (name, g.shape, want.shape)
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        err = _rel(g, want)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e}"


def test_default_block_sizes_and_eps():
    x = jax.random.normal(jax.random.PRNGKey(0), (70, 128), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (128,), jnp.float32)
    got = rms_norm(x, w, eps=1e-3, interpret=True)
    assert _rel(got, rms_norm_reference(x, w, eps=1e-3)) < 1e-5
    assert _rel(got, rms_norm_reference(x, w, eps=1e-6)) > 1e-6  # eps is honoured


@pytest.mark.parametrize("x_shape,w_shape,r_shape,match", [
    ((4, 8), (7,), None, r"w must have shape \(D,\) = \(8,\).*got w.shape=\(7,\)"),
    ((4, 8), (8,), (4, 9), r"residual.shape=\(4, 9\) must equal x.shape=\(4, 8\)"),
])
def test_bad_shapes_raise(x_shape, w_shape, r_shape, match):
    r = None if r_shape is None else jnp.ones(r_shape)
    with pytest.raises(ValueError, match=match):
        rms_norm(jnp.ones(x_shape), jnp.ones(w_shape), residual=r, interpret=True)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="eps must be > 0; got 0"):
        rms_norm(jnp.ones((4, 8)), jnp.ones((8,)), eps=0, interpret=True)
    with pytest.raises(ValueError, match="int32"):
        rms_norm(jnp.ones((4, 8), jnp.int32), jnp.ones((8,)), interpret=True)
    with pytest.raises(ValueError, match="block_rows must be a power of two; got 3"):
        RmsNormBlockSizes(block_rows=3)
    with pytest.raises(ValueError, match="programs_bwd must be an int >= 0; got -1"):
        RmsNormBlockSizes(programs_bwd=-1)
    with pytest.raises(ValueError, match="prefetch_bwd must be a bool; got 1"):
        RmsNormBlockSizes(prefetch_bwd=1)


# The compiled path lowered in a fresh process, each kernel compiled by Triton for an H100 (helpers.compile_for_sm90).
_LOWER_RMS_NORM = """
from pallas_kernels import RmsNormBlockSizes, rms_norm

dtype, x = jnp.dtype(sys.argv[1]), jax.ShapeDtypeStruct((4000, 2000), jnp.dtype(sys.argv[1]))
for block_sizes in (None, RmsNormBlockSizes(programs_bwd=0, prefetch_bwd=False)):
    for with_res in (False, True):
        def f(x, r, w, cts):
            out, vjp = jax.vjp(lambda x, r, w: rms_norm(x, w, residual=r if with_res else None,
                                                         block_sizes=block_sizes), x, r, w)
            return out, vjp(cts)
        jax.jit(f).lower(x, x, jax.ShapeDtypeStruct((2000,), dtype), (x, x) if with_res else x)
print("compiled:", *compiled)
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiles_for_sm90_without_a_gpu(dtype):
    """The compiled path (interpret=False) through the launcher, each kernel compiled by Triton for an H100
    from the CPU: catches an operation, type or shape Triton's compiler rejects, which the interpreter
    accepts, before a GPU ever sees it. Forward and backward, with and without a residual, for the
    persistent prefetching backward (the default) and the grid backward without prefetch."""
    compiled = compile_for_sm90(_LOWER_RMS_NORM, dtype)
    assert compiled == ["rms_norm_fwd", "rms_norm_bwd"] * 4, compiled


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("block_sizes", [
    None,  # persistent, 264 programs: 2000 chunks of 2 rows, unequal per program
    RmsNormBlockSizes(programs_bwd=0, prefetch_bwd=False),
    RmsNormBlockSizes(programs_bwd=0),
    RmsNormBlockSizes(chunk_rows_bwd=4, num_warps_bwd=8, programs_bwd=528, prefetch_bwd=False),
], ids=["default", "grid", "grid_prefetch", "persistent528"])
@pytest.mark.parametrize("with_res", [False, True])
def test_gpu_matches_reference(with_res, block_sizes):
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    shape = (4000, 2048)
    x, r, dy, ds = (jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in ks[:4])
    w = (1.0 + 0.2 * jax.random.normal(ks[4], (2048,))).astype(jnp.bfloat16)
    cts = (dy, ds) if with_res else dy
    out, grads = _run(functools.partial(rms_norm, block_sizes=block_sizes), x, r, w, cts, with_res)
    out_ref, grads_ref = _run(rms_norm_reference, x, r, w, cts, with_res)
    for g, want in zip(jax.tree.leaves((out, grads)), jax.tree.leaves((out_ref, grads_ref))):
        if not np.asarray(want, np.float32).any():
            continue  # residual cotangent without residual: zeros on both sides
        assert _rel(g, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("with_res", [False, True])
def test_gpu_path_prints_no_deprecation_warning(with_res, capfd):
    """Forward and backward neither raise a DeprecationWarning nor print one: jax 0.11 warns at every call
    of a Pallas kernel lowered through Triton; these kernels go through jax-triton instead."""
    ks = jax.random.split(jax.random.PRNGKey(5), 5)
    x, r, dy, ds = (jax.random.normal(k, (256, 512), jnp.float32).astype(jnp.bfloat16) for k in ks[:4])
    w = (1.0 + 0.2 * jax.random.normal(ks[4], (512,))).astype(jnp.bfloat16)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    if with_res:  # outputs (y, s): the loss pairs each with its cotangent
        def loss(x, r, w):
            y, s = rms_norm(x, w, residual=r)
            return jnp.vdot(f32(y), f32(dy)) + jnp.vdot(f32(s), f32(ds))
        assert_grad_prints_no_deprecation(loss, (x, r, w), capfd)
    else:
        loss = lambda x, w: jnp.vdot(f32(rms_norm(x, w)), f32(dy))  # noqa: E731
        assert_grad_prints_no_deprecation(loss, (x, w), capfd)
