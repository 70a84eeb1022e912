"""Linear + softmax cross-entropy per token without materializing the [N, V] logits.

For any cotangent of the per-token losses. A summed training loss has one scalar cotangent and takes
cross_entropy_sum.py instead (`model.loss=fused`): token chunks, no logits recomputed.

Blocked over the vocabulary with XLA matmuls (cuBLAS) in a `lax.fori_loop`; no Pallas call:
the work is three-quarters matmul, where cuBLAS beats a Triton-lowered Pallas matmul, and the
only thing a kernel must add is never holding [N, V] at once, which the blocking already gives.

  forward   for each vocab chunk c:  z = h @ w[:, c] (fp32, [N, vc]); online (max, sum exp) per
            token; the label's logit is picked up in the chunk that holds it.  loss = lse - z_label.
  backward  for each chunk: recompute z; g = dloss (0 for ignored tokens);
            dz = (softmax(z) - onehot) * g in h.dtype; dh += dz @ w[:, c]^T (fp32 accumulator
            [N, D]); dw[:, c] = h^T @ dz (each chunk of dw is complete after one matmul).
Peak extra memory ~ a few [N, vc] fp32 tiles + the [N, D] fp32 dh accumulator; the plain version
holds [N, V] fp32 logits and their gradient. FLOPs: 4 matmuls of 2*N*D*V (the forward's logits
are recomputed in the backward) against the plain version's 3.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import check_float_dtype


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyBlockSizes:
    """vocab_chunk: columns of w per step (a divisor of V near it is preferred, else a tail step)."""
    vocab_chunk: int = 4096

    def __post_init__(self):
        if not isinstance(self.vocab_chunk, int) or self.vocab_chunk < 1:
            raise ValueError(f"LinearCrossEntropyBlockSizes.vocab_chunk must be a positive int; "
                             f"got {self.vocab_chunk!r}")


def linear_cross_entropy_reference(h, w, labels, *, ignore_index: int = -100):
    """Materializes fp32 logits [N, V]; per-token loss fp32, 0 where labels == ignore_index."""
    logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    valid = labels != ignore_index
    picked = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(valid, lse - picked, 0.0)


def _pick_chunk(v: int, want: int) -> int:
    """Largest chunk <= want that divides V and is a multiple of 128 (or V itself if V <= want)."""
    if v <= want:
        return v
    for c in range(want - want % 128, 127, -128):
        if v % c == 0:
            return c
    return want


@dataclasses.dataclass(frozen=True)
class _Plan:
    chunk: int
    ignore_index: int


def _chunks(v: int, chunk: int):
    """(number of full chunks, tail width) of the vocab walk."""
    return v // chunk, v % chunk


def _logits(h, w, c0, width):
    w_c = lax.dynamic_slice_in_dim(w, c0, width, axis=1)
    return jnp.dot(h, w_c, preferred_element_type=jnp.float32), w_c


def _forward(h, w, labels, plan: _Plan):
    n = h.shape[0]
    v = w.shape[1]

    def step(c0, width, carry):
        m, l, picked = carry
        z, _ = _logits(h, w, c0, width)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        idx = labels - c0
        inside = (idx >= 0) & (idx < width)
        z_lab = jnp.take_along_axis(z, jnp.clip(idx, 0, width - 1)[:, None], axis=1)[:, 0]
        return m_new, l, picked + jnp.where(inside, z_lab, 0.0)

    n_full, tail = _chunks(v, plan.chunk)
    carry = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
             jnp.zeros((n,), jnp.float32))
    carry = lax.fori_loop(0, n_full, lambda i, c: step(i * plan.chunk, plan.chunk, c), carry)
    if tail:
        carry = step(n_full * plan.chunk, tail, carry)
    m, l, picked = carry
    lse = m + jnp.log(l)
    valid = labels != plan.ignore_index
    return jnp.where(valid, lse - picked, 0.0), lse


def _backward(h, w, labels, lse, g, plan: _Plan):
    def step(c0, width, carry):
        dh, dw = carry
        z, w_c = _logits(h, w, c0, width)
        p = jnp.exp(z - lse[:, None]) * g[:, None]
        cols = c0 + lax.broadcasted_iota(jnp.int32, z.shape, 1)
        dz = jnp.where(cols == labels[:, None], p - g[:, None], p).astype(h.dtype)
        dh = dh + lax.dot_general(dz, w_c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dw_c = lax.dot_general(h, dz, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw.dtype), c0, axis=1)

    n_full, tail = _chunks(w.shape[1], plan.chunk)
    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    carry = lax.fori_loop(0, n_full, lambda i, c: step(i * plan.chunk, plan.chunk, c), carry)
    if tail:
        carry = step(n_full * plan.chunk, tail, carry)
    return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lce(h, w, labels, plan):
    return _forward(h, w, labels, plan)[0]


def _lce_fwd(h, w, labels, plan):
    loss, lse = _forward(h, w, labels, plan)
    return loss, (h, w, labels, lse)


def _lce_bwd(plan, res, dloss):
    h, w, labels, lse = res
    g = jnp.where(labels != plan.ignore_index, dloss.astype(jnp.float32), 0.0)
    dh, dw = _backward(h, w, labels, lse, g, plan)
    return dh.astype(h.dtype), dw, None


_lce.defvjp(_lce_fwd, _lce_bwd)


def check_head_args(h, w, labels) -> None:
    """Raise ValueError unless h [N, D] and w [D, V] are floats with matching D and labels [N] are integers."""
    check_float_dtype("h", h)
    check_float_dtype("w", w)
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[0]:
        raise ValueError(f"need h [N, D] and w [D, V] with matching D; got h.shape={h.shape}, w.shape={w.shape}")
    if labels.shape != (h.shape[0],):
        raise ValueError(f"labels must have shape (N,) = ({h.shape[0]},); got {labels.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integers; got {labels.dtype}")


def linear_cross_entropy(h, w, labels, *, ignore_index: int = -100,
                         block_sizes: LinearCrossEntropyBlockSizes | None = None, interpret: bool = False):
    """Per-token loss [N] fp32 of softmax(h @ w) against labels; 0 where labels == ignore_index.

    h [N, D], w [D, V], labels [N] ints in [0, V) or ignore_index (other values are not
    checked: a label outside [0, V) simply never matches, giving loss = lse). Differentiable in
    h and w. `interpret` is accepted for a uniform kernel API; this op makes no Pallas call.
    """
    del interpret
    check_head_args(h, w, labels)
    bs = block_sizes or LinearCrossEntropyBlockSizes()
    if not isinstance(bs, LinearCrossEntropyBlockSizes):
        raise ValueError(f"block_sizes must be a LinearCrossEntropyBlockSizes; got {type(bs).__name__}")
    plan = _Plan(chunk=_pick_chunk(w.shape[1], bs.vocab_chunk), ignore_index=int(ignore_index))
    return _lce(h, w, labels.astype(jnp.int32), plan)
