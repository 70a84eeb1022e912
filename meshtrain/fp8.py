"""fp8 matmul recipes: `y = x @ w` with e4m3 operands forward and e5m2 gradients backward.

Every recipe takes the matmul in canonical form, x [*B, M, K] (activations, contracting on their last
dim) and w [*B, K, N] (weights, as the model stores them), and is a `custom_vjp`, so that the
backward pass runs its own low-precision GEMMs instead of differentiating through the casts:

    forward   y  [M, N] = q4(x) [M, K] . q4(w)^T [N, K]     q4: e4m3 (3 mantissa bits, max 448)
    backward  dx [M, K] = q5(g) [M, N] . q4(w)   [K, N]     q5: e5m2 (2 mantissa bits, max 57344)
              dw [K, N] = q4(x)^T [K, M] . q5(g)^T [N, M]

Each GEMM reads both operands contracting on their last dimension (K-major, "TN"), the only layout
in which Hopper's fp8 tensor cores run at full rate; the transposes are done on the 1-byte values
once per call (the weight's once per step). Products accumulate in fp32; the result leaves in the
compute dtype (fp32 where the caller asks, e.g. the logits).

A weight is quantized once per step where the loss starts (`quantize_weight`, called by
precision.cast_sites): its amax, scale and e4m3 values in its own layout come into the layers as a
`QuantizedWeight`, and the forward transposes the 1-byte values. Quantized inside a rematerialized
block, the backward's rerun of the block read the fp32 weight twice more (amax, then the cast).

Scales are powers of two: dividing by one is exact, and so is rescaling the GEMM's rounded output,
so the result is the fp32-accumulated product of the quantized values rounded once to the output
dtype. A value v is stored as clip(v / s) in fp8 and stands for s * that.

    fp8            per tensor, this step's amax (current scaling)
    fp8_delayed    per tensor, the max over an amax history of the last H steps (the histories are
                   train state: `delayed_meta`); this step's amax is pushed after use
    fp8_blockwise  DeepSeek-V3: 1x128 tiles for activations and gradients (along the contraction
                   dim of each GEMM), 128x128 blocks for weights. No XLA GPU GEMM scales per K
                   block on Hopper, so the tiles are dequantized (exactly, in bf16/fp32) into the
                   compute dtype's GEMM: the numerics of the recipe at bf16 speed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, get_args, get_type_hints

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.config import PrecisionConfig
from pallas_kernels.fp8_cast import cast_transpose

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
TILE = 128  # DeepSeek-V3's tile: 1 x 128 for activations and gradients, 128 x 128 for weights
RECIPES = get_args(get_type_hints(PrecisionConfig)["matmul"])  # precision.matmul's choices: bf16, fp8, ...
HISTORY_KEYS = ("x", "w", "g")  # fp8_delayed: one amax history per operand (input, weight, gradient)
CASTS = ("xla", "triton", "interpret")  # how per_tensor_matmul quantizes its operands


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def pow2_scale(amax: jax.Array, dtype) -> jax.Array:
    """The smallest power of two s with amax / s <= max(dtype); 1 where amax is 0 or not finite."""
    amax = jnp.asarray(amax, jnp.float32)
    ok = (amax > 0) & jnp.isfinite(amax)
    mant, expo = jnp.frexp(jnp.where(ok, amax, 1.0) / fp8_max(dtype))  # value = mant * 2^expo, mant in [0.5, 1)
    expo = jnp.where(mant == 0.5, expo - 1, expo)  # an exact power of two is its own scale
    return jnp.where(ok, exp2_int(expo), 1.0)


def exp2_int(e: jax.Array) -> jax.Array:
    """2^e for integer e, built from the exponent bits (exact, unlike pow), within fp32's normal range."""
    biased = (jnp.clip(e, -126, 127) + 127).astype(jnp.int32)
    return lax.bitcast_convert_type(biased << 23, jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale in fp8, saturating at the format's max (delayed scales can lag a growing tensor)."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _t(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, -1, -2)


def _wide(dtype) -> jnp.dtype:
    """The dtype an fp8 GEMM writes for a result wanted in `dtype`: `dtype` itself when it has fp32's
    exponent range (bf16, fp32), so the unscaled product and its power-of-two rescale fit it exactly;
    fp32 for fp16, whose range neither fits (the result is rounded to fp16 after the rescale)."""
    dtype = jnp.dtype(dtype)
    return dtype if jnp.finfo(dtype).maxexp >= jnp.finfo(jnp.float32).maxexp else jnp.dtype(jnp.float32)


def _scaled_nt(a: jax.Array, b: jax.Array, scale: jax.Array, out_dtype) -> jax.Array:
    """scale * (a . b^T) in `out_dtype`. The GEMM writes the result in the dtype it is wanted in where
    that is exact (`_wide`), and XLA folds the scale into the GEMM: an fp32 result only to be rounded
    afterwards would double the bytes written and add a pass that reads them again."""
    gemm = _wide(out_dtype)
    return (_dot_nt(a, b, gemm) * scale.astype(gemm)).astype(out_dtype)


def _dot_nt(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """a [*B, P, C] . b [*B, Q, C]^T -> [*B, P, Q]: both operands contract on their last dim."""
    batch = tuple(range(a.ndim - 2))
    return lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch)), preferred_element_type=out_dtype)


