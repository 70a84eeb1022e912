"""`flash_attention`: the public entry point, padding, and the custom_vjp wiring.

Inputs are padded (outside the custom_vjp) to whole blocks: T and S up to the largest query/key
block in use, E up to a power of two >= 16 with zeros (zero columns change neither q.k nor o).
Padded keys are masked inside the kernels; padded query rows get a zero cotangent from the
slice's transpose, so they add nothing to dK/dV. Cost of the padding: one copy of q/k/v when a
length is not a block multiple, none otherwise.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels._common import next_pow2, round_up
from pallas_kernels.attention.mosaic_bwd import mosaic_attention_backward
from pallas_kernels.attention.mosaic_common import is_hopper
from pallas_kernels.attention.mosaic_fwd import mosaic_attention_forward
from pallas_kernels.attention.plan import AttentionPlan, FlashAttentionBlockSizes, MosaicBlockSizes
from pallas_kernels.attention.reference import SegmentIds, check_attention_args
from pallas_kernels.attention.triton_backend import triton_attention_backward, triton_attention_forward

BACKENDS = ("auto", "mosaic", "triton")
# The checkpoint name on the forward kernel's outputs (o, lse), whichever backend ran it: the residuals the
# backward kernels read, which `train.remat=save_dots_attn` keeps so the backward never reruns the forward.
FORWARD_OUTPUTS = "flash_attention_forward_outputs"
# Which backend `auto` takes where both can run (Hopper, head dim 64 or 128, bf16/fp16): Mosaic measured
# 1.06-1.45x faster than the Triton kernels forward+backward on an H100 (docs/PERFORMANCE.md, 2026-11-26).
AUTO_ON_HOPPER = "mosaic"


def _forward(q, k, v, q_seg, kv_seg, plan: AttentionPlan):
    if plan.backend == "mosaic":
        return mosaic_attention_forward(q, k, v, q_seg, kv_seg, plan)
    return triton_attention_forward(q, k, v, q_seg, kv_seg, plan)


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, plan: AttentionPlan):
    if plan.backend == "mosaic":
        return mosaic_attention_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, plan)
    return triton_attention_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, plan: AttentionPlan):
    return _forward(q, k, v, q_seg, kv_seg, plan)


def _flash_fwd(q, k, v, q_seg, kv_seg, plan):
    o, lse = (checkpoint_name(x, FORWARD_OUTPUTS) for x in _forward(q, k, v, q_seg, kv_seg, plan))
    return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)


def _flash_bwd(plan, res, cts):
    q, k, v, q_seg, kv_seg, o, lse = res
    do, dlse = cts
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, o, lse, do.astype(o.dtype), dlse.astype(jnp.float32), plan)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _clamp_blocks(bs: FlashAttentionBlockSizes, t: int, s: int) -> FlashAttentionBlockSizes:
    """Shrinks blocks larger than the (power-of-two rounded) sequence so short inputs pad little."""
    tq, tk = max(16, next_pow2(t)), max(16, next_pow2(s))
    return dataclasses.replace(
        bs, block_q=min(bs.block_q, tq), block_k=min(bs.block_k, tk),
        block_q_dkv=min(bs.block_q_dkv, tq), block_k_dkv=min(bs.block_k_dkv, tk),
        block_q_dq=min(bs.block_q_dq, tq), block_k_dq=min(bs.block_k_dq, tk))


def mosaic_unavailable(head_dim: int, dtype, interpret: bool = False) -> str | None:
    """Why the Mosaic GPU kernels cannot run attention of this head dim and dtype here; None if they can."""
    e_pad = max(16, next_pow2(head_dim))
    if interpret:
        return "interpret mode runs the Triton kernels (Mosaic GPU's interpreter lacks wgmma operand transposes)"
    if not is_hopper():
        return "the Mosaic GPU kernels need a Hopper GPU (sm_90)"
    if e_pad not in (64, 128):
        return f"the Mosaic GPU kernels take head dims 64 and 128 (this one pads to {e_pad})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"the Mosaic GPU kernels take bfloat16 or float16 (got {jnp.dtype(dtype)})"
    return None


def _pick_backend(backend: str, q, interpret: bool) -> str:
    """The backend that runs this call; 'mosaic' asked for where it cannot run is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    why_not = mosaic_unavailable(q.shape[-1], q.dtype, interpret)
    if backend == "mosaic" and why_not:
        raise ValueError(f"backend='mosaic' cannot run here: {why_not}; use backend='auto' or 'triton'")
    if backend == "auto":
        return AUTO_ON_HOPPER if why_not is None else "triton"
    return backend


