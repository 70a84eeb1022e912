"""flash_attention's Triton backend against the jnp reference: on the CPU in Triton's interpreter
(interpret=True), on a GPU compiled through jax-triton (`gpu` marker).

Tolerances, as relative L2 error ||kernel - ref|| / ||ref||:
  fp32: 1e-5. Interpret mode does the kernel's dots in exact fp32; the only difference from the
        reference is summation order (online softmax vs. one softmax), ~1e-7 per element.
  bf16/fp16: 2e-2. The kernel rounds p (and ds in the backward) to the input dtype before the
        second matmul, as every flash kernel does: 2^-8 relative per element for bf16. (Interpreted,
        a bf16 kernel computes in fp32: pallas_kernels/triton_launch.py says why.)
  GPU fp32: 1e-4, the kernels' products in full fp32 (not tf32) against a reference held to fp32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_attention_grad_prints_no_deprecation, packed_segment_ids
from pallas_kernels import FlashAttentionBlockSizes, flash_attention, flash_attention_reference

# Small tiles so every test walks several blocks (and the dkdv/dq tiles differ from the forward's).
SMALL = FlashAttentionBlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32,
                                 block_q_dq=32, block_k_dq=16)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30)


def _inputs(seed, b, t, s, h, k, e, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, t, h, e), jnp.float32).astype(dtype)
    kk = jax.random.normal(ks[1], (b, s, k, e), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, k, e), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, t, h, e), jnp.float32).astype(dtype)
    dlse = jax.random.normal(ks[4], (b, h, t), jnp.float32)
    return q, kk, v, do, dlse


def _outputs_and_grads(fn, q, k, v, do, dlse):
    """(o, lse, dq, dk, dv) with cotangents on both o and lse, in one jitted program."""
    def run(q, k, v):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        return (o, lse) + vjp((do, dlse))
    return jax.jit(run)(q, k, v)


def _check(b, t, s, h, k, e, *, causal, dtype=jnp.float32, segment_ids=None, seed=0,
           block_sizes=SMALL):
    q, kk, v, do, dlse = _inputs(seed, b, t, s, h, k, e, dtype)
    kern = functools.partial(flash_attention, causal=causal, segment_ids=segment_ids,
                             return_lse=True, block_sizes=block_sizes, interpret=True)
    ref = functools.partial(flash_attention_reference, causal=causal, segment_ids=segment_ids,
                            return_lse=True)
    got = _outputs_and_grads(kern, q, kk, v, do, dlse)
    want = _outputs_and_grads(ref, q, kk, v, do, dlse)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    o, lse = got[0], got[1]
    assert o.dtype == dtype and lse.dtype == jnp.float32
    # -inf exactly where the reference says a query sees no key; finite (never NaN) elsewhere.
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))
    assert not np.isnan(np.asarray(lse)).any()
    for name, g in zip(("o", "dq", "dk", "dv"), (got[0],) + got[2:]):
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name} has a non-finite value"
    finite = np.isfinite(np.asarray(want[1]))
    tol = TOL[dtype]
    for name, g, w in zip(names, got, want):
        if name == "lse":
            g, w = np.asarray(g)[finite], np.asarray(w)[finite]
        err = _rel(g, w)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"
    return got, want


@pytest.mark.parametrize("b,t,s,h,k,e,causal", [
    (1, 40, 40, 4, 1, 64, True),    # GQA H/K = 4, T not a block multiple
    (2, 37, 37, 2, 2, 128, False),  # full attention, H/K = 1, head dim 128
    (1, 24, 56, 2, 1, 64, True),    # T < S: bottom-right causal, every query sees >= 33 keys
])
def test_matches_reference_fp32(b, t, s, h, k, e, causal):
    _check(b, t, s, h, k, e, causal=causal)


def test_t_longer_than_s_masks_whole_rows():
    # offset S - T = -32: queries 0..31 see no key -> o = 0, lse = -inf, zero (finite) dq rows.
    (o, lse, dq, _, _), _ = _check(1, 56, 24, 2, 2, 64, causal=True)
    np.testing.assert_array_equal(np.asarray(o)[:, :32], 0.0)
    assert np.isneginf(np.asarray(lse)[:, :, :32]).all()
    assert np.isfinite(np.asarray(lse)[:, :, 32:]).all()
    np.testing.assert_array_equal(np.asarray(dq)[:, :32], 0.0)


def test_segment_ids_causal_gqa():
    seg = jnp.array([[0] * 10 + [1] * 20 + [2] * 7, [5] * 37])
    _check(2, 37, 37, 4, 2, 64, causal=True, segment_ids=seg, seed=1)


def test_segment_id_pair_with_unmatched_queries():
    # Queries of segment 9 have no key of their segment: zeros and lse = -inf, finite gradients.
    q_seg = jnp.array([[0] * 8 + [1] * 12 + [9] * 5])
    kv_seg = jnp.array([[0] * 20 + [1] * 19])
    (o, lse, *_), _ = _check(1, 25, 39, 2, 1, 64, causal=False, segment_ids=(q_seg, kv_seg), seed=2)
    np.testing.assert_array_equal(np.asarray(o)[:, 20:], 0.0)
    assert np.isneginf(np.asarray(lse)[:, :, 20:]).all()


@pytest.mark.parametrize("dtype,causal", [(jnp.bfloat16, True), (jnp.float16, False)])
def test_half_precision(dtype, causal):
    _check(1, 48, 48, 4, 1, 64, causal=causal, dtype=dtype, seed=3)


def test_default_block_sizes_short_sequence():
    # Default tiles clamp to the (rounded) length: one block of 32, T = S = 20 padded inside.
    _check(1, 20, 20, 2, 2, 64, causal=True, block_sizes=None, seed=4)


def test_odd_head_dim_is_padded():
    _check(1, 17, 17, 2, 1, 40, causal=True, seed=5)


def test_return_lse_false_returns_output_only():
    q, k, v, _, _ = _inputs(6, 1, 16, 16, 2, 2, 64, jnp.float32)
    o = flash_attention(q, k, v, block_sizes=SMALL, interpret=True)
    assert _rel(o, flash_attention_reference(q, k, v)) < TOL[jnp.float32]


@pytest.mark.parametrize("q_shape,k_shape,kwargs,match", [
    ((1, 8, 3, 64), (1, 8, 2, 64), {}, "H=3 must be a multiple of kv heads K=2"),
    ((1, 8, 2, 64), (1, 8, 2, 32), {}, "E=64"),
    ((1, 8, 2), (1, 8, 2, 64), {}, "rank 4"),
    ((2, 8, 2, 64), (1, 8, 2, 64), {}, "B=2"),
    ((1, 8, 2, 64), (1, 6, 2, 64), {"segment_ids": jnp.zeros((1, 8), jnp.int32)}, "T=8, S=6"),
    ((1, 8, 2, 64), (1, 8, 2, 64), {"segment_ids": jnp.zeros((1, 7), jnp.int32)}, r"\(1, 7\)"),
    ((1, 8, 2, 64), (1, 8, 2, 64), {"segment_ids": jnp.zeros((1, 8), jnp.float32)}, "integers"),
])
def test_bad_arguments_raise(q_shape, k_shape, kwargs, match):
    q = jnp.ones(q_shape, jnp.float32)
    k = jnp.ones(k_shape, jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, interpret=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        flash_attention_reference(q, k, k, **kwargs)


def test_bad_dtype_and_block_sizes_raise():
    q = jnp.ones((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(q, q.astype(jnp.bfloat16), q.astype(jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="int32"):
        flash_attention(q.astype(jnp.int32), q, q, interpret=True)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16; got 24"):
        FlashAttentionBlockSizes(block_k=24)


GPU_CASES = {
    # name: (b, t, s, h, k, e, causal, dtype, document lengths); the Mosaic tests' cases, and what only
    # the Triton kernels take (head dims 32 and 256, float32).
    "causal_gqa_e128": (2, 1024, 1024, 8, 2, 128, True, jnp.bfloat16, None),
    "full_mha_e128": (2, 1024, 1024, 8, 8, 128, False, jnp.bfloat16, None),
    "causal_ragged_t_lt_s_e64": (2, 1000, 1536, 4, 4, 64, True, jnp.bfloat16, None),
    "causal_t_gt_s_gqa_e64": (1, 1536, 1000, 4, 2, 64, True, jnp.bfloat16, None),
    "causal_segments_gqa": (2, 1024, 1024, 4, 2, 128, True, jnp.bfloat16, (300, 77, 500, 147)),
    "causal_fp16": (1, 1024, 1024, 4, 4, 128, True, jnp.float16, None),
    "causal_gqa_e256": (2, 512, 512, 4, 1, 256, True, jnp.bfloat16, None),
    "full_ragged_e32_fp32": (1, 333, 777, 4, 2, 32, False, jnp.float32, None),
}


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_triton_matches_reference(case):
    """The Triton kernels compiled by Triton (through jax-triton), against the reference."""
    b, t, s, h, k, e, causal, dtype, lengths = GPU_CASES[case]
    q, kk, v, do, dlse = _inputs(7, b, t, s, h, k, e, dtype)
    seg = packed_segment_ids(b, t, lengths) if lengths else None
    common = dict(causal=causal, segment_ids=seg, return_lse=True)
    got = _outputs_and_grads(functools.partial(flash_attention, backend="triton", **common), q, kk, v, do, dlse)
    with jax.default_matmul_precision("float32"):  # XLA may otherwise take tf32 for the fp32 case
        want = _outputs_and_grads(functools.partial(flash_attention_reference, **common), q, kk, v, do, dlse)
    finite = np.isfinite(np.asarray(want[1]))
    errors = {}
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        if name == "lse":
            assert (np.isneginf(np.asarray(g)) == ~finite).all(), "lse: -inf rows differ"
            g, w = np.asarray(g)[finite], np.asarray(w)[finite]
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name}: non-finite values"
        errors[name] = _rel(g, w)
    assert max(errors.values()) < (1e-4 if dtype == jnp.float32 else 2e-2), errors


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_triton_path_prints_no_deprecation_warning(capfd):
    # jax-triton's calls are not Pallas's Triton lowering, which jax 0.11 reports as deprecated.
    assert_attention_grad_prints_no_deprecation(functools.partial(flash_attention, backend="triton"), capfd)


def test_compiled_launch_after_interpreted_one_is_a_clear_error():
    """Triton's interpreter is a mode of the whole process: once a launch turned it on, a launch that
    wants the compiled kernels says so instead of failing inside Triton."""
    q = jnp.ones((1, 16, 2, 64), jnp.float32)
    flash_attention(q, q, q, interpret=True, backend="triton")
    with pytest.raises(RuntimeError, match="Triton's interpreter is on in this process"):
        flash_attention(q, q, q, interpret=False, backend="triton")
