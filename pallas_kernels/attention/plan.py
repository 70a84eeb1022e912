"""Static plan shared by the attention kernels: block sizes, padded lengths, loop bounds, row statistics.

Loop-bound arithmetic (bottom-right causal, offset = S - T): query i sees key j iff j <= i + offset.
For a query block [qs, qs + bq) and key block [ks, ks + bk):
  * the block is visited at all iff ks <= qs + bq - 1 + offset      (upper bound of the kv loop)
  * the block needs no causal mask iff ks + bk - 1 <= qs + offset    (every row sees every key)
Only blocks between those two bounds (the diagonal band), blocks holding padded keys, and all
blocks when segment ids are given pay for building a mask.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import LOG2E, is_pow2


@dataclasses.dataclass(frozen=True)
class FlashAttentionBlockSizes:
    """Tile sizes (powers of two >= 16) and Triton launch settings of the three attention kernels.

    fwd: a program owns `block_q` queries and walks keys `block_k` at a time.
    dkdv: a program owns `block_k_dkv` keys of one kv head and walks `block_q_dkv` queries of every
    query head in its GQA group. dq: a program owns `block_q_dq` queries, walks `block_k_dq` keys.
    """
    block_q: int = 128
    block_k: int = 64
    # Backward defaults: the fastest of the configs swept on an H100 with head dim 128 (docs/PERFORMANCE.md,
    # "The Triton fallback on jax-triton").
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64
    num_warps_fwd: int = 8
    num_stages_fwd: int = 3
    num_warps_dkdv: int = 8
    num_stages_dkdv: int = 3
    num_warps_dq: int = 8
    num_stages_dq: int = 3

    def __post_init__(self):
        for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            val = getattr(self, f)
            if not is_pow2(val) or val < 16:
                raise ValueError(f"FlashAttentionBlockSizes.{f} must be a power of two >= 16; got {val!r}")
        for f in ("num_warps_fwd", "num_stages_fwd", "num_warps_dkdv", "num_stages_dkdv",
                  "num_warps_dq", "num_stages_dq"):
            val = getattr(self, f)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"FlashAttentionBlockSizes.{f} must be a positive int; got {val!r}")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "FlashAttentionBlockSizes":
        """Defaults that fit shared memory and registers for the given (padded) head dim."""
        if head_dim <= 64:
            return cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=128, block_q_dq=128,
                       block_k_dq=64, num_warps_fwd=4, num_stages_fwd=3, num_warps_dkdv=4,
                       num_warps_dq=4)
        if head_dim <= 128:
            return cls()
        return cls(block_q=64, block_k=32, block_q_dkv=32, block_k_dkv=64, block_q_dq=64,
                   block_k_dq=32, num_warps_fwd=8, num_stages_fwd=2, num_warps_dkdv=8, num_stages_dkdv=1,
                   num_warps_dq=8, num_stages_dq=1)


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tiles of the Mosaic GPU (Hopper) kernels. Query tiles are fixed at 2 warpgroups x 64 rows
    (the wgmma M); these set the streamed side and the depth of its shared-memory pipeline.

    fwd: each consumer walks keys `block_k` at a time through `stages` slots.
    dq: each consumer walks keys `block_k_dq` at a time. dkdv: each consumer owns 64 keys and walks
    queries `block_q_dkv` at a time. Both backward kernels use `stages_bwd` slots.
    dq_atomic: dQ from the dK/dV kernel, each step's dS K added into an fp32 buffer by TMA reduce-adds
    (5 GEMMs in all); False: a separate dQ kernel recomputes S and dP (7 GEMMs, no atomics), which
    block_q_dkv=128 needs. On an H200 (2026-11-28, docs/PERFORMANCE.md) dq_atomic ran forward+backward
    level (causal S4096) to 11% faster (head dim 64) than the dQ kernel, and 1% slower on GQA.
    """
    block_k: int = 128
    stages: int = 2
    block_k_dq: int = 64
    block_q_dkv: int = 64
    stages_bwd: int = 2
    dq_atomic: bool = True

    def __post_init__(self):
        for f in ("block_k", "block_k_dq", "block_q_dkv"):
            val = getattr(self, f)
            if val not in (64, 128, 256):
                raise ValueError(f"MosaicBlockSizes.{f} must be 64, 128 or 256; got {val!r}")
        for f in ("stages", "stages_bwd"):
            val = getattr(self, f)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"MosaicBlockSizes.{f} must be a positive int; got {val!r}")
        if self.dq_atomic and self.block_q_dkv != 64:
            raise ValueError(f"MosaicBlockSizes.dq_atomic (the default) needs block_q_dkv=64 (one wgmma's rows of "
                             f"dQ); got block_q_dkv={self.block_q_dkv}; set dq_atomic=False for larger query tiles")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "MosaicBlockSizes":
        """Defaults that fit the 227 KiB of shared memory for head dims 64 and 128."""
        if head_dim <= 64:
            return cls(block_k=128, stages=3, block_k_dq=128, block_q_dkv=64, stages_bwd=3)
        return cls()


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Everything static about one call: hashable, so it can be a custom_vjp nondiff argument."""
    causal: bool
    sm_scale: float
    t_real: int
    s_real: int
    t_pad: int
    s_pad: int
    has_seg: bool
    blocks: FlashAttentionBlockSizes
    interpret: bool
    backend: str = "triton"  # "triton" | "mosaic": which kernels run this plan
    mosaic: MosaicBlockSizes | None = None

    @property
    def offset(self) -> int:
        return self.s_real - self.t_real


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def kv_loop_bounds(plan: AttentionPlan, q_start, bq: int, bk: int):
    """(n_unmasked, n_total) key blocks for the query block at q_start; keys past S are skipped."""
    hi = _i32((plan.s_real + bk - 1) // bk)
    if plan.causal:
        reach = jnp.maximum(q_start + (bq + plan.offset + bk - 1), 0)
        hi = jnp.minimum(lax.div(reach, _i32(bk)), hi)
        full = lax.div(jnp.maximum(q_start + (plan.offset + 1), 0), _i32(bk))
        n_safe = jnp.minimum(full, hi)
    else:
        n_safe = hi
    n_safe = jnp.minimum(n_safe, _i32(plan.s_real // bk))  # the block holding padded keys is masked
    if plan.has_seg:
        n_safe = _i32(0)
    return n_safe, hi


def q_loop_bounds(plan: AttentionPlan, k_start, bq: int, bk: int):
    """(lo, mid, hi) query blocks for the key block at k_start: [lo, mid) masked, [mid, hi) not."""
    hi = _i32((plan.t_real + bq - 1) // bq)
    if plan.causal:
        lo = jnp.minimum(lax.div(jnp.maximum(k_start - plan.offset, 0), _i32(bq)), hi)
        first_full = lax.div(jnp.maximum(k_start + (bk - 1 - plan.offset), 0) + (bq - 1), _i32(bq))
        mid = jnp.clip(first_full, lo, hi)
    else:
        lo = mid = _i32(0)
    if plan.has_seg:
        mid = hi
    return lo, mid, hi


def backward_stats(o, do, lse, dlse):
    """(delta, lse2) [B, H, Tp] fp32, what both backward kernels read per query row, computed by XLA.

    delta = rowsum(o * do) - dlse: the lse cotangent folds in, since d lse_i / d s_ij = p_ij, so
    ds_ij = p_ij (dp_ij - delta_i). lse2 = lse * log2(e), and +inf for a row that saw no key
    (lse = -inf), so that p = exp2(s - lse2) is exactly 0 there.
    """
    delta = jnp.einsum("bthe,bthe->bht", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    return delta, lse2
