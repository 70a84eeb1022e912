"""One numerics policy for the whole model.

fp32 master parameters; matmul operands in the compute dtype with fp32 accumulation; logits,
softmax and norms always in fp32. Every dense matmul goes through `Precision.einsum`, and every expert
GEMM through `Precision.ragged_dot`, and names its site (`attn.wq`, `mlp.w_down`, `moe.w_up`,
`lm_head`; all of them in config.MATMUL_SITES); the policy maps the site to a recipe:

    bf16           operands in the compute dtype (bf16 by default), fp32 accumulation
    fp8            e4m3 forward / e5m2 backward, per-tensor scales from this step's amax
    fp8_delayed    the same, scales from an amax history kept in the train state
    fp8_blockwise  1x128 activation/gradient tiles and 128x128 weight blocks (DeepSeek-V3)

Sites matching a `fp8_exclude` pattern (fnmatch; by default `lm_head` and `moe.*`) stay on the plain
recipe. The expert GEMMs have no fp8 recipe yet: they run the plain one whatever their recipe, and
validate() refuses a config that lets fp8 reach them. meshtrain/fp8.py holds the fp8 recipes; this
module only dispatches, so no cast is scattered through the model.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from meshtrain import fp8
from meshtrain.config import FP8_EXCLUDE_DEFAULT, MATMUL_SITES

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class Precision:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.bfloat16
    matmul: str = "bf16"  # one of fp8.RECIPES, for every site not excluded
    fp8_exclude: tuple[str, ...] = FP8_EXCLUDE_DEFAULT
    fp8_amax_history: int = 16
    fp8_cast: str = "xla"  # fp8.CASTS: how fp8 / fp8_delayed quantize (Execution.fp8_cast decides it)

    @classmethod
    def from_names(cls, compute: str, params: str = "float32", matmul: str = "bf16",
                   fp8_exclude: tuple[str, ...] = FP8_EXCLUDE_DEFAULT, fp8_amax_history: int = 16,
                   fp8_cast: str = "xla") -> "Precision":
        return cls(param_dtype=_DTYPES[params], compute_dtype=_DTYPES[compute], matmul=matmul,
                   fp8_exclude=tuple(fp8_exclude), fp8_amax_history=fp8_amax_history, fp8_cast=fp8_cast or "xla")

    @property
    def is_fp32(self) -> bool:
        return self.compute_dtype == jnp.float32

    def cast(self, x: jax.Array) -> jax.Array:
        return x.astype(self.compute_dtype)

    def recipe(self, site: str) -> str:
        """The recipe of one matmul site: the policy's, unless a `fp8_exclude` pattern keeps it plain."""
        if self.matmul == "bf16" or any(fnmatch.fnmatchcase(site, p) for p in self.fp8_exclude):
            return "bf16"
        return self.matmul

    def recipes(self) -> dict[str, str]:
        """Every matmul site's recipe under this policy."""
        return {site: self.recipe(site) for site in MATMUL_SITES}

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        # fp32 compute asks for full fp32 products (no TF32 on GPUs) so that sharded and single-device
        # runs agree to ~1e-6; bf16/fp16 products accumulate in fp32 inside the GEMM and round once
        # into `preferred_element_type` (the compute dtype unless the caller asks for more).
        del precision
        return jax.lax.dot_general(
            self.cast(lhs), self.cast(rhs), dimension_numbers,
            precision=jax.lax.Precision.HIGHEST if self.is_fp32 else None,
            preferred_element_type=preferred_element_type or self.compute_dtype)

    def plain_einsum(self, subscripts: str, x: jax.Array, w: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
        """einsum through this policy's dot_general, with the result in `out_dtype`."""
        return jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype, _dot_general=self.dot_general)

    def einsum(self, subscripts: str, x: jax.Array, w: jax.Array, *, site: str, meta: dict | None = None,
               out_dtype: jnp.dtype | None = None) -> jax.Array:
        """`x @ w` at a named site, in that site's recipe: x holds the activations, w the weight.

        The result is in the compute dtype, or `out_dtype` (the logits ask for fp32). `meta` carries
        the amax histories of an `fp8_delayed` site (model/layers.py `site_matmul` creates them).
        """
        out_dtype = jnp.dtype(out_dtype or self.compute_dtype)
        recipe = self.recipe(site)
        if recipe == "bf16":
            # Cast first: einsum promotes mixed operand dtypes (bf16 x fp32 -> fp32) for its result.
            xc, wc = self.cast(x), self.cast(w)
            if out_dtype.itemsize > jnp.dtype(self.compute_dtype).itemsize:
                return wide_result_einsum(self, subscripts, out_dtype, xc, wc)
            return self.plain_einsum(subscripts, xc, wc, out_dtype)
        if recipe == "fp8_delayed" and meta is None:
            raise ValueError(f"site {site!r}: fp8_delayed needs its amax histories (meta); create them with "
                             f"model.layers.site_matmul or exclude the site")
        xc = self.cast(x)  # activations in the compute dtype; the weight is quantized from its fp32 master
        x_mk, w_kn, unflatten = canonical(subscripts, xc, w)  # w: an array, or fp8.QuantizedWeight
        if recipe == "fp8_blockwise":
            y = fp8.blockwise_matmul(x_mk, w_kn, out_dtype)
        else:
            y = fp8.per_tensor_matmul(x_mk, w_kn, meta if recipe == "fp8_delayed" else None, out_dtype,
                                      self.fp8_cast)
        return unflatten(y)


    def ragged_dot(self, x_md: jax.Array, w_gkn: jax.Array, group_sizes_g: jax.Array, *, site: str,
                   kernel: Callable | None = None) -> jax.Array:
        """Grouped `x @ w`: row block g of x (group_sizes_g[g] rows) times w[g], at a named expert site.

        Operands in the compute dtype, fp32 accumulation, the result in the compute dtype. `kernel` replaces
        jax.lax.ragged_dot with a function of the same arguments (the Pallas gmm kernel, whose dots take
        fp32 operands at full precision). No fp8 recipe exists for grouped GEMMs yet, so the site's recipe
        is not consulted: an fp8 one would run as the plain one here, which is why `moe.*` is in the default
        fp8_exclude and validate() refuses a config that takes it out.
        """
        xc, wc = self.cast(x_md), self.cast(w_gkn)
        if kernel is not None:
            return kernel(xc, wc, group_sizes_g, preferred_element_type=self.compute_dtype)
        return jax.lax.ragged_dot(xc, wc, group_sizes_g, precision=jax.lax.Precision.HIGHEST if self.is_fp32 else None,
                                  preferred_element_type=self.compute_dtype)


