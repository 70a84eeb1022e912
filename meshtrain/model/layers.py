"""Building blocks of the decoder: parameters with logical names, named matmul sites, RMSNorm, rotary
embedding, and the SwiGLU FFN (the dense layers' and the shared experts').

Every parameter is created through `param()`, which attaches its logical axis names; the trainer
reads them back (flax `get_partition_spec`) and maps them to mesh axes with the one rules table.
Every dense matmul goes through `site_matmul()`, which names its site for the precision policy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshtrain.config import ModelConfig
from meshtrain import fp8
from meshtrain.parallel import tensor
from meshtrain.precision import Precision
from meshtrain.sharding import HIDDEN, LogicalNames, ShardingRules

FP8_META = "fp8_meta"  # variable collection of the fp8_delayed amax histories (train state, not params)
# The split backward of the zero-bubble pipeline schedules (step/pipeline/ops.py) asks the matmul sites for what
# their weight gradients need, so that it can compute them later without pulling back through the layers again:
# each input, recorded in SITE_INPUTS under the names of the weights that read it joined by "+" ("wq+wk+wv"), and
# each output's gradient, read as the gradient of a zero perturbation in SITE_GRADS named like the weight.
SITE_INPUTS, SITE_GRADS = "site_inputs", "site_grads"


def param(module: nn.Module, name: str, init: Callable, shape: Sequence[int], names: Sequence[str | None],
          dtype: jnp.dtype) -> jax.Array:
    return module.param(name, nn.with_logical_partitioning(init, tuple(names)), tuple(shape), dtype)


def site_matmul(module: nn.Module, site: str, subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` at a named site (`attn.wq`, `mlp.w_down`, ...) in the recipe the policy gives it.

    An fp8_delayed site keeps its amax histories (input, weight, gradient; each [fp8_amax_history])
    as the variable `<last part of the site>` of the calling module in the `fp8_meta` collection, with
    logical names so that they shard (and stack on `layers` under nn.scan) like the parameters.
    """
    policy: Precision = module.policy
    meta = None
    if policy.recipe(site) == "fp8_delayed":
        n = policy.fp8_amax_history
        init = lambda: {k: nn.Partitioned(v, (None,)) for k, v in fp8.init_history(n).items()}  # noqa: E731
        meta = nn.unbox(module.variable(FP8_META, site.rsplit(".", 1)[-1], init).value)
    return policy.einsum(subscripts, x, w, site=site, meta=meta)


def tap_sites(module: nn.Module, x: jax.Array, sites: Sequence[str], ys: Sequence[jax.Array]) -> list[jax.Array]:
    """The outputs `ys` of the matmul sites `sites` that all read `x`, tapped for a split backward (SITE_INPUTS)
    when the caller applies the module with SITE_INPUTS mutable; as they are otherwise. Only plain (bf16) sites
    are tapped: an fp8 site's weight gradient is its recipe's, and it stays in the pullback."""
    policy: Precision = module.policy
    if not module.is_mutable_collection(SITE_INPUTS) or module.is_initializing():
        return list(ys)
    names = [site.rsplit(".", 1)[-1] for site in sites]
    tapped = [policy.recipe(site) == "bf16" for site in sites]
    if any(tapped):
        reads = "+".join(name for name, t in zip(names, tapped) if t)
        module.sow(SITE_INPUTS, reads, policy.cast(x), init_fn=lambda: None, reduce_fn=lambda _, new: new)
    return [module.perturb(name, y, collection=SITE_GRADS) if t else y for name, y, t in zip(names, ys, tapped)]


def gathered_site_matmuls(module: nn.Module, x_btd: jax.Array,
                          sites: Sequence[tuple[str, str, jax.Array, LogicalNames, LogicalNames]]) -> list[jax.Array]:
    """Column-parallel matmuls of the sequence-sharded x_btd, sharing one ring over tp. Each site is
    (site, subscripts, weight, the weight's logical names, the output's logical names)."""
    policy: Precision = module.policy
    ws = [policy.cast(w) for _, _, w, _, _ in sites]  # the ring and any fsdp gather move the compute dtype

    def matmul(x_chunk, ws_local):
        return [policy.einsum(subscripts, x_chunk, w, site=site) for (site, subscripts, *_), w in zip(sites, ws_local)]
    return tensor.gather_matmuls(policy.cast(x_btd), ws, [s[3] for s in sites], [s[4] for s in sites],
                                            matmul, module.rules)


