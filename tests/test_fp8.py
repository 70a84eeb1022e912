"""The fp8 matmul recipes against an independent numpy emulation and against fp32, values and gradients.

Two checks per recipe and GEMM:

1. Emulation (tight). numpy (ml_dtypes) quantizes the operands as the recipe specifies (e4m3 forward,
   e5m2 gradients, power-of-two scales per tensor / per 1x128 tile / per 128x128 block) and multiplies
   in float64. The recipe must agree to fp32 accumulation error: |err| <= K * 2^-24 * (|a| @ |b|) on the
   quantized operands (the products of fp8 values are exact in fp32; only the K additions round).
   Any other format, scale or tiling moves operands by a whole fp8 step (>= 2^-4 relative) and fails.

2. Error bound against the fp32 product (what the recipe costs). A value v stored with scale s has
   |v^ - v| <= u |v| + s d (u: half an ulp, 2^-4 for e4m3 with 3 mantissa bits, 2^-3 for e5m2 with 2;
   d: half the smallest subnormal, 2^-10 for e4m3, 2^-17 for e5m2). With e_a = u_a |a| + s_a d_a,
     |a^ . b^ - a . b| <= e_a @ |b| + (|a| + e_a) @ e_b + K 2^-24 (|a| + e_a) @ (|b| + e_b)
   element by element, from a^ b^ - a b = (a^ - a) b + a^ (b^ - b). For unit-scale random data that is
   about 2u (12% for e4m3 x e4m3) of |a| @ |b|; the recipe must stay inside it and (so that a silent
   bf16 fallback would be caught) show an error larger than bf16's 2^-9.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from meshtrain import fp8
from meshtrain.precision import Precision, cast_sites

E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
U = {E4: 2.0 ** -4, E5: 2.0 ** -3}
HALF_SUBNORMAL = {E4: 2.0 ** -10, E5: 2.0 ** -17}
FMAX = {E4: 448.0, E5: 57344.0}
RECIPES = ("fp8", "fp8_delayed", "fp8_blockwise")
M, K, N = 40, 256, 120  # K: two 128-tiles; N: one full and one padded tile; M: a padded tile


# ------------------------------------------------------------------------------- numpy emulation


def np_pow2_scale(amax, fmt):
    amax = np.asarray(amax, np.float64)
    s = 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / FMAX[fmt]))
    return np.where(amax > 0, s, 1.0)


def np_quant(v, s, fmt):
    """(dequantized value, per-element scale) of v rounded through fmt with scales s (broadcastable)."""
    s = np.broadcast_to(s, v.shape)
    q = np.clip(v / s, -FMAX[fmt], FMAX[fmt]).astype(np.float32).astype(fmt).astype(np.float64)
    return q * s, s


def np_tiles(v, fmt):
    """1x128 tiles along the last dim: per-element scales."""
    r, c = v.shape
    cp = -(-c // 128) * 128
    padded = np.zeros((r, cp)); padded[:, :c] = np.abs(v)
    s = np_pow2_scale(padded.reshape(r, cp // 128, 128).max(-1), fmt)
    return np.repeat(s, 128, axis=1)[:, :c]


def np_blocks(v, fmt):
    r, c = v.shape
    rp, cp = -(-r // 128) * 128, -(-c // 128) * 128
    padded = np.zeros((rp, cp)); padded[:r, :c] = np.abs(v)
    s = np_pow2_scale(padded.reshape(rp // 128, 128, cp // 128, 128).max(axis=(1, 3)), fmt)
    return np.repeat(np.repeat(s, 128, 0), 128, 1)[:r, :c]


def emulate(recipe, x, w, g, hist=None):
    """(y, dx, dw) and the quantized operands of each GEMM [(a^, s_a, fmt_a, a, b^, s_b, fmt_b, b)]."""
    if recipe == "fp8_blockwise":
        xs, ws = np_tiles(x, E4), np_blocks(w, E4)
        gs_n, xts, gts = np_tiles(g, E5), np_tiles(x.T, E4), np_tiles(g.T, E5)
        ops = [(x, xs, E4, w, ws, E4), (g, gs_n, E5, w.T, ws.T, E4), (x.T, xts, E4, g, gts.T, E5)]
    else:
        if hist is None:
            sx, sw, sg = np_pow2_scale(np.abs(x).max(), E4), np_pow2_scale(np.abs(w).max(), E4), \
                np_pow2_scale(np.abs(g).max(), E5)
        else:
            sx, sw, sg = (np_pow2_scale(hist[k].max(), f) for k, f in (("x", E4), ("w", E4), ("g", E5)))
        ops = [(x, sx, E4, w, sw, E4), (g, sg, E5, w.T, sw, E4), (x.T, sx, E4, g, sg, E5)]
    out = []
    for a, sa, fa, b, sb, fb in ops:
        aq, sa = np_quant(a, sa, fa)
        bq, sb = np_quant(b, sb, fb)
        out.append((aq @ bq, aq, bq, dict(a=a, sa=sa, fa=fa, b=b, sb=sb, fb=fb)))
    return out


def fp32_accumulation_bound(aq, bq):
    return aq.shape[1] * 2.0 ** -24 * (np.abs(aq) @ np.abs(bq)) + 1e-30


def quantization_bound(a, sa, fa, b, sb, fb):
    ea = U[fa] * np.abs(a) + sa * HALF_SUBNORMAL[fa]
    eb = U[fb] * np.abs(b) + sb * HALF_SUBNORMAL[fb]
    big_a, big_b = np.abs(a) + ea, np.abs(b) + eb
    return ea @ np.abs(b) + big_a @ eb + a.shape[1] * 2.0 ** -24 * (big_a @ big_b)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    # Rows of x with magnitudes over 8 binades, so tiles and tensors have different scales.
    x = rng.normal(size=(M, K)) * 2.0 ** rng.integers(-4, 4, size=(M, 1))
    w = rng.normal(size=(K, N)) * 0.02
    w[:128, :] *= 8.0  # one K-block of the weight larger than the others
    g = rng.normal(size=(M, N)) * 1e-3
    return x.astype(np.float32).astype(np.float64), w.astype(np.float32).astype(np.float64), \
        g.astype(np.float32).astype(np.float64)


def run_recipe(recipe, x, w, g, hist=None):
    """y, dx, dw (and the meta cotangent) of Precision.einsum at a site, in fp32 compute."""
    policy = Precision.from_names("float32", matmul=recipe)
    meta = None if hist is None else {k: jnp.asarray(v, jnp.float32) for k, v in hist.items()}

    @jax.jit
    def value_and_vjp(x, w, meta, g):
        y, vjp = jax.vjp(lambda x, w, meta: policy.einsum("md,dn->mn", x, w, site="mlp.w_up", meta=meta), x, w, meta)
        return (y, *vjp(g))

    y, dx, dw, dmeta = value_and_vjp(*(jnp.asarray(a, jnp.float32) for a in (x, w)), meta, jnp.asarray(g, jnp.float32))
    return np.asarray(y, np.float64), np.asarray(dx, np.float64), np.asarray(dw, np.float64), dmeta


HIST = {"x": np.array([0.0, 9.0, 3.0]), "w": np.array([0.5, 0.1, 0.0]), "g": np.array([2e-3, 0.0, 1e-3])}


@pytest.fixture(scope="module", params=RECIPES)
def results(request, operands):
    x, w, g = operands
    hist = HIST if request.param == "fp8_delayed" else None
    got = run_recipe(request.param, x, w, g, hist)
    return request.param, got, emulate(request.param, x, w, g, hist)


# ------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("gemm", ["forward y = x w", "backward dx = g w^T", "backward dw = x^T g"])
def test_recipe_equals_its_emulation(results, gemm):
    recipe, (y, dx, dw, _), emu = results
    i = ["forward y = x w", "backward dx = g w^T", "backward dw = x^T g"].index(gemm)
    got = (y, dx, dw)[i]
    want, aq, bq, _ = emu[i]
    bound = fp32_accumulation_bound(aq, bq)
    assert np.all(np.abs(got - want) <= bound), f"{recipe} {gemm}: max excess {np.max(np.abs(got - want) / bound)}"


@pytest.mark.parametrize("gemm", ["forward y = x w", "backward dx = g w^T", "backward dw = x^T g"])
def test_recipe_error_against_fp32_is_within_the_bound(results, operands, gemm):
    recipe, (y, dx, dw, _), emu = results
    x, w, g = operands
    i = ["forward y = x w", "backward dx = g w^T", "backward dw = x^T g"].index(gemm)
    got, exact = (y, dx, dw)[i], [x @ w, g @ w.T, x.T @ g][i]
    q = emu[i][3]
    bound = quantization_bound(q["a"], q["sa"], q["fa"], q["b"], q["sb"], q["fb"])
    if recipe == "fp8_delayed":  # a stale scale can clip: the bound holds only where nothing saturated
        unclipped = (np.abs(q["a"]) <= FMAX[q["fa"]] * q["sa"]).all(1)[:, None] & \
                    (np.abs(q["b"]) <= FMAX[q["fb"]] * q["sb"]).all(0)[None, :]
        assert unclipped.any()
        got, exact, bound = got[unclipped], exact[unclipped], bound[unclipped]
    assert np.all(np.abs(got - exact) <= bound), f"{recipe} {gemm}"
    rel = np.max(np.abs(got - exact)) / np.max(np.abs(exact))
    assert rel > 2.0 ** -9, f"{recipe} {gemm}: error {rel:.2e} is bf16-sized; fp8 was not applied"


def test_delayed_scaling_returns_the_next_histories(operands):
    *_, dmeta = run_recipe("fp8_delayed", *operands, HIST)
    # The cotangent of meta is the histories with this call's amaxes pushed in front (newest first).
    for k, a in zip("xwg", operands):
        want = np.concatenate([[np.abs(a).max()], HIST[k][:-1]]).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(dmeta[k]), want)


def subjaxprs(eqn):
    """Jaxprs nested in an equation's parameters (pjit, custom_vjp_call, ...)."""
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(j, "eqns"):
                yield j
            elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                yield j.jaxpr


