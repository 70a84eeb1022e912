"""flash_attention's Mosaic GPU backend against the jnp reference (GPU tests), and backend selection.

The Mosaic kernels do not run on the CPU: jax's Mosaic GPU interpreter takes no transposed wgmma
operands and no `run_state` accumulators, both of which every attention GEMM here uses. The CPU traces
them (every kernel body to a jaxpr) and lowers them to Mosaic GPU's IR, which is all but compiling;
they run on a Hopper GPU (`pytest -m gpu`), on the cases the Triton kernel is tested on.

Tolerance: relative L2 error 2e-2 for bf16/fp16, as for the Triton kernel: p (and ds in the
backward) is rounded to the input dtype before its second matmul, 2^-8 relative per element in bf16.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import all_eqns, assert_attention_grad_prints_no_deprecation, packed_segment_ids
from pallas_kernels import MosaicBlockSizes, flash_attention, flash_attention_reference
from pallas_kernels.attention.mosaic_common import is_hopper

TOL = 2e-2
hopper = pytest.mark.skipif(not (jax.default_backend() == "gpu" and is_hopper()), reason="needs a Hopper GPU")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30)


def _inputs(seed, b, t, s, h, k, e, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
    return (normal(ks[0], (b, t, h, e)), normal(ks[1], (b, s, k, e)), normal(ks[2], (b, s, k, e)),
            normal(ks[3], (b, t, h, e)), jax.random.normal(ks[4], (b, h, t), jnp.float32))


def _outputs_and_grads(fn, q, k, v, do, dlse):
    def run(q, k, v):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        return (o, lse) + vjp((do, dlse))
    return jax.jit(run)(q, k, v)


CASES = {
    # name: (b, t, s, h, k, e, causal, dtype, segments, block_sizes)
    "causal_gqa_e128": (2, 1024, 1024, 8, 2, 128, True, jnp.bfloat16, None, None),
    "full_mha_e128": (2, 1024, 1024, 8, 8, 128, False, jnp.bfloat16, None, None),
    "causal_ragged_t_lt_s_e64": (2, 1000, 1536, 4, 4, 64, True, jnp.bfloat16, None, None),
    "causal_t_gt_s_gqa_e64": (1, 1536, 1000, 4, 2, 64, True, jnp.bfloat16, None, None),
    "full_ragged_e64": (2, 333, 777, 4, 1, 64, False, jnp.bfloat16, None, None),
    "causal_segments_gqa": (2, 1024, 1024, 4, 2, 128, True, jnp.bfloat16, (300, 77, 500, 147), None),
    "full_segments_ragged": (1, 900, 900, 2, 2, 64, False, jnp.bfloat16, (128, 500, 31), None),
    "causal_fp16": (1, 1024, 1024, 4, 4, 128, True, jnp.float16, None, None),
    # Non-default tiles, and the other dQ path (a dQ kernel that recomputes S and dP).
    "causal_dq_kernel_k64_stages3": (1, 1024, 1024, 4, 2, 128, True, jnp.bfloat16, None,
                                     MosaicBlockSizes(block_k=64, stages=3, block_k_dq=128, block_q_dkv=128,
                                                      dq_atomic=False)),
    "segments_dq_kernel_e64": (2, 700, 700, 4, 2, 64, True, jnp.bfloat16, (200, 33, 467),
                               MosaicBlockSizes(dq_atomic=False)),
    "full_dq_kernel_gqa": (1, 512, 640, 4, 2, 128, False, jnp.bfloat16, None, MosaicBlockSizes(dq_atomic=False)),
    "causal_ragged_t_lt_s_dq_kernel": (2, 1000, 1536, 4, 2, 128, True, jnp.bfloat16, None,
                                       MosaicBlockSizes(dq_atomic=False)),
    "causal_t_gt_s_dq_kernel_fp16": (1, 1536, 1000, 4, 4, 128, True, jnp.float16, None,
                                     MosaicBlockSizes(dq_atomic=False)),
    "causal_segments_dq_kernel_e128": (2, 1024, 1024, 4, 2, 128, True, jnp.bfloat16, (300, 77, 500, 147),
                                       MosaicBlockSizes(dq_atomic=False)),
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", list(CASES))
def test_mosaic_matches_reference(case):
    b, t, s, h, k, e, causal, dtype, lengths, bs = CASES[case]
    q, kk, v, do, dlse = _inputs(3, b, t, s, h, k, e, dtype)
    seg = packed_segment_ids(b, t, lengths) if lengths else None
    common = dict(causal=causal, segment_ids=seg, return_lse=True)
    got = _outputs_and_grads(functools.partial(flash_attention, backend="mosaic", block_sizes=bs, **common),
                             q, kk, v, do, dlse)
    want = _outputs_and_grads(functools.partial(flash_attention_reference, **common), q, kk, v, do, dlse)
    errors = {}
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        if name == "lse":  # rows that see no key: -inf in both
            g, w = np.asarray(g), np.asarray(w)
            assert (np.isneginf(g) == np.isneginf(w)).all(), "lse: -inf rows differ"
            g, w = np.where(np.isneginf(w), 0.0, g), np.where(np.isneginf(w), 0.0, w)
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name}: non-finite values"
        errors[name] = _rel(g, w)
    assert max(errors.values()) < TOL, {n: f"{err:.2e}" for n, err in errors.items()}


@pytest.mark.gpu
@hopper
def test_default_path_prints_no_deprecation_warning(capfd):
    # `auto` on Hopper runs the Mosaic kernels, none lowered through Pallas's Triton backend.
    assert_attention_grad_prints_no_deprecation(flash_attention, capfd)


def test_backend_names_and_where_mosaic_cannot_run_are_clear_errors():
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="backend must be one of auto, mosaic, triton; got 'cuda'"):
        flash_attention(q, q, q, backend="cuda", interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic' cannot run here: interpret mode"):
        flash_attention(q, q, q, backend="mosaic", interpret=True)
    if not is_hopper():
        with pytest.raises(ValueError, match="need a Hopper GPU"):
            flash_attention(q, q, q, backend="mosaic")
    with pytest.raises(ValueError, match="block_k must be 64, 128 or 256; got 32"):
        MosaicBlockSizes(block_k=32)
    with pytest.raises(ValueError, match="stages must be a positive int; got 0"):
        MosaicBlockSizes(stages=0)
    with pytest.raises(ValueError, match=r"dq_atomic \(the default\) needs block_q_dkv=64 .*; got block_q_dkv=128; "
                                         r"set dq_atomic=False for larger query tiles"):
        MosaicBlockSizes(block_q_dkv=128)


def test_auto_runs_the_triton_kernels_where_mosaic_cannot():
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 40, 2, 32), jnp.float32)
    auto = flash_attention(q, q, q, interpret=True)
    triton = flash_attention(q, q, q, interpret=True, backend="triton")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(triton))


def _mosaic_plan(causal, has_seg, t=250, pad=256, blocks=None):
    from pallas_kernels.attention.plan import AttentionPlan, FlashAttentionBlockSizes
    return AttentionPlan(causal=causal, sm_scale=0.125, t_real=t, s_real=t, t_pad=pad, s_pad=pad, has_seg=has_seg,
                         blocks=FlashAttentionBlockSizes(), interpret=False, backend="mosaic",
                         mosaic=blocks or MosaicBlockSizes())


@pytest.mark.parametrize("causal,has_seg,dq_atomic,e", [(True, False, False, 128), (False, True, False, 128),
                                                        (True, True, True, 128), (True, False, True, 64)])
def test_mosaic_kernels_trace_on_any_backend(causal, has_seg, dq_atomic, e):
    """The kernel bodies trace to jaxprs and lower to Mosaic GPU (no GPU needed): what the CPU can check
    of them. Each kernel is one mpmd_map; the forward's is the one the remat policy `save_dots_attn` keeps.
    Head dim 64 runs its own tiles (three stages) and, under dq_atomic, dQ over each consumer's own keys."""
    from meshtrain.model.remat import fused_attention_forward
    from pallas_kernels.attention.mosaic_bwd import mosaic_attention_backward
    from pallas_kernels.attention.mosaic_fwd import mosaic_attention_forward
    blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(e), dq_atomic=dq_atomic)
    plan = _mosaic_plan(causal, has_seg, blocks=blocks)
    q = jnp.zeros((2, 256, 4, e), jnp.bfloat16)
    kv = jnp.zeros((2, 256, 2, e), jnp.bfloat16)
    seg = jnp.zeros((2, 256), jnp.int32) if has_seg else None
    lse = jnp.zeros((2, 4, 256), jnp.float32)
    fwd = jax.make_jaxpr(lambda q, k, v: mosaic_attention_forward(q, k, v, seg, seg, plan))(q, kv, kv)
    bwd = jax.make_jaxpr(lambda q, k, v: mosaic_attention_backward(q, k, v, seg, seg, q, lse, q, lse, plan))(q, kv, kv)
    kernels = lambda jx: [eqn for eqn in jx.jaxpr.eqns if eqn.primitive.name == "mpmd_map"]
    assert [eqn.params["name"] for eqn in kernels(fwd)] == ["flash_attention_fwd_mosaic"]
    assert [fused_attention_forward(eqn.primitive, **eqn.params) for eqn in kernels(fwd)] == [True]
    names = [eqn.params["name"] for eqn in kernels(bwd)]
    assert names == (["flash_attention_dkdv_mosaic"] if dq_atomic else
                     ["flash_attention_dkdv_mosaic", "flash_attention_dq_mosaic"])
    assert not any(fused_attention_forward(eqn.primitive, **eqn.params) for eqn in kernels(bwd))
    # Lowered for CUDA too, on any backend: Pallas lowers each body to Mosaic GPU's IR (layouts, wgmma
    # operand shapes, SMEM slices), so what is wrong there fails here; only compiling needs the GPU.
    for fn, args in ((lambda q, k, v: mosaic_attention_forward(q, k, v, seg, seg, plan), (q, kv, kv)),
                     (lambda q, k, v: mosaic_attention_backward(q, k, v, seg, seg, q, lse, q, lse, plan), (q, kv, kv))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == len(kernels(jax.make_jaxpr(fn)(*args)))


def test_tiles_past_shared_memory_are_a_clear_error():
    """Four backward stages of E = 128 tiles under dq_atomic need 258 KiB of SMEM (traced on any backend)."""
    from pallas_kernels.attention.mosaic_bwd import mosaic_attention_backward
    plan = _mosaic_plan(True, False, t=512, pad=512, blocks=MosaicBlockSizes(stages_bwd=4, dq_atomic=True))
    q = jnp.zeros((1, 512, 2, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 512), jnp.float32)
    with pytest.raises(ValueError, match=r"flash_attention_dkdv_mosaic needs 258 KiB of shared memory at "
                                         r"MosaicBlockSizes.stages_bwd=4, more than the 227 KiB of a Hopper SM; "
                                         r"lower stages_bwd"):
        jax.make_jaxpr(lambda q: mosaic_attention_backward(q, q, q, None, None, q, lse, q, lse, plan))(q)


@pytest.mark.parametrize("policy,fwd_calls", [("save_dots", 2), ("save_dots_attn", 1)])
def test_remat_policy_keeps_the_mosaic_forward(policy, fwd_calls):
    """Under save_dots_attn the gradient runs the Mosaic forward kernel once, under save_dots twice (traced
    on any backend). The kernel has effects, so it is never dropped from a recomputation: the policy must
    save the kernel itself, not only its named outputs."""
    from meshtrain.model.remat import remat_policy
    from pallas_kernels.attention.api import _flash
    plan = _mosaic_plan(causal=True, has_seg=False, t=256)
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        q = q @ jnp.eye(128, dtype=q.dtype)  # a saved dot in front, as the projections are
        o, lse = _flash(q, k, v, None, None, plan)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    grad = jax.grad(jax.checkpoint(loss, policy=remat_policy(policy)), argnums=(0, 1, 2))
    eqns = all_eqns(jax.make_jaxpr(grad)(q, q, q).jaxpr)
    names = [e.params["name"] for e in eqns if e.primitive.name == "mpmd_map"]
    assert names.count("flash_attention_fwd_mosaic") == fwd_calls, names