def scattered_site_matmul(module: nn.Module, site: str, subscripts: str, h: jax.Array, w: jax.Array,
                          h_names: LogicalNames, w_names: LogicalNames) -> jax.Array:
    """A row-parallel matmul whose tp partial sums land on the sequence-sharded residual stream."""
    policy: Precision = module.policy
    return tensor.matmul_scatter(policy.cast(h), policy.cast(w), h_names, w_names,
                                            lambda h_chunk, w_local: policy.einsum(subscripts, h_chunk, w_local,
                                                                                   site=site), module.rules)


def scaled_normal(std: float) -> Callable:
    return nn.initializers.normal(stddev=std)


def rms_norm_jnp(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32 whatever the input dtype; the caller decides the output dtype."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * inv * scale.astype(jnp.float32)


class RMSNorm(nn.Module):
    eps: float
    policy: Precision
    rules: ShardingRules
    impl: str = "reference"  # reference | pallas
    interpret: bool = False  # the Pallas kernel in interpret mode (CPU)

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        scale_d = param(self, "scale", nn.initializers.ones, (x_btd.shape[-1],), ("embed",), self.policy.param_dtype)
        if self.impl == "pallas":
            from meshtrain.model.kernels import pallas_rms_norm
            return pallas_rms_norm(x_btd, scale_d, self.eps, self.policy.compute_dtype, self.rules, self.interpret)
        return rms_norm_jnp(x_btd, scale_d, self.eps).astype(self.policy.compute_dtype)


class AllHeadsRMSNorm(nn.Module):
    """RMSNorm over a token's whole projection [.., heads, E] (all heads together, one scale per head and
    channel), as OLMoE normalizes q and k before RoPE. With heads split over tp, the mean over them is a
    [B, T] partial sum per rank that the compiler all-reduces; always jnp (two small tensors per layer)."""

    eps: float
    policy: Precision
    names: tuple[str, str]  # the scale's logical names: ("heads" or "kv_heads", "head_dim")

    @nn.compact
    def __call__(self, x_bthe: jax.Array) -> jax.Array:
        scale_he = param(self, "scale", nn.initializers.ones, x_bthe.shape[-2:], self.names, self.policy.param_dtype)
        x32 = x_bthe.astype(jnp.float32)
        inv_bt11 = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=(-2, -1), keepdims=True) + self.eps)
        return (x32 * inv_bt11 * scale_he.astype(jnp.float32)).astype(x_bthe.dtype)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling (transformers' rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Llama3RopeScaling | None":
        if cfg.rope_scaling != "llama3":
            return None
        return cls(cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len)

    def __call__(self, inv_freq_f: jax.Array) -> jax.Array:
        # Wavelengths longer than original_max_len / low_freq_factor are slowed by `factor`, those shorter
        # than original_max_len / high_freq_factor are kept, and the band between is interpolated.
        wavelen_f = 2 * math.pi / inv_freq_f
        smooth_f = (self.original_max_len / wavelen_f - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        mixed_f = (1 - smooth_f) * inv_freq_f / self.factor + smooth_f * inv_freq_f
        slow_f = jnp.where(wavelen_f > self.original_max_len / self.low_freq_factor, inv_freq_f / self.factor,
                           inv_freq_f)
        medium_f = (wavelen_f >= self.original_max_len / self.high_freq_factor) & (
            wavelen_f <= self.original_max_len / self.low_freq_factor)
        return jnp.where(medium_f, mixed_f, slow_f)


def rope_tables(positions_bt: jax.Array, head_dim: int, theta: float,
                scaling: Llama3RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin of the rotary angles at the given positions, [B, T, E/2] fp32."""
    inv_freq_f = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is not None:
        inv_freq_f = scaling(inv_freq_f)
    angle_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq_f
    return jnp.cos(angle_btf), jnp.sin(angle_btf)


def _rotate_halves(x_bthe: jax.Array, cos_btf: jax.Array, sin_btf: jax.Array) -> jax.Array:
    """Each pair (i, i + E/2) rotated by its angle, in fp32, back to the input dtype."""
    half = x_bthe.shape[-1] // 2
    x32 = x_bthe.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    cos, sin = cos_btf[:, :, None, :], sin_btf[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthe.dtype)


@jax.custom_vjp
def apply_rope(x_bthe: jax.Array, cos_btf: jax.Array, sin_btf: jax.Array) -> jax.Array:
    """Rotate halves (the Llama/HF layout: pairs are (i, i + E/2)), in fp32, back to the input dtype.

    The backward is the inverse rotation (by -angle) of the gradient, written as the forward is. Two reasons:
    autodiff's transpose of the halves' slices and concatenation is a pad-and-add that XLA fused into a pass
    at a third of the bandwidth the forward's concatenation reaches (176 against 68 us a layer for q and k of
    the 1.36B step on an H200); and it needs only the tables, not x, so under save_dots a block's backward
    keeps the rotated q and k (checkpoint "qkv") for the attention kernel without the projections before
    RoPE. The tables get no gradient: they come from integer positions."""
    return _rotate_halves(x_bthe, cos_btf, sin_btf)


def _rope_fwd(x_bthe, cos_btf, sin_btf):
    return _rotate_halves(x_bthe, cos_btf, sin_btf), (cos_btf, sin_btf)


def _rope_bwd(tables, dy_bthe):
    cos_btf, sin_btf = tables
    return _rotate_halves(dy_bthe, cos_btf, -sin_btf), None, None


apply_rope.defvjp(_rope_fwd, _rope_bwd)


class SwiGLU(nn.Module):
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    out_std: float
    ring: bool = False  # tp's matmuls as shard_map rings over x's sequence chunks (Execution.tp_ring)

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        c, p, r = self.cfg, self.policy, self.rules
        init = scaled_normal(c.init_std)
        w_gate_df = param(self, "w_gate", init, (c.d_model, c.d_ff), ("embed", "mlp"), p.param_dtype)
        w_up_df = param(self, "w_up", init, (c.d_model, c.d_ff), ("embed", "mlp"), p.param_dtype)
        w_down_fd = param(self, "w_down", scaled_normal(self.out_std), (c.d_ff, c.d_model), ("down_mlp", "down_embed"),
                          p.param_dtype)
        ring = self.ring
        if ring:
            gate_btf, up_btf = gathered_site_matmuls(self, x_btd, [
                ("mlp.w_gate", "btd,df->btf", w_gate_df, ("embed", "mlp"), HIDDEN),
                ("mlp.w_up", "btd,df->btf", w_up_df, ("embed", "mlp"), HIDDEN)])
        else:
            gate_btf = site_matmul(self, "mlp.w_gate", "btd,df->btf", x_btd, w_gate_df)
            up_btf = site_matmul(self, "mlp.w_up", "btd,df->btf", x_btd, w_up_df)
        gate_btf, up_btf = tap_sites(self, x_btd, ("mlp.w_gate", "mlp.w_up"), (gate_btf, up_btf))
        hidden_btf = r.constrain(jax.nn.silu(gate_btf) * up_btf, HIDDEN)
        hidden_btf = checkpoint_name(hidden_btf, "mlp_hidden")
        if ring:
            out_btd = scattered_site_matmul(self, "mlp.w_down", "btf,fd->btd", hidden_btf, w_down_fd, HIDDEN,
                                            ("down_mlp", "down_embed"))
        else:
            out_btd = site_matmul(self, "mlp.w_down", "btf,fd->btd", hidden_btf, w_down_fd)
        (out_btd,) = tap_sites(self, hidden_btf, ("mlp.w_down",), (out_btd,))
        return checkpoint_name(out_btd, "mlp_out")