# The rank of each layer site's own weight (model/transformer.py Attention: [D, H, E] and [H, E, D]; model/layers.py
# SwiGLU: [D, F] and [F, D]): a stacked layer's leading dims beyond it each get their own per-tensor fp8 scale.
# These sites reach their matmul through site_matmul, which takes a weight quantized once per step.
QUANTIZED_ONCE_RANKS = {"attn.wq": 3, "attn.wk": 3, "attn.wv": 3, "attn.wo": 3, "mlp.w_gate": 2, "mlp.w_up": 2,
                        "mlp.w_down": 2}


def cast_sites(policy: Precision, params: Any, fp8_meta: Any = None, quantize_fp8: bool = False) -> Any:
    """Params with the weights of bf16 matmul sites (`attn/wq` is site `attn.wq`) in the compute dtype, as
    the site would cast them; with `quantize_fp8`, the layer sites' weights under `fp8` also quantized
    (fp8.quantize_weight), and under `fp8_delayed` too where `fp8_meta` (the model's amax histories, shaped as
    `params`) gives their scales; the rest (norm scales, the embedding, other fp8 sites' fp32 masters) as they are.

    Cast where the loss starts (once a microbatch) or where a pipeline stage starts (once a step), the copies
    serve the forward and the backward alike; cast inside a rematerialized block, a weight was cast again when
    the backward reran the block. A weight whose path does not name its site (the shared experts'
    `shared/w_gate`) is cast where it is used, as before. `quantize_fp8` is for callers whose sites take the
    weight as site_matmul hands it over (not tp's rings, which move the fp32 or compute-dtype weight)."""
    def one(path, a):  # the module and the weight's name; a box's `.value` is not a name
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        site = ".".join(keys[-2:])
        recipe = policy.recipe(site) if site in MATMUL_SITES else None
        if recipe == "bf16":
            return policy.cast(a)
        if not quantize_fp8 or site not in QUANTIZED_ONCE_RANKS or recipe not in ("fp8", "fp8_delayed"):
            return a
        if recipe == "fp8":
            return fp8.quantize_weight(a, QUANTIZED_ONCE_RANKS[site])
        if fp8_meta is None:  # a delayed scale needs the histories as they stand: the site reads them itself
            return a
        history = fp8_meta
        for key in keys:
            history = history[key]
        return fp8.quantize_weight(a, QUANTIZED_ONCE_RANKS[site], history["w"])

    return jax.tree_util.tree_map_with_path(one, params)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def wide_result_einsum(policy: Precision, subscripts: str, out_dtype: jnp.dtype, x: jax.Array,
                       w: jax.Array) -> jax.Array:
    """`einsum(x, w)` in the compute dtype with a wider (fp32) result, whose backward GEMMs take and
    return the compute dtype, as every other matmul's backward does.

    Left to autodiff, the fp32 result's fp32 cotangent would meet bf16 operands in the two backward
    GEMMs (dX = g·Wᵀ, dW = Xᵀ·g), and XLA runs such mixed dots as fp32 (TF32 on GPUs) GEMMs: on the
    1B config's head (16384 x 2048 x 32000) those took 15.7 ms of a 288 ms step on one H100, about
    twice their bf16 time. Here the cotangent is rounded to the compute dtype once and both GEMMs run
    in it with fp32 accumulation inside. Each index of `subscripts` must appear in two of its three
    terms (true of the head's "btd,dv->btv"), so that both transposes are again einsums.
    """
    return policy.plain_einsum(subscripts, x, w, out_dtype)


