"""One (query block, key block) pair of attention: the unit that ring attention schedules.

    forward   q [B,T,H,E], k/v [B,S,K,E]  ->  (o [B,T,H,E] fp32 normalized over this block's keys,
                                               lse [B,H,T] fp32, -inf for a row that sees none)
    backward  q, k, v, the rows' (o, lse) over ALL their keys, do  ->  this block's (dq, dk, dv) fp32

Partials from several key blocks merge by log-sum-exp (`merge`). The backward takes the merged
(o, lse), so p = exp(s - lse) is already a row's true probability and ds = p * (dp - rowsum(do * o))
on this block's keys is its exact share of the gradient: no row softmax is ever rebuilt.

Masking: a query sees a key when they share a segment and the key's position is not later. The jnp
block (`reference`) reads that from positions and segment ids, so it works in any sequence order;
the Pallas kernels (`pallas`) read causality from the index (`causal=True` for a diagonal block,
False for a block wholly in the query's past) and take segment ids only when documents are masked.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

import pallas_kernels as pk

IMPLEMENTATIONS = ("reference", "pallas")


@dataclass(frozen=True)
class BlockAttention:
    impl: str  # "reference" (jnp, fp32 scores) or "pallas" (flash kernels)
    document_mask: bool  # pallas only: pass segment ids (the jnp block always masks by segment)
    interpret: bool = False  # pallas interpret mode (CPU)
    backend: str = "auto"  # pallas only: the flash kernels' backend (model.attention_kernel)

    def __post_init__(self):
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"block attention {self.impl!r}: must be one of {', '.join(IMPLEMENTATIONS)}")

    def forward(self, q_bthe, k_bske, v_bske, q_pos_bt, q_seg_bt, kv_pos_bs, kv_seg_bs, *, causal: bool):
        if self.impl == "pallas":
            seg = (q_seg_bt, kv_seg_bs) if self.document_mask else None
            o_bthe, lse_bht = pk.flash_attention(q_bthe, k_bske, v_bske, causal=causal, segment_ids=seg,
                                                 return_lse=True, interpret=self.interpret, backend=self.backend)
            return o_bthe.astype(jnp.float32), lse_bht
        visible_bts = _visible(q_pos_bt, q_seg_bt, kv_pos_bs, kv_seg_bs)
        return _jnp_forward(q_bthe, k_bske, v_bske, visible_bts)

    def backward(self, q_bthe, k_bske, v_bske, q_pos_bt, q_seg_bt, kv_pos_bs, kv_seg_bs, o_bthe, lse_bht, do_bthe,
                 *, causal: bool):
        if self.impl == "pallas":
            seg = (q_seg_bt, kv_seg_bs) if self.document_mask else None
            grads = pk.flash_attention_backward(q_bthe, k_bske, v_bske, o_bthe, lse_bht, do_bthe, causal=causal,
                                                segment_ids=seg, interpret=self.interpret, backend=self.backend)
            return tuple(g.astype(jnp.float32) for g in grads)
        visible_bts = _visible(q_pos_bt, q_seg_bt, kv_pos_bs, kv_seg_bs)
        return _jnp_backward(q_bthe, k_bske, v_bske, visible_bts, o_bthe, lse_bht, do_bthe)


def merge(o_bthe, lse_bht, o_new_bthe, lse_new_bht):
    """Combine two partials of the same rows over disjoint key sets. `lse_bht` must be finite (the
    diagonal block comes first: every query sees itself); `lse_new_bht` may be -inf (saw nothing)."""
    lse_out_bht = jnp.logaddexp(lse_bht, lse_new_bht)
    w_old_bth1 = jnp.exp(lse_bht - lse_out_bht).transpose(0, 2, 1)[..., None]
    w_new_bth1 = jnp.exp(lse_new_bht - lse_out_bht).transpose(0, 2, 1)[..., None]
    return o_bthe * w_old_bth1 + o_new_bthe * w_new_bth1, lse_out_bht


def _visible(q_pos_bt, q_seg_bt, kv_pos_bs, kv_seg_bs):
    same_bts = q_seg_bt[:, :, None] == kv_seg_bs[:, None, :]
    return same_bts & (kv_pos_bs[:, None, :] <= q_pos_bt[:, :, None])


def _scores(q_bthe, k_bske):
    """fp32 scores [B, H, T, S] with kv heads repeated to query heads (head h reads kv h // (H/K))."""
    h, e = q_bthe.shape[2], q_bthe.shape[3]
    k_bshe = jnp.repeat(k_bske, h // k_bske.shape[2], axis=2)
    return jnp.einsum("bthe,bshe->bhts", q_bthe, k_bshe, precision=_precision(q_bthe),
                      preferred_element_type=jnp.float32) * (e ** -0.5)


def _precision(x):
    # fp32 inputs get full-precision products (no TF32), matching the dense layers' policy.
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def _jnp_forward(q_bthe, k_bske, v_bske, visible_bts):
    """Same numbers as model.attention.masked_attention; differentiable (the allgather path and
    Ulysses without cp take its autodiff), NaN-free for rows that see nothing."""
    h = q_bthe.shape[2]
    visible_bhts = visible_bts[:, None]
    scores_bhts = jnp.where(visible_bhts, _scores(q_bthe, k_bske), jnp.finfo(jnp.float32).min)
    row_max_bht = jax.lax.stop_gradient(jnp.max(scores_bhts, axis=-1))
    exp_bhts = jnp.where(visible_bhts, jnp.exp(scores_bhts - row_max_bht[..., None]), 0.0)
    denom_bht = jnp.sum(exp_bhts, axis=-1)
    any_bht = denom_bht > 0
    safe_bht = jnp.where(any_bht, denom_bht, 1.0)
    probs_bhts = exp_bhts / safe_bht[..., None]
    lse_bht = jnp.where(any_bht, row_max_bht + jnp.log(safe_bht), -jnp.inf)
    v_bshe = jnp.repeat(v_bske, h // v_bske.shape[2], axis=2)
    o_bthe = jnp.einsum("bhts,bshe->bthe", probs_bhts.astype(v_bske.dtype), v_bshe, precision=_precision(v_bske),
                        preferred_element_type=jnp.float32)
    return o_bthe, lse_bht


def _jnp_backward(q_bthe, k_bske, v_bske, visible_bts, o_bthe, lse_bht, do_bthe):
    b, s, kv, e = k_bske.shape
    h = q_bthe.shape[2]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    hi = jax.lax.Precision.HIGHEST
    # Rows that see no key anywhere have lse = -inf; the mask keeps their p at 0 (not exp(+inf)).
    p_bhts = jnp.where(visible_bts[:, None], jnp.exp(_scores(q_bthe, k_bske) - lse_bht[..., None]), 0.0)
    do_bthe = f32(do_bthe)
    delta_bht = jnp.einsum("bthe,bthe->bht", do_bthe, f32(o_bthe), precision=hi)
    v_bshe = f32(jnp.repeat(v_bske, h // kv, axis=2))
    dv_bshe = jnp.einsum("bhts,bthe->bshe", p_bhts, do_bthe, precision=hi)
    dp_bhts = jnp.einsum("bthe,bshe->bhts", do_bthe, v_bshe, precision=hi)
    ds_bhts = p_bhts * (dp_bhts - delta_bht[..., None]) * (e ** -0.5)
    dq_bthe = jnp.einsum("bhts,bshe->bthe", ds_bhts, f32(jnp.repeat(k_bske, h // kv, axis=2)), precision=hi)
    dk_bshe = jnp.einsum("bhts,bthe->bshe", ds_bhts, f32(q_bthe), precision=hi)
    # Sum each kv head's query group (the transpose of the repeat).
    group = lambda x_bshe: x_bshe.reshape(b, s, kv, h // kv, e).sum(axis=3)  # noqa: E731
    return dq_bthe, group(dk_bshe), group(dv_bshe)
