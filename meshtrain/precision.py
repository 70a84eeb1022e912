"""One numerics policy for the whole model.

fp32 master parameters; matmul operands in the compute dtype with fp32 accumulation; logits,
softmax and norms always in fp32. Dense layers take their matmul from `Precision.einsum`, so a
low-precision policy (fp8 with scaling, later) replaces one function instead of casts scattered
through the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class Precision:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.bfloat16

    @classmethod
    def from_names(cls, compute: str, params: str = "float32") -> "Precision":
        return cls(param_dtype=_DTYPES[params], compute_dtype=_DTYPES[compute])

    @property
    def is_fp32(self) -> bool:
        return self.compute_dtype == jnp.float32

    def cast(self, x: jax.Array) -> jax.Array:
        return x.astype(self.compute_dtype)

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        # fp32 compute asks for full fp32 products (no TF32 on GPUs) so that sharded and single-device
        # runs agree to ~1e-6; bf16/fp16 products accumulate in fp32 inside the GEMM and round once.
        del precision, preferred_element_type
        return jax.lax.dot_general(
            self.cast(lhs), self.cast(rhs), dimension_numbers,
            precision=jax.lax.Precision.HIGHEST if self.is_fp32 else None,
            preferred_element_type=self.compute_dtype)

    def einsum(self, subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """`x @ w` written as an einsum whose names carry the shapes, in this policy's numerics."""
        # Cast first: einsum promotes mixed operand dtypes (bf16 x fp32 -> fp32) for its result.
        return jnp.einsum(subscripts, self.cast(x), self.cast(w), _dot_general=self.dot_general)


def update_loss_scale(scale: jax.Array, good_steps: jax.Array, finite: jax.Array, *,
                      growth_interval: int) -> tuple[jax.Array, jax.Array]:
    """Dynamic loss scaling for fp16: halve on an overflowing step (which is skipped), double after
    `growth_interval` finite steps in a row. The scale never drops below 1."""
    grown = good_steps + 1 >= growth_interval
    new_scale = jnp.where(finite, jnp.where(grown, scale * 2.0, scale), jnp.maximum(scale * 0.5, 1.0))
    new_good = jnp.where(finite & ~grown, good_steps + 1, 0)
    return new_scale, new_good.astype(good_steps.dtype)