def _wide_fwd(policy, subscripts, out_dtype, x, w):
    return policy.plain_einsum(subscripts, x, w, out_dtype), (x, w)


def _wide_bwd(policy, subscripts, out_dtype, residuals, g):
    x, w = residuals
    lhs, rest = subscripts.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    g = policy.cast(g)
    dx = policy.plain_einsum(f"{out},{rhs}->{lhs}", g, w, x.dtype)
    dw = policy.plain_einsum(f"{lhs},{out}->{rhs}", x, g, w.dtype)
    return dx, dw


wide_result_einsum.defvjp(_wide_fwd, _wide_bwd)


def canonical(subscripts: str, x: jax.Array, w: "jax.Array | fp8.QuantizedWeight"):
    """Rewrite `x @ w` given as "lhs,rhs->out" into x [*B, M, K] and w [*B, K, N] (B: dims in all
    three, K: contracted, M/N: kept from x/w), plus the map from the [*B, M, N] result back to `out`.
    A QuantizedWeight has both its arrays rewritten.

    Dims keep their relative order, so for every site of the model (contraction dims last in x,
    first in w) the reshapes merge neighbouring dims and cost nothing.
    """
    lhs, rest = subscripts.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    batch = [c for c in lhs if c in rhs and c in out]
    contract = [c for c in lhs if c in rhs and c not in out]
    free_x = [c for c in lhs if c not in rhs]
    free_w = [c for c in rhs if c not in lhs]
    if any(c not in out for c in free_x + free_w) or sorted(out) != sorted(batch + free_x + free_w):
        raise ValueError(f"einsum {subscripts!r}: a matmul site needs every non-contracted dim in the output")
    w_shape = w.q.shape if isinstance(w, fp8.QuantizedWeight) else w.shape
    size = dict(zip(lhs, x.shape)) | dict(zip(rhs, w_shape))
    prod = lambda dims: math.prod(size[c] for c in dims)  # noqa: E731
    bshape = [size[c] for c in batch]
    x3 = jnp.transpose(x, [lhs.index(c) for c in batch + free_x + contract])
    x3 = x3.reshape(*bshape, prod(free_x), prod(contract))

    def w_kn(a: jax.Array) -> jax.Array:
        a = jnp.transpose(a, [rhs.index(c) for c in batch + contract + free_w])
        return a.reshape(*bshape, prod(contract), prod(free_w))

    w3 = w.with_layout(w_kn) if isinstance(w, fp8.QuantizedWeight) else w_kn(w)
    natural = batch + free_x + free_w

    def unflatten(y: jax.Array) -> jax.Array:
        y = y.reshape(*bshape, *[size[c] for c in free_x], *[size[c] for c in free_w])
        return jnp.transpose(y, [natural.index(c) for c in out])

    return x3, w3, unflatten


def update_loss_scale(scale: jax.Array, good_steps: jax.Array, finite: jax.Array, *,
                      growth_interval: int) -> tuple[jax.Array, jax.Array]:
    """Dynamic loss scaling for fp16: halve on an overflowing step (which is skipped), double after
    `growth_interval` finite steps in a row. The scale never drops below 1."""
    grown = good_steps + 1 >= growth_interval
    new_scale = jnp.where(finite, jnp.where(grown, scale * 2.0, scale), jnp.maximum(scale * 0.5, 1.0))
    new_good = jnp.where(finite & ~grown, good_steps + 1, 0)
    return new_scale, new_good.astype(good_steps.dtype)
