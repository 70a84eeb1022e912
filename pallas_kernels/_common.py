"""Small helpers shared by the kernels: constants, shape arithmetic, dtype checks."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def check_float_dtype(name: str, x: jax.Array, allowed=(jnp.float32, jnp.bfloat16, jnp.float16)) -> None:
    if x.dtype not in [jnp.dtype(d) for d in allowed]:
        raise ValueError(f"{name}.dtype must be one of float32, bfloat16, float16; got {x.dtype}")
