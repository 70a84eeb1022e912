"""Grouped matmul: the rows of group g times rhs[g]; Triton-language kernels (`grouped_matmul_triton.py`)
launched through `triton_launch` (jax-triton on the GPU, Triton's interpreter on the CPU).

Semantics of `jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`: group g owns the
contiguous rows [start_g, end_g), start_g = sizes[0] + ... + sizes[g-1]; rows past the sum are 0.
(XLA's GPU ragged_dot is a dense [G, M, K] batched dot: G times the FLOPs and an M·K·G buffer.)

  gmm    grid (N/bn, M/bm): program (j, i) owns output tile [i·bm, (i+1)·bm) x [j·bn, (j+1)·bn) and
         loops over the groups whose rows meet that tile (g_lo[i] .. g_hi[i], from a schedule built
         with jnp inside jit), acc += rows_in_g(lhs tile) @ rhs[g][:, j·bn:], K in bk steps.
         Write scheme: every tile is written once, by its one program, with zeros in rows no group owns;
         a tile straddling two groups costs two masked K loops (at most M/bm + G - 1 tile-group visits
         in all), but no output is read back, zero-filled first, or raced on.
  tgmm   grid (N/bn, K/bk, G): d_rhs[g] = lhs_g^T @ d_out_g, program (n, k, g) loops over the row tiles
         of group g (a dynamic trip count; 0 for an empty group, whose gradient stays 0), masking the
         rows of the edge tiles that belong to the neighbours.
  backward   d_lhs = gmm(d_out, rhs) contracting over N (rhs read as [G, N, K] in place, no transpose
             copy); d_rhs = tgmm(lhs, d_out). Cotangents are cast to the input dtype before the kernels.

This module holds the API, the plan, the schedule (int32 arrays the kernels read), the padding of
every dim to whole blocks (the kernels' only masks are the group masks) and the custom_vjp.
FLOPs 2·M·K·N per gmm plus the straddle visits; fp32 accumulation; bf16, fp16 or fp32 inputs (fp32 dots
in full fp32, `input_precision="ieee"`, not tf32). Needs the `triton` package (and jax-triton on a GPU).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import cdiv, check_float_dtype, is_pow2, round_up
from pallas_kernels.triton_launch import launch

_KERNELS = "pallas_kernels.grouped_matmul_triton"


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlockSizes:
    """Tiles of the forward/d_lhs kernel (block_m x block_n, K in block_k steps) and of the tgmm
    kernel (block_k_t x block_n_t outputs, rows in block_m_t steps). Powers of two >= 16; a dim smaller
    than its block is padded to the block."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    block_m_t: int = 64
    block_k_t: int = 128
    block_n_t: int = 128
    num_warps_t: int = 8
    num_stages_t: int = 3

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k", "block_m_t", "block_k_t", "block_n_t"):
            val = getattr(self, f)
            if not (is_pow2(val) and val >= 16):
                raise ValueError(f"GroupedMatmulBlockSizes.{f} must be a power of two >= 16; got {val!r}")
        for f in ("num_warps", "num_warps_t", "num_stages", "num_stages_t"):
            val = getattr(self, f)
            if not (isinstance(val, int) and val >= 1):
                raise ValueError(f"GroupedMatmulBlockSizes.{f} must be an int >= 1; got {val!r}")


def grouped_matmul_reference(lhs_mk, rhs_gkn, group_sizes_g, *, preferred_element_type=None):
    """Per-group jnp loop (fp32 math): out[start_g:end_g] = lhs[start_g:end_g] @ rhs[g]; other rows 0."""
    m = lhs_mk.shape[0]
    ends_g = jnp.cumsum(group_sizes_g)
    group_m = jnp.searchsorted(ends_g, jnp.arange(m), side="right")  # G for rows past the sum
    out = jnp.zeros((m, rhs_gkn.shape[2]), jnp.float32)
    for g in range(rhs_gkn.shape[0]):
        prod = jnp.dot(lhs_mk.astype(jnp.float32), rhs_gkn[g].astype(jnp.float32), precision=lax.Precision.HIGHEST)
        out = jnp.where((group_m == g)[:, None], prod, out)
    return out.astype(preferred_element_type or lhs_mk.dtype)


