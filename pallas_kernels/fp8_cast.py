"""fp8 quantization with the transposed copy in one pass: the API and plan of the Triton kernel in
`fp8_cast_triton.py` (jax-triton on the GPU, Triton's interpreter with interpret=True; `triton_launch.py`).

    q  [..., R, C] = fp8(clip(x / scale, -max, max))    x's layout
    qT [..., C, R] = q transposed                        the K-major operand of a backward GEMM
    amax           = max |x|                             the tensor's, for delayed scaling's history

An fp8 GEMM on Hopper runs at full rate only with both operands contracting on their last dim, so every
operand a backward GEMM contracts the other way needs its transpose. Here a tile of x is read once and both
layouts and the tile's amax are written from registers: R*C*(itemsize(x) + 2) bytes. On an H100 that ran at
1.5-2.0 TB/s from bf16 and 2.5-2.7 TB/s from fp32, 1.2-1.8x XLA's cast of both layouts alone; inside a train
step it is slower than XLA's casts, which XLA fuses into the ops that produce the operand, where a custom call
needs the operand written out first (docs/PERFORMANCE.md, "The one-pass fp8 cast").
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import cdiv, check_float_dtype, is_pow2
from pallas_kernels.triton_launch import launch

_KERNELS = "pallas_kernels.fp8_cast_triton"
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class Fp8CastBlockSizes:
    """A program's tile: block_rows x block_cols of x (powers of two)."""
    block_rows: int = 64
    block_cols: int = 128
    num_warps: int = 4

    def __post_init__(self):
        for f in ("block_rows", "block_cols", "num_warps"):
            if not is_pow2(getattr(self, f)):
                raise ValueError(f"Fp8CastBlockSizes.{f} must be a power of two; got {getattr(self, f)!r}")


def cast_transpose_reference(x, scale, dtype, *, transpose: bool = True, amax: bool = False):
    """(q, qT or None, amax or None) in jnp: q = clip(x / scale) in fp8 `dtype`, qT its last two dims swapped."""
    m = float(jnp.finfo(dtype).max)
    q = jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)
    return (q, jnp.swapaxes(q, -1, -2) if transpose else None,
            jnp.max(jnp.abs(x)).astype(jnp.float32) if amax else None)


def cast_transpose(x, scale, dtype, *, transpose: bool = True, amax: bool = False,
                   block_sizes: Fp8CastBlockSizes | None = None, interpret: bool = False):
    """`cast_transpose_reference` in one pass of the kernel. x [..., R, C] float32/bfloat16/float16; scale a
    positive fp32 scalar: a power of two, as the fp8 recipes' scales are, divides exactly (another may round
    otherwise than jnp's division on the GPU); dtype float8_e4m3fn or float8_e5m2."""
    check_float_dtype("x", x)
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., R, C); got shape {x.shape}")
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
    scale = jnp.asarray(scale, jnp.float32)
    if scale.size != 1:
        raise ValueError(f"scale must be a scalar; got shape {scale.shape}")
    bs = block_sizes or Fp8CastBlockSizes()
    *lead, r, c = x.shape
    nb = math.prod(lead)
    if not nb * r * c:  # nothing to read: XLA's empty arrays, without a launch
        return cast_transpose_reference(x, scale, dtype, transpose=transpose, amax=amax)
    grid = (cdiv(r, bs.block_rows), cdiv(c, bs.block_cols), nb)
    outs = [jax.ShapeDtypeStruct((nb, r, c), dtype),
            jax.ShapeDtypeStruct((nb, c, r) if transpose else (1,), dtype),
            jax.ShapeDtypeStruct((math.prod(grid) if amax else 1,), jnp.float32)]
    q, q_t, tiles_amax = launch(_KERNELS, "fp8_cast_transpose", x.reshape(nb, r, c), scale.reshape(1),
                                out_shape=outs, grid=grid, num_warps=bs.num_warps, num_stages=1,
                                interpret=interpret, R=r, C=c, BR=bs.block_rows, BC=bs.block_cols,
                                E4M3=dtype == FP8_DTYPES[0], TRANSPOSE=transpose, WRITE_AMAX=amax)
    return (q.reshape(x.shape), q_t.reshape(*lead, c, r) if transpose else None,
            jnp.max(tiles_amax) if amax else None)
