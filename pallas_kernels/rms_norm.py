"""RMSNorm with an optional fused residual add: the API, plan and custom_vjp of the Triton kernels in
`rms_norm_triton.py` (jax-triton on the GPU, Triton's interpreter with interpret=True; `triton_launch.py`).

  forward   grid (N/br,):   s = x + residual (stored in x.dtype),  rstd = rsqrt(mean(s^2) + eps),
                             y = s * rstd * w.  One read of x (and residual), one write of y (and s).
  backward  grid (N/rb,):   each program walks rb rows `chunk` at a time and keeps its dw partial
                             sum in fp32 registers; dx = rstd * (dy*w - s_hat * mean(dy*w*s_hat)) (+ ds).
                             The [N/rb, D] partials are summed by XLA (a small fraction of the traffic).
            or, with programs_bwd = P > 0, a persistent grid (P,): program p walks the chunks
                             p, p + P, p + 2P, ... of `chunk` rows over the whole arrays, so the
                             partials are [P, D] whatever N is.
Bytes (bf16, with residual): fwd 4*N*D*2 (x, r in; y, s out), bwd 4*N*D*2 (s, dy, ds in; dx out).
Rows are padded to whole blocks and D to a power of two >= 16 here, so the kernels need no masks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import check_float_dtype, is_pow2, next_pow2, round_up
from pallas_kernels.triton_launch import launch

_KERNELS = "pallas_kernels.rms_norm_triton"


@dataclasses.dataclass(frozen=True)
class RmsNormBlockSizes:
    """Rows per forward program; rows per backward program and rows per backward loop step.

    programs_bwd = 0: backward grid (N/block_rows_bwd,). programs_bwd = P > 0: persistent backward
    grid of min(P, N/chunk_rows_bwd) programs striding over chunks of chunk_rows_bwd rows
    (block_rows_bwd then only sets the row padding). prefetch_bwd: each backward step loads the
    next step's rows before its own math (one step of loads always in flight).
    """
    block_rows: int = 4
    block_rows_bwd: int = 16
    chunk_rows_bwd: int = 2
    num_warps: int = 8
    num_warps_bwd: int = 4
    programs_bwd: int = 264  # 2 per SM on a 132-SM H100/H200
    prefetch_bwd: bool = True

    def __post_init__(self):
        if not (isinstance(self.programs_bwd, int) and self.programs_bwd >= 0):
            raise ValueError(f"RmsNormBlockSizes.programs_bwd must be an int >= 0; got {self.programs_bwd!r}")
        if not isinstance(self.prefetch_bwd, bool):
            raise ValueError(f"RmsNormBlockSizes.prefetch_bwd must be a bool; got {self.prefetch_bwd!r}")
        for f in ("block_rows", "block_rows_bwd", "chunk_rows_bwd", "num_warps", "num_warps_bwd"):
            val = getattr(self, f)
            if not is_pow2(val):
                raise ValueError(f"RmsNormBlockSizes.{f} must be a power of two; got {val!r}")
        if self.block_rows_bwd % self.chunk_rows_bwd:
            raise ValueError(f"RmsNormBlockSizes.block_rows_bwd={self.block_rows_bwd} must be a "
                             f"multiple of chunk_rows_bwd={self.chunk_rows_bwd}")


def rms_norm_reference(x, w, *, eps: float = 1e-6, residual=None):
    """jnp RMSNorm; with residual returns (rms_norm(x + residual), x + residual)."""
    s = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    sf = s.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
    y = (sf * rstd * w.astype(jnp.float32)).astype(x.dtype)
    return y if residual is None else (y, s)


@dataclasses.dataclass(frozen=True)
class _Plan:
    d: int
    eps: float
    has_res: bool
    blocks: RmsNormBlockSizes
    interpret: bool


def _dummy(a):
    """The one-element stand-in for an array a kernel does not touch in this plan (no residual)."""
    return jnp.zeros((1,), a.dtype)


def _forward(x2, r2, w, plan: _Plan):
    """[(y, s,) rstd]: y and s [n, dp] in x.dtype (s only with a residual), rstd [n] fp32."""
    n, dp = x2.shape
    br = plan.blocks.block_rows
    rows = jax.ShapeDtypeStruct(x2.shape, x2.dtype)
    s_shape = rows if plan.has_res else jax.ShapeDtypeStruct((1,), x2.dtype)
    y, s, rstd = launch(_KERNELS, "rms_norm_fwd", x2, r2 if plan.has_res else _dummy(x2), w,
                        out_shape=[rows, s_shape, jax.ShapeDtypeStruct((n,), jnp.float32)],
                        grid=(n // br,), num_warps=plan.blocks.num_warps, num_stages=1, interpret=plan.interpret,
                        D=plan.d, DP=dp, EPS=plan.eps, BR=br, HAS_RES=plan.has_res)
    return [y, s, rstd] if plan.has_res else [y, rstd]


def _backward(s2, w, rstd, dy2, ds2, plan: _Plan):
    """(dx [n, dp] in s.dtype, dw [dp] fp32): the kernel's per-program partials of dw summed here."""
    n, dp = s2.shape
    bs = plan.blocks
    chunk = bs.chunk_rows_bwd
    if bs.programs_bwd:  # persistent: programs stride over all n/chunk chunks
        programs = min(bs.programs_bwd, n // chunk)
        grid, n_chunks = programs, n // chunk
    else:  # a program per block_rows_bwd rows, walked chunk by chunk
        programs, grid, n_chunks = 0, n // bs.block_rows_bwd, bs.block_rows_bwd // chunk
    dx, dw_part = launch(_KERNELS, "rms_norm_bwd", s2, w, rstd, dy2, ds2 if plan.has_res else _dummy(s2),
                         out_shape=[jax.ShapeDtypeStruct(s2.shape, s2.dtype),
                                    jax.ShapeDtypeStruct((grid, dp), jnp.float32)],
                         grid=(grid,), num_warps=bs.num_warps_bwd, num_stages=2, interpret=plan.interpret,
                         D=plan.d, DP=dp, CHUNK=chunk, N_CHUNKS=n_chunks, PROGRAMS=programs,
                         PREFETCH=bs.prefetch_bwd, HAS_RES=plan.has_res)
    return dx, jnp.sum(dw_part, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms(x2, r2, w, plan):
    out = _forward(x2, r2, w, plan)
    return tuple(out[:-1])


def _rms_fwd(x2, r2, w, plan):
    out = _forward(x2, r2, w, plan)
    s2 = out[1] if plan.has_res else x2
    return tuple(out[:-1]), (s2, w, out[-1])


def _rms_bwd(plan, res, cts):
    s2, w, rstd = res
    dy2 = cts[0].astype(s2.dtype)
    ds2 = cts[1].astype(s2.dtype) if plan.has_res else None
    dx, dw = _backward(s2, w, rstd, dy2, ds2, plan)
    dw = dw.astype(w.dtype)
    return (dx, dx, dw) if plan.has_res else (dx, None, dw)


_rms.defvjp(_rms_fwd, _rms_bwd)


def rms_norm(x, w, *, eps: float = 1e-6, residual=None, block_sizes: RmsNormBlockSizes | None = None,
             interpret: bool = False):
    """RMSNorm over the last dim of x [..., D] with weight w [D]; fp32 math, output in x.dtype.

    With residual (same shape as x): returns (rms_norm(x + residual), x + residual), one pass.
    """
    check_float_dtype("x", x)
    check_float_dtype("w", w)
    if x.ndim < 1 or w.shape != (x.shape[-1],):
        raise ValueError(f"w must have shape (D,) = ({x.shape[-1] if x.ndim else '?'},) for "
                         f"x.shape={x.shape}; got w.shape={w.shape}")
    if residual is not None and (residual.shape != x.shape):
        raise ValueError(f"residual.shape={residual.shape} must equal x.shape={x.shape}")
    if residual is not None:
        check_float_dtype("residual", residual)
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps!r}")
    bs = block_sizes or RmsNormBlockSizes()
    if not isinstance(bs, RmsNormBlockSizes):
        raise ValueError(f"block_sizes must be a RmsNormBlockSizes; got {type(bs).__name__}")
    d = x.shape[-1]
    n = x.size // d
    dp = max(16, next_pow2(d))
    n_pad = round_up(max(n, 1), max(bs.block_rows, bs.block_rows_bwd))
    plan = _Plan(d=d, eps=float(eps), has_res=residual is not None, blocks=bs, interpret=bool(interpret))

    def flat(a):
        a = a.reshape(n, d)
        return a if (n_pad, dp) == (n, d) else jnp.pad(a, ((0, n_pad - n), (0, dp - d)))

    w_p = w if dp == d else jnp.pad(w, (0, dp - d))  # zero weight on padded columns
    out = _rms(flat(x), None if residual is None else flat(residual), w_p, plan)
    out = [o[:n, :d].reshape(x.shape) for o in out]
    return out[0] if residual is None else (out[0], out[1])
