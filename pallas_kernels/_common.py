"""Small helpers shared by the kernels: version shims, matmul, shape arithmetic."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# The Triton compiler-params class was renamed (TritonCompilerParams -> CompilerParams); accept
# both so the same code lowers on every jax this project supports (0.10 on CPU, 0.11 on the GPU).
_TritonParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


def triton_params(num_warps: int, num_stages: int):
    """Compiler params that also select the Triton lowering of `pl.pallas_call` on the GPU."""
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """2-D matmul with fp32 accumulation; transposes are folded into the contraction dims."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


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