def _plan(q, k, v, segment_ids, causal, sm_scale, block_sizes, interpret, backend="auto"):
    """The static plan of one call, and q/k/v/segment ids padded to it."""
    q_seg, kv_seg, sm_scale = check_attention_args(q, k, v, segment_ids, sm_scale)
    if block_sizes is not None and not isinstance(block_sizes, (FlashAttentionBlockSizes, MosaicBlockSizes)):
        raise ValueError("block_sizes must be a FlashAttentionBlockSizes (Triton) or MosaicBlockSizes; "
                         f"got {type(block_sizes).__name__}")
    b, t, h, e = q.shape
    s = k.shape[1]
    e_pad = max(16, next_pow2(e))
    backend = _pick_backend(backend, q, interpret)
    triton_bs = block_sizes if isinstance(block_sizes, FlashAttentionBlockSizes) else None
    bs = _clamp_blocks(triton_bs or FlashAttentionBlockSizes.for_head_dim(e_pad), t, s)
    mosaic = None
    if backend == "mosaic":
        mosaic = block_sizes if isinstance(block_sizes, MosaicBlockSizes) else MosaicBlockSizes.for_head_dim(e_pad)
        # Query tiles are 2 warpgroups x 64 rows, dK/dV key tiles too; the streamed tiles set the rest.
        t_pad = round_up(t, max(128, mosaic.block_q_dkv))
        s_pad = round_up(s, max(128, mosaic.block_k, mosaic.block_k_dq))
    else:
        t_pad = round_up(t, max(bs.block_q, bs.block_q_dkv, bs.block_q_dq))
        s_pad = round_up(s, max(bs.block_k, bs.block_k_dkv, bs.block_k_dq))
    plan = AttentionPlan(causal=bool(causal), sm_scale=sm_scale, t_real=t, s_real=s, t_pad=t_pad,
                         s_pad=s_pad, has_seg=q_seg is not None, blocks=bs, interpret=bool(interpret),
                         backend=backend, mosaic=mosaic)
    if q_seg is not None:
        # Padded queries and keys get ids that match nothing real (and not each other).
        q_seg = jnp.pad(q_seg, ((0, 0), (0, t_pad - t)), constant_values=jnp.iinfo(jnp.int32).min)
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, s_pad - s)), constant_values=jnp.iinfo(jnp.int32).max)
    return plan, _pad(q, t_pad, e_pad), _pad(k, s_pad, e_pad), _pad(v, s_pad, e_pad), q_seg, kv_seg


def _pad(x, length, e_pad):
    if x.shape[1] == length and x.shape[3] == e_pad:
        return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, e_pad - x.shape[3])))


def flash_attention(q, k, v, *, causal: bool = True, segment_ids: SegmentIds = None,
                    sm_scale: float | None = None, return_lse: bool = False,
                    block_sizes: FlashAttentionBlockSizes | MosaicBlockSizes | None = None,
                    interpret: bool = False, backend: str = "auto"):
    """Fused attention. q [B, T, H, E], k/v [B, S, K, E] with H % K == 0 -> o [B, T, H, E].

    causal: bottom-right aligned (query i sees keys j <= i + S - T).
    segment_ids: [B, T] ints when T == S, or a pair (q_ids [B, T], kv_ids [B, S]).
    return_lse: also return lse [B, H, T] fp32 (natural log, -inf for a query that sees no key);
      it is differentiable, so blockwise results can be merged (ring attention) under jax.grad.
    block_sizes: tile sizes of the backend that runs (`FlashAttentionBlockSizes` for Triton,
      `MosaicBlockSizes` for Mosaic GPU); default: the backend's `for_head_dim(E)`.
    interpret: run the Pallas kernels in interpret mode (CPU tests; Triton kernels).
    backend: "mosaic" (Hopper: TMA, wgmma, warp-specialized), "triton", or "auto": Mosaic where it
      can run (Hopper, head dim 64 or 128, bf16/fp16), Triton elsewhere.
    """
    plan, q_p, k_p, v_p, q_seg, kv_seg = _plan(q, k, v, segment_ids, causal, sm_scale, block_sizes, interpret,
                                               backend)
    t, e = q.shape[1], q.shape[3]  # after _plan, which checks the ranks
    o, lse = _flash(q_p, k_p, v_p, q_seg, kv_seg, plan)
    o = o[:, :t, :, :e]
    if return_lse:
        return o, lse[:, :, :t]
    return o


def flash_attention_backward(q, k, v, o, lse, do, *, causal: bool = True, segment_ids: SegmentIds = None,
                             sm_scale: float | None = None,
                             block_sizes: FlashAttentionBlockSizes | MosaicBlockSizes | None = None,
                             interpret: bool = False, backend: str = "auto"):
    """(dq, dk, dv) of one key block's share of attention whose rows are normalized elsewhere.

    o [B, T, H, E] and lse [B, H, T] are the rows' outputs over *all* their keys (e.g. merged over
    the blocks of a ring), do the cotangent of o. With p = exp(s - lse) the rows' true probabilities,
    ds = p * (dp - rowsum(do * o)) restricted to this block's keys is this block's exact share of the
    gradient, so a blockwise backward never rebuilds a row's softmax. With o and lse from this block
    alone it is the ordinary flash-attention backward.
    """
    plan, q_p, k_p, v_p, q_seg, kv_seg = _plan(q, k, v, segment_ids, causal, sm_scale, block_sizes, interpret,
                                               backend)
    t, e, s = q.shape[1], q.shape[3], k.shape[1]
    e_pad = q_p.shape[3]
    o_p, do_p = _pad(o.astype(q.dtype), plan.t_pad, e_pad), _pad(do.astype(q.dtype), plan.t_pad, e_pad)
    # Padded query rows: lse = -inf, which the kernels read as "sees no key" (p = 0).
    lse_p = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, plan.t_pad - t)), constant_values=-jnp.inf)
    dlse = jnp.zeros_like(lse_p)
    dq, dk, dv = _backward(q_p, k_p, v_p, q_seg, kv_seg, o_p, lse_p, do_p, dlse, plan)
    return dq[:, :t, :, :e], dk[:, :s, :, :e], dv[:, :s, :, :e]