@dataclasses.dataclass(frozen=True)
class _Plan:
    blocks: GroupedMatmulBlockSizes
    interpret: bool
    out_dtype: jnp.dtype


def _bounds(group_sizes_g, m):
    """Row ranges [start_g, end_g) clipped to the M rows (int32)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes_g.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _schedule(starts, ends, m, bm):
    """Per m-tile i: the groups [lo_i, hi_i) whose rows meet the tile (empty past the last group row).
    An empty group between two others may fall inside the range; its row mask is all false."""
    tile_first = jnp.arange(cdiv(m, bm), dtype=jnp.int32) * bm
    total = ends[-1]
    tile_last = jnp.minimum(tile_first + bm, total) - 1
    # Group of row r = #groups ending at or before r. A compare-and-count ([M/bm, G] int32, small), not
    # jnp.searchsorted, which trips an assertion of jax 0.10 inside a shard_map manual region.
    count_le = lambda r: jnp.sum(ends[None, :] <= r[:, None], axis=1, dtype=jnp.int32)  # noqa: E731
    lo, hi = count_le(tile_first), count_le(tile_last) + 1
    return lo, jnp.where(tile_first < total, hi, lo)


def _pad2(x, rows, cols):
    r, c = x.shape
    return x if (r, c) == (rows, cols) else jnp.pad(x, ((0, rows - r), (0, cols - c)))


def _precision(dtype) -> str:
    """fp32 inputs get fp32 products on the GPU (tf32 would be Triton's default); 16-bit ones ignore it."""
    return "ieee" if dtype == jnp.float32 else "tf32"


def _gmm_call(lhs_mk, rhs, group_sizes_g, plan: _Plan, *, trans_rhs: bool):
    """lhs [M, K] x rhs [G, K, N] (or [G, N, K] with trans_rhs) -> [M, N] in plan.out_dtype."""
    bs = plan.blocks
    m, k = lhs_mk.shape
    n = rhs.shape[1] if trans_rhs else rhs.shape[2]
    bm, bk, bn = bs.block_m, bs.block_k, bs.block_n
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    rows, cols = (np_, kp) if trans_rhs else (kp, np_)
    rhs_p = rhs if rhs.shape[1:] == (rows, cols) else jnp.pad(
        rhs, ((0, 0), (0, rows - rhs.shape[1]), (0, cols - rhs.shape[2])))
    starts, ends = _bounds(group_sizes_g, m)
    lo, hi = _schedule(starts, ends, mp, bm)
    (out,) = launch(_KERNELS, "gmm_kernel", lo, hi, starts, ends, _pad2(lhs_mk, mp, kp), rhs_p,
                    out_shape=[jax.ShapeDtypeStruct((mp, np_), plan.out_dtype)],
                    grid=(np_ // bn, mp // bm),  # n-tiles fastest: the programs of one lhs row panel run together
                    num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=plan.interpret,
                    K_PAD=kp, N_PAD=np_, BM=bm, BK=bk, BN=bn, TRANS_RHS=trans_rhs,
                    PRECISION=_precision(lhs_mk.dtype))
    return out if (mp, np_) == (m, n) else out[:m, :n]


def _tgmm_call(lhs_mk, dy_mn, group_sizes_g, n_groups: int, out_dtype, plan: _Plan):
    """Per group g: lhs[rows of g]^T @ dy[rows of g] -> [G, K, N] in out_dtype (0 for empty groups)."""
    bs = plan.blocks
    m, k = lhs_mk.shape
    n = dy_mn.shape[1]
    bm, bk, bn = bs.block_m_t, bs.block_k_t, bs.block_n_t
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    starts, ends = _bounds(group_sizes_g, m)
    (out,) = launch(_KERNELS, "tgmm_kernel", starts, ends, _pad2(lhs_mk, mp, kp), _pad2(dy_mn, mp, np_),
                    out_shape=[jax.ShapeDtypeStruct((n_groups, kp, np_), out_dtype)],
                    grid=(np_ // bn, kp // bk, n_groups),  # groups slowest: one group's programs share its rows
                    num_warps=bs.num_warps_t, num_stages=bs.num_stages_t, interpret=plan.interpret,
                    K_PAD=kp, N_PAD=np_, BM=bm, BK=bk, BN=bn, PRECISION=_precision(lhs_mk.dtype))
    return out if (kp, np_) == (k, n) else out[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs_mk, rhs_gkn, group_sizes_g, plan):
    return _gmm_call(lhs_mk, rhs_gkn, group_sizes_g, plan, trans_rhs=False)


def _gmm_fwd(lhs_mk, rhs_gkn, group_sizes_g, plan):
    return _gmm(lhs_mk, rhs_gkn, group_sizes_g, plan), (lhs_mk, rhs_gkn, group_sizes_g)


def _gmm_bwd(plan, res, d_out_mn):
    lhs_mk, rhs_gkn, group_sizes_g = res
    dy = d_out_mn.astype(lhs_mk.dtype)  # the kernels take one dtype per dot
    d_lhs = _gmm_call(dy, rhs_gkn, group_sizes_g, dataclasses.replace(plan, out_dtype=lhs_mk.dtype),
                      trans_rhs=True)
    d_rhs = _tgmm_call(lhs_mk, dy, group_sizes_g, rhs_gkn.shape[0], rhs_gkn.dtype, plan)
    return d_lhs, d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs_mk, rhs_gkn, group_sizes_g, *, preferred_element_type=None,
        block_sizes: GroupedMatmulBlockSizes | None = None, interpret: bool | None = None):
    """out [M, N]: rows of group g (contiguous, in order) times rhs_gkn[g]; rows past sum(sizes) are 0.

    Same semantics as jax.lax.ragged_dot(lhs_mk, rhs_gkn, group_sizes_g). Differentiable in lhs and rhs.
    interpret=None: interpret mode unless the default backend is a GPU.
    """
    check_float_dtype("lhs", lhs_mk)
    check_float_dtype("rhs", rhs_gkn)
    if lhs_mk.ndim != 2 or rhs_gkn.ndim != 3 or rhs_gkn.shape[1] != lhs_mk.shape[1]:
        raise ValueError(f"gmm needs lhs [M, K] and rhs [G, K, N]; got lhs.shape={lhs_mk.shape}, "
                         f"rhs.shape={rhs_gkn.shape}")
    if lhs_mk.dtype != rhs_gkn.dtype:
        raise ValueError(f"lhs.dtype={lhs_mk.dtype} and rhs.dtype={rhs_gkn.dtype} must match")
    if group_sizes_g.shape != (rhs_gkn.shape[0],) or not jnp.issubdtype(group_sizes_g.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers of shape (G,) = ({rhs_gkn.shape[0]},); got "
                         f"{group_sizes_g.dtype}{list(group_sizes_g.shape)}")
    bs = block_sizes or GroupedMatmulBlockSizes()
    if not isinstance(bs, GroupedMatmulBlockSizes):
        raise ValueError(f"block_sizes must be a GroupedMatmulBlockSizes; got {type(bs).__name__}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    out_dtype = jnp.dtype(preferred_element_type or lhs_mk.dtype)
    plan = _Plan(blocks=bs, interpret=bool(interpret), out_dtype=out_dtype)
    return _gmm(lhs_mk, rhs_gkn, group_sizes_g.astype(jnp.int32), plan)