def dots(jaxpr):
    """Every dot_general in a jaxpr, nested ones included: (lhs dtype, rhs dtype, dimension numbers, ndim)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            a, b = eqn.invars
            found.append((a.aval.dtype, b.aval.dtype, eqn.params["dimension_numbers"], a.aval.ndim, b.aval.ndim))
        for sub in subjaxprs(eqn):
            found += dots(sub)
    return found


def converts_to(jaxpr, dtype):
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == dtype:
            n += 1
        for sub in subjaxprs(eqn):
            n += converts_to(sub, dtype)
    return n


def grad_jaxpr(recipe):
    policy = Precision.from_names("bfloat16", matmul=recipe)
    meta = fp8.init_history(4) if recipe == "fp8_delayed" else None
    x, w = jnp.ones((2, 8, 256), jnp.bfloat16), jnp.ones((256, 4, 64), jnp.float32)

    def loss(x, w, meta):
        return jnp.sum(policy.einsum("btd,dhe->bthe", x, w, site="attn.wq", meta=meta).astype(jnp.float32))

    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w, meta).jaxpr


@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_gemm_operands_are_e4m3_forward_e5m2_backward_and_k_major(recipe):
    found = dots(grad_jaxpr(recipe))
    kinds = sorted((str(a), str(b)) for a, b, *_ in found)
    assert kinds == [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
                     ("float8_e5m2", "float8_e4m3fn")], kinds
    for _, _, ((ca, cb), (ba, bb)), nda, ndb in found:
        # K-major: both operands contract on their last dimension only (x . w^T, the "TN" GEMM).
        assert (tuple(ca), tuple(cb)) == ((nda - 1,), (ndb - 1,)) and not ba and not bb


@pytest.mark.parametrize("compute, want", [("bfloat16", ["bfloat16", "bfloat16", "float32"]),  # y, dx, dw
                                            ("float16", ["float32", "float32", "float32"])])
def test_fp8_gemms_write_the_dtype_their_result_is_wanted_in(compute, want):
    """y and dx leave the GEMM in the compute dtype and dw in the fp32 master's, with the power-of-two
    scale applied after: no fp32 result written only to be rounded. fp16 cannot hold the unscaled
    product (range), so there every GEMM writes fp32."""
    policy = Precision.from_names(compute, matmul="fp8")
    x, w = jnp.ones((2, 8, 256), compute), jnp.ones((256, 4, 64), jnp.float32)

    def loss(x, w):
        return jnp.sum(policy.einsum("btd,dhe->bthe", x, w, site="attn.wq").astype(jnp.float32))

    def gemm_results(jaxpr):  # (lhs dtype, result dtype) of every dot on fp8 operands
        out = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.dtype.itemsize == 1:
                out.append((str(eqn.invars[0].aval.dtype), str(eqn.outvars[0].aval.dtype)))
            for sub in subjaxprs(eqn):
                out += gemm_results(sub)
        return out

    found = gemm_results(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr)
    y_or_dw = sorted(r for lhs, r in found if lhs == "float8_e4m3fn")  # lhs x (forward) or x^T (dw)
    dx = [r for lhs, r in found if lhs == "float8_e5m2"]  # lhs g
    assert (y_or_dw, dx) == (sorted([want[0], want[2]]), [want[1]]), found


def test_blockwise_backward_rounds_gradients_through_e5m2():
    jaxpr = grad_jaxpr("fp8_blockwise")
    # dx's gradient tiles along N, dw's along M: two e5m2 roundings of g; x twice and w once in e4m3.
    assert converts_to(jaxpr, jnp.float8_e5m2) == 2
    assert converts_to(jaxpr, jnp.float8_e4m3fn) == 3


def test_blockwise_scales_are_per_tile():
    rng = np.random.default_rng(1)
    # Each 1x128 tile (and 128x128 block) gets its own magnitude, so a tile's scale encodes its position.
    mags = 2.0 ** rng.integers(-12, 12, size=(3, 5))
    x = (rng.uniform(0.5, 1.0, size=(3 * 128, 5 * 128)) * np.kron(mags, np.ones((128, 128)))).astype(np.float32)
    x[-1, -1] = 0.0  # a padded/partial tile shape is covered below
    tile_scales, block_scales = jax.jit(fp8.tile_scales, static_argnums=1), jax.jit(fp8.block_scales, static_argnums=1)
    tiles = np.asarray(tile_scales(jnp.asarray(x), fp8.E4M3))
    assert tiles.shape == (384, 5)
    np.testing.assert_array_equal(tiles, np_pow2_scale(np.abs(x).reshape(384, 5, 128).max(-1), E4))
    blocks = np.asarray(block_scales(jnp.asarray(x), fp8.E4M3))
    assert blocks.shape == (3, 5)
    np.testing.assert_array_equal(blocks, np_pow2_scale(np.abs(x).reshape(3, 128, 5, 128).max((1, 3)), E4))
    # Ragged shapes are padded with zeros, which change no tile's amax.
    ragged = x[:200, :300]
    np.testing.assert_array_equal(np.asarray(tile_scales(jnp.asarray(ragged), fp8.E5M2)),
                                  np_pow2_scale(np.pad(np.abs(ragged), ((0, 0), (0, 84))).reshape(200, 3, 128).max(-1),
                                                E5))
    np.testing.assert_array_equal(np.asarray(block_scales(jnp.asarray(ragged), fp8.E4M3)),
                                  np_pow2_scale(np.pad(np.abs(ragged), ((0, 56), (0, 84)))
                                                .reshape(2, 128, 3, 128).max((1, 3)), E4))


def test_pow2_scale_puts_amax_in_the_top_binade():
    amax = jnp.asarray([448.0, 449.0, 1.0, 896.0, 3e-5, 0.0, jnp.inf], jnp.float32)
    s = np.asarray(fp8.pow2_scale(amax, fp8.E4M3))
    np.testing.assert_array_equal(s, [1.0, 2.0, 2.0 ** -8, 2.0, 2.0 ** -23, 1.0, 1.0])
    finite = np.asarray(amax[:5]) / s[:5]
    assert np.all(finite <= 448.0) and np.all(finite > 224.0)  # the top binade: at most one bit of range unused


def test_result_is_in_the_compute_dtype_or_fp32_where_asked():
    for recipe in ("bf16",) + RECIPES:
        policy = Precision.from_names("bfloat16", matmul=recipe, fp8_exclude=())
        meta = fp8.init_history(2) if recipe == "fp8_delayed" else None
        x, w = jnp.ones((2, 3, 128), jnp.bfloat16), jnp.ones((128, 8), jnp.float32)
        for out, want in ((None, jnp.bfloat16), (jnp.float32, jnp.float32)):
            y = jax.eval_shape(lambda x, w: policy.einsum("btd,dv->btv", x, w, site="a", meta=meta, out_dtype=out), x, w)
            assert y.dtype == want, (recipe, out)


def test_sites_follow_the_exclude_patterns():
    policy = Precision.from_names("bfloat16", matmul="fp8")
    assert policy.recipe("attn.wq") == "fp8" and policy.recipe("mlp.w_down") == "fp8"
    assert policy.recipe("lm_head") == "bf16" and policy.recipe("moe.w_up") == "bf16"
    custom = Precision.from_names("bfloat16", matmul="fp8_blockwise", fp8_exclude=("attn.*",))
    assert custom.recipe("attn.wo") == "bf16" and custom.recipe("lm_head") == "fp8_blockwise"


def test_canonical_form_of_multi_dim_sites():
    """attn.wo contracts two dims (h, e): the recipe sees [M, K=h*e] x [K, N] and the output keeps its names."""
    rng = np.random.default_rng(2)
    o = rng.normal(size=(2, 3, 4, 32)).astype(np.float32)
    wo = (rng.normal(size=(4, 32, 16)) * 0.1).astype(np.float32)
    policy = Precision.from_names("float32", matmul="fp8")
    got = np.asarray(policy.einsum("bthe,hed->btd", jnp.asarray(o), jnp.asarray(wo), site="attn.wo"))
    want, aq, bq, _ = emulate("fp8", o.reshape(6, 128).astype(np.float64), wo.reshape(128, 16).astype(np.float64),
                              np.ones((6, 16)))[0]
    np.testing.assert_allclose(got.reshape(6, 16), want, rtol=0, atol=float(fp32_accumulation_bound(aq, bq).max()))


def recipe_grad_fn(recipe, shape=(2, 256, 512), d_out=384, quantized_once=False):
    """jit(grad) of one fp8 site, fwd + bwd, and example operands; `quantized_once`: the weight reaches the site
    quantized where the loss starts (precision.cast_sites), as in the model's train step."""
    policy = Precision.from_names("bfloat16", matmul=recipe)
    meta = fp8.init_history(4) if recipe == "fp8_delayed" else None
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (shape[-1], d_out), jnp.float32) * 0.02

    def loss(x, w, meta):
        if quantized_once:
            w = cast_sites(policy, {"mlp": {"w_up": w}}, {"mlp": {"w_up": meta}} if meta else None, True)["mlp"]["w_up"]
        y = policy.einsum("btd,df->btf", x, w, site="mlp.w_up", meta=meta)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (x, w, meta)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_a_weight_quantized_once_gives_the_same_gradients(recipe):
    """fp8.QuantizedWeight carries the scale and e4m3 values the site would make: dx, dw and the next histories are
    bit for bit those of the weight quantized at the site (with histories that set other scales than 1)."""
    grads = []
    for once in (False, True):
        fn, (x, w, meta) = recipe_grad_fn(recipe, quantized_once=once)
        meta = meta and {k: jnp.asarray([0.3, 2.0, 0.0, 1.5]) * (i + 1) for i, k in enumerate(meta)}
        grads.append(fn(x, w, meta))
    assert jax.tree.structure(grads[0]) == jax.tree.structure(grads[1])
    for got, want in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