# ----------------------------------------------------------------------------- per-tensor scaling


def push_history(history: jax.Array, value: jax.Array) -> jax.Array:
    """Newest first along the last axis: [..., a_t, a_{t-1}, ...] -> [..., value, a_t, ...] (the oldest falls off);
    `value` has history's shape less its last axis."""
    return jnp.concatenate([value[..., None].astype(history.dtype), history[..., :-1]], axis=-1)


def push_newest_of(history: jax.Array, pushed: jax.Array) -> jax.Array:
    """history [..., H] with the newest entry of `pushed` (a history one push past some earlier state, as a
    backward returns it) pushed onto it: the pipeline's way to apply a microbatch's push to histories that
    moved on since its forward read them (step/pipeline/executor.py)."""
    return push_history(history, pushed[..., 0])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A per-tensor fp8 site's weight as the layers read it, made once per step (`quantize_weight`). Stacked
    layers stack every field on their leading axes, and a scan hands each layer its slice.

    Only `master` is differentiated: the matmul returns the weight's gradient for it, and the forward
    never reads it (the quantized fields are computed from it under stop_gradient)."""

    master: jax.Array  # [*stack, *weight] the fp32 weight
    q: jax.Array  # [*stack, *weight] master / scale in e4m3, the weight's own layout (K before N)
    scale: jax.Array  # [*stack] a power of two
    amax: jax.Array  # [*stack] this step's amax of master: the scale's source, or (delayed) pushed after use

    def with_layout(self, fn: Callable[[jax.Array], jax.Array]) -> "QuantizedWeight":
        """The same weight with `fn` (a reshape or transpose of the weight's dims) applied to both arrays."""
        return replace(self, master=fn(self.master), q=fn(self.q))


def master_grads(grads: Any) -> Any:
    """A gradient of params holding QuantizedWeights -> the same with each one's master gradient in its place,
    shaped as the params were before precision.cast_sites quantized them."""
    return jax.tree.map(lambda g: g.master if isinstance(g, QuantizedWeight) else g, grads,
                        is_leaf=lambda g: isinstance(g, QuantizedWeight))


def quantize_weight(w: jax.Array, rank: int, history: jax.Array | None = None) -> QuantizedWeight:
    """w [*stack, *weight] (`rank` the weight's own dims; a per-tensor scale for each leading index) quantized
    to e4m3: scaled by this step's amax (current scaling), or by the max of `history` [*stack, H] (delayed)."""
    amax_w = jnp.max(jnp.abs(w), axis=tuple(range(w.ndim - rank, w.ndim))).astype(jnp.float32)
    scale = pow2_scale(amax_w if history is None else jnp.max(history, axis=-1), E4M3)
    q = quantize(w, scale.reshape(scale.shape + (1,) * rank), E4M3)
    return QuantizedWeight(w, *(lax.stop_gradient(a) for a in (q, scale, amax_w)))


def _x_scale(x, meta):
    return pow2_scale(amax(x) if meta is None else jnp.max(meta["x"]), E4M3)


def per_tensor_matmul(x: jax.Array, w: jax.Array | QuantizedWeight, meta: dict | None, out_dtype,
                      cast: str = "xla") -> jax.Array:
    """fp8 / fp8_delayed (meta = {"x", "w", "g": amax histories [H]}): x [*B, M, K] @ w [*B, K, N].

    `w` is the fp32 weight, or that weight quantized once per step (a QuantizedWeight, whose scale already
    follows the recipe). `cast` (CASTS) quantizes the other operands: "xla" in jnp, which XLA fuses into their
    producers as it can; "triton" or "interpret" with the one-pass kernel (pallas_kernels/fp8_cast.py: each
    operand read once, both its layouts and, for delayed scaling, its amax written), compiled for the GPU or run
    in Triton's interpreter. Same values either way; which is faster is measured in docs/PERFORMANCE.md.

    Under differentiation the cotangent returned for `meta` is the *next* histories (this step's
    amaxes pushed), so the step reads them from the gradient, as flax's fp8 ops do.
    """
    if cast not in CASTS:
        raise ValueError(f"cast must be one of {CASTS}; got {cast!r}")
    prepared = isinstance(w, QuantizedWeight)
    w_dtype = w.master.dtype if prepared else w.dtype
    return _per_tensor(x, w, meta, (jnp.dtype(out_dtype), x.dtype, w_dtype, cast, prepared))


def _both_layouts(a: jax.Array, scale: jax.Array, dtype, cast: str, with_amax: bool):
    """(a / scale in fp8, that with its last two dims swapped, amax(a) if with_amax else None)."""
    if cast == "xla":
        q = quantize(a, scale, dtype)
        return q, _t(q), amax(a) if with_amax else None
    return cast_transpose(a, scale, dtype, amax=with_amax, interpret=cast == "interpret")


def _weight_layouts(w, meta, cast: str):
    """(w in e4m3 [K, N], the same [N, K], its scale, its amax if delayed scaling pushes it else None)."""
    if isinstance(w, QuantizedWeight):
        return w.q, _t(w.q), w.scale, w.amax
    sw = pow2_scale(amax(w) if meta is None else jnp.max(meta["w"]), E4M3)
    wq_kn, wq_nk, amax_w = _both_layouts(w, sw, E4M3, cast, meta is not None)
    return wq_kn, wq_nk, sw, amax_w


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _per_tensor(x, w, meta, dtypes):
    return _per_tensor_fwd(x, w, meta, dtypes)[0]


def _per_tensor_fwd(x, w, meta, dtypes):
    out_dtype, cast = dtypes[0], dtypes[3]
    sx = _x_scale(x, meta)
    delayed = meta is not None  # delayed scaling pushes this step's amaxes; current scaling had them for its scales
    xq_mk, xq_km, amax_x = _both_layouts(x, sx, E4M3, cast, delayed)
    wq_kn, wq_nk, sw, amax_w = _weight_layouts(w, meta, cast)
    y = _scaled_nt(xq_mk, wq_nk, sx * sw, out_dtype)
    # Saved in fp8 (half of bf16), already laid out for the backward GEMMs.
    res = (xq_km, wq_kn, sx, sw, meta, amax_x, amax_w)
    return y, res


def _per_tensor_bwd(dtypes, res, g):
    _, x_dtype, w_dtype, cast, prepared = dtypes
    xq_km, wq_kn, sx, sw, meta, amax_x, amax_w = res
    delayed = meta is not None
    sg = pow2_scale(jnp.max(meta["g"]) if delayed else amax(g), E5M2)
    gq_mn, gq_nm, amax_g = _both_layouts(g, sg, E5M2, cast, delayed)
    dx = _scaled_nt(gq_mn, wq_kn, sg * sw, x_dtype)
    dw = _scaled_nt(xq_km, gq_nm, sx * sg, w_dtype)
    new_meta = None if meta is None else {
        "x": push_history(meta["x"], amax_x), "w": push_history(meta["w"], amax_w),
        "g": push_history(meta["g"], amax_g)}
    if prepared:  # the gradient reaches the fp32 master; the quantized fields have none
        dw = QuantizedWeight(dw, None, None, None)
    return dx, dw, new_meta


_per_tensor.defvjp(_per_tensor_fwd, _per_tensor_bwd)


def init_history(length: int) -> dict[str, jax.Array]:
    """Empty histories: amax 0 means scale 1 for the first step (as TransformerEngine starts)."""
    return {k: jnp.zeros((length,), jnp.float32) for k in HISTORY_KEYS}


# ------------------------------------------------------------------------------- blockwise scaling


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)  # zeros change no tile's amax


