"""RMSNorm with an optional fused residual add (Pallas, Triton lowering on the GPU).

  forward   grid (N/br,):   s = x + residual (stored in x.dtype),  rstd = rsqrt(mean(s^2) + eps),
                             y = s * rstd * w.  One read of x (and residual), one write of y (and s).
  backward  grid (N/rb,):   each program walks rb rows `chunk` at a time and keeps its dw partial
                             sum in fp32 registers; dx = rstd * (dy*w - s_hat * mean(dy*w*s_hat)) (+ ds).
                             The [N/rb, D] partials are summed by XLA (a small fraction of the traffic).
            or, with programs_bwd = P > 0, a persistent grid (P,): program p walks the chunks
                             p, p + P, p + 2P, ... of `chunk` rows over full-array refs, so the
                             partials are [P, D] whatever N is.
Bytes (bf16, with residual): fwd 4*N*D*2 (x, r in; y, s out), bwd 4*N*D*2 (s, dy, ds in; dx out).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_float_dtype, is_pow2, next_pow2, round_up, triton_params


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


def _fwd_kernel(*refs, d: int, eps: float, has_res: bool):
    if has_res:
        x_ref, r_ref, w_ref, y_ref, s_ref, rstd_ref = refs
        s = (x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(s_ref.dtype)
        s_ref[...] = s
        s = s.astype(jnp.float32)  # normalize the stored (rounded) sum, as the reference does
    else:
        x_ref, w_ref, y_ref, rstd_ref = refs
        s = x_ref[...].astype(jnp.float32)
    rstd = lax.rsqrt(jnp.sum(s * s, axis=1) / d + eps)
    y_ref[...] = (s * rstd[:, None] * w_ref[...].astype(jnp.float32)[None, :]).astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _bwd_kernel(*refs, d: int, chunk: int, n_chunks: int, has_res: bool, programs: int = 0,
                prefetch: bool = False):
    """programs == 0: the refs are this program's rb-row blocks, walked in n_chunks steps.
    programs == P > 0: the refs are the full arrays (n_chunks * chunk rows); program p walks the
    chunks p, p + P, ... (at least one: P <= n_chunks).
    prefetch: step c issues the loads of step c + 1 (the last step reloads itself) before its own
    math, so a program keeps one step of loads in flight while it reduces and stores."""
    if has_res:
        s_ref, w_ref, rstd_ref, dy_ref, ds_ref, dx_ref, dw_ref = refs
    else:
        s_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_ref = refs
        ds_ref = None
    w = w_ref[...].astype(jnp.float32)[None, :]
    if programs:
        pid = pl.program_id(0)
        steps = lax.div(n_chunks - 1 - pid, programs) + 1  # operands >= 0
        rows_of = lambda c: pl.ds((pid + c * programs) * chunk, chunk)
    else:
        steps = n_chunks
        rows_of = lambda c: pl.ds(c * chunk, chunk)

    def load(c):
        rows = rows_of(c)
        return (rstd_ref[rows], s_ref[rows, :], dy_ref[rows, :],
                ds_ref[rows, :] if has_res else None)

    def step(c, vals, dw):
        rstd, s, dy, ds = vals
        rstd = rstd[:, None]
        s_hat = s.astype(jnp.float32) * rstd
        dy = dy.astype(jnp.float32)
        g = dy * w
        dx = rstd * (g - s_hat * (jnp.sum(g * s_hat, axis=1, keepdims=True) / d))
        if has_res:
            dx = dx + ds.astype(jnp.float32)
        dx_ref[rows_of(c), :] = dx.astype(dx_ref.dtype)
        return dw + jnp.sum(dy * s_hat, axis=0)

    dw0 = jnp.zeros((w.shape[1],), jnp.float32)
    if prefetch:
        def body(c, carry):
            dw, vals = carry
            nxt = load(jnp.minimum(c + 1, steps - 1))
            return step(c, vals, dw), nxt

        dw, _ = lax.fori_loop(0, steps, body, (dw0, load(0)))
    else:
        dw = lax.fori_loop(0, steps, lambda c, dw: step(c, load(c), dw), dw0)
    dw_ref[...] = dw


@dataclasses.dataclass(frozen=True)
class _Plan:
    d: int
    eps: float
    has_res: bool
    blocks: RmsNormBlockSizes
    interpret: bool


def _forward(x2, r2, w, plan: _Plan):
    n, dp = x2.shape
    br = plan.blocks.block_rows
    row = pl.BlockSpec((br, dp), lambda i: (i, 0))
    wspec = pl.BlockSpec((dp,), lambda i: (0,))
    vec = pl.BlockSpec((br,), lambda i: (i,))
    ins, args = ([row, row, wspec], [x2, r2, w]) if plan.has_res else ([row, wspec], [x2, w])
    outs = [row, row, vec] if plan.has_res else [row, vec]
    shapes = [jax.ShapeDtypeStruct(x2.shape, x2.dtype)] * (2 if plan.has_res else 1)
    shapes.append(jax.ShapeDtypeStruct((n,), jnp.float32))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, d=plan.d, eps=plan.eps, has_res=plan.has_res),
        grid=(n // br,), in_specs=ins, out_specs=outs, out_shape=shapes,
        compiler_params=triton_params(plan.blocks.num_warps, 1), interpret=plan.interpret,
        name="rms_norm_fwd",
    )(*args)


def _backward(s2, w, rstd, dy2, ds2, plan: _Plan):
    n, dp = s2.shape
    bs = plan.blocks
    rb, chunk = bs.block_rows_bwd, bs.chunk_rows_bwd
    if bs.programs_bwd:  # persistent: every program sees the full arrays
        programs = min(bs.programs_bwd, n // chunk)
        grid, n_chunks = programs, n // chunk
        row = pl.BlockSpec((n, dp), lambda i: (0, 0))
        vec = pl.BlockSpec((n,), lambda i: (0,))
    else:
        programs, grid, n_chunks = 0, n // rb, rb // chunk
        row = pl.BlockSpec((rb, dp), lambda i: (i, 0))
        vec = pl.BlockSpec((rb,), lambda i: (i,))
    ins = [row, pl.BlockSpec((dp,), lambda i: (0,)), vec, row]
    args = [s2, w, rstd, dy2]
    if plan.has_res:
        ins.append(row)
        args.append(ds2)
    dx, dw_part = pl.pallas_call(
        functools.partial(_bwd_kernel, d=plan.d, chunk=chunk, n_chunks=n_chunks, has_res=plan.has_res,
                          programs=programs, prefetch=bs.prefetch_bwd),
        grid=(grid,), in_specs=ins,
        out_specs=[row, pl.BlockSpec((None, dp), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(s2.shape, s2.dtype),
                   jax.ShapeDtypeStruct((grid, dp), jnp.float32)],
        compiler_params=triton_params(bs.num_warps_bwd, 2), interpret=plan.interpret,
        name="rms_norm_bwd",
    )(*args)
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