CUBLAS_F8 = ('%gemm = (bf16[4096,4096]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[4096,8192]{1,0} %x, '
             'f8e5m2[4096,8192]{L} %w, f32[] %sx, f32[] %sw), custom_call_target="__cublas$lt$matmul$f8", '
             'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
             '"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')


def test_gemm_report_reads_kinds_and_k_major():
    """The HLO reader the GPU test and scripts/bench_fp8.py rely on, on the text forms XLA prints."""
    from meshtrain.planning.hlo import gemm_report
    k_major = gemm_report(CUBLAS_F8.replace("{L}", "{1,0}"))
    assert (k_major["fp8"], k_major["fp8_k_major"], k_major["kinds"]) == (1, 1, {"__cublas$lt$matmul$f8": 1})
    # The same GEMM with the weight stored column-major: its contracting dim 1 is not the minor one.
    assert gemm_report(CUBLAS_F8.replace("{L}", "{0,1}"))["fp8_not_k_major"] == 1
    named = "a = bf16[8,16]{1,0} parameter(0)\nb = bf16[16,4]{0,1} parameter(1)\n" \
            "ROOT d = f32[8,4]{1,0} dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
    assert gemm_report(named)["bf16"] == 1
    fn, args = recipe_grad_fn("fp8")
    lowered = gemm_report(fn.lower(*args).as_text(dialect="hlo"))  # before XLA's passes: three f8 dots
    assert lowered["fp8"] == 3 and lowered["kinds"] == {"dot": 3}, lowered


@pytest.mark.gpu
@pytest.mark.parametrize("quantized_once", [False, True], ids=["at-the-site", "quantized-once"])
@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_gpu_program_runs_fp8_gemms_k_major(recipe, quantized_once):
    """The optimized GPU program runs the three GEMMs on fp8 operands (cuBLASLt fp8 calls or f8 dots), K-major,
    not fp8 values dequantized into bf16 GEMMs; also with the weight quantized once, ahead of the site."""
    from meshtrain.planning.hlo import gemm_report
    fn, args = recipe_grad_fn(recipe, shape=(4, 1024, 2048), d_out=4096, quantized_once=quantized_once)
    report = gemm_report(fn.lower(*args).compile().as_text())
    assert report["fp8"] == 3, report
    assert report["fp8_not_k_major"] == 0, report
    assert report["bf16"] == 0, report