def tile_scales(x: jax.Array, dtype) -> jax.Array:
    """Scales of 1 x 128 tiles along the last dim: x [..., R, C] -> [..., R, ceil(C / 128)]."""
    xp = _pad_to(x, -1, TILE)
    tiles = xp.reshape(*xp.shape[:-1], xp.shape[-1] // TILE, TILE)
    return pow2_scale(jnp.max(jnp.abs(tiles), axis=-1), dtype)


def block_scales(w: jax.Array, dtype) -> jax.Array:
    """Scales of 128 x 128 blocks over the last two dims: [..., R, C] -> [..., ceil(R/128), ceil(C/128)]."""
    wp = _pad_to(_pad_to(w, -1, TILE), -2, TILE)
    *lead, r, c = wp.shape
    blocks = wp.reshape(*lead, r // TILE, TILE, c // TILE, TILE)
    return pow2_scale(jnp.max(jnp.abs(blocks), axis=(-3, -1)), dtype)


def _expand(scales: jax.Array, shape, rows: int) -> jax.Array:
    """Per-tile scales back to per-element [..., R, C] (tiles of `rows` x 128)."""
    s = jnp.repeat(jnp.repeat(scales, TILE, axis=-1), rows, axis=-2)
    return s[..., :shape[-2], :shape[-1]]


def tile_dequantized(x: jax.Array, dtype, to) -> jax.Array:
    """x rounded through fp8 with 1x128 tile scales along its last dim, in dtype `to` (exact there:
    an fp8 value times a power of two fits bf16 and fp32)."""
    s = _expand(tile_scales(x, dtype), x.shape, 1)
    return (quantize(x, s, dtype).astype(jnp.float32) * s).astype(to)


def block_quantize(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    s = _expand(block_scales(w, dtype), w.shape, TILE)
    return quantize(w, s, dtype), s


def _gemm_dtype(out_dtype):
    # bf16 holds every fp8 value times a power-of-two scale exactly (fp16's exponent range does not).
    return jnp.float32 if out_dtype == jnp.float32 else jnp.bfloat16


def blockwise_matmul(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """fp8_blockwise: x [*B, M, K] @ w [*B, K, N] with tiles along each GEMM's contraction dim."""
    return _blockwise(x, w, (jnp.dtype(out_dtype), w.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _blockwise(x, w, dtypes):
    return _blockwise_fwd(x, w, dtypes)[0]


def _blockwise_fwd(x, w, dtypes):
    out_dtype = dtypes[0]
    c = _gemm_dtype(out_dtype)
    wq_kn, sw_kn = block_quantize(w, E4M3)
    w_nk = _t((wq_kn.astype(jnp.float32) * sw_kn).astype(c))  # 128 x 128 blocks are the same transposed
    y = _dot_nt(tile_dequantized(x, E4M3, c), w_nk, out_dtype)
    return y, (x, wq_kn, sw_kn)


def _blockwise_bwd(dtypes, res, g):
    out_dtype, w_dtype = dtypes
    x, wq_kn, sw_kn = res
    c = _gemm_dtype(out_dtype)
    w_kn = (wq_kn.astype(jnp.float32) * sw_kn).astype(c)
    dx = _dot_nt(tile_dequantized(g, E5M2, c), w_kn, c).astype(x.dtype)  # g tiles along N
    # dw contracts over tokens, so x and g are re-tiled along M (DeepSeek-V3's 128x1 tiles). It leaves
    # the GEMM in the GEMM dtype, as the bf16 recipe's does (XLA's CPU runtime has no bf16 x bf16 -> f32
    # dot inside loops, e.g. the gradient-accumulation scan).
    dw = _dot_nt(tile_dequantized(_t(x), E4M3, c), tile_dequantized(_t(g), E5M2, c), c)
    return dx, dw.astype(w_dtype)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
