"""A training loss's linear + softmax cross-entropy, summed over tokens, its gradient made in the forward.

The loss of a train step is a sum over tokens, so its cotangent is one scalar g: the gradient can be made
while each chunk's logits are at hand, kept, and scaled by g in the backward. Walking tokens (not vocabulary
columns, as linear_cross_entropy does) gives every chunk its whole logsumexp at once, so nothing is recomputed:

  for each chunk of Nc tokens (a scan):
      z = h_c @ w                     fp32 [Nc, V]: the largest thing alive, at most TILE_BYTES
      loss += sum(lse(z) - z_label)   over labelled tokens
      dz = softmax(z) - onehot        h.dtype, 0 on ignored tokens
      dh_c = dz @ w^T                 fp32 [Nc, D], a scan output
      dw  += h_c^T @ dz               fp32 [D, V], the scan's carry
  backward:  dh = g * dh,  dw = g * dw

Three GEMMs of 2*N*D*V, as the plain head has (linear_cross_entropy's vocab walk recomputes the logits: four).
Memory beyond the inputs: one logits tile and its dz, the [D, V] fp32 dw and the [N, D] fp32 dh, where the plain
version holds [N, V] fp32 logits, their exponentials and their gradient (Llama-3-8B at 5 sequences of 4096 a GPU on
two H200s: the step's peak 8.8 GiB lower, its time unchanged). Without differentiation (evaluation) only the first
two lines of the loop run.
No Pallas call: the work is GEMMs, which cuBLAS does best, and one fused elementwise pass per chunk.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.cross_entropy import check_head_args

TILE_BYTES = 2 << 30  # fp32 logits of one token chunk: Llama-3-8B's vocabulary, 4096 tokens a chunk


@dataclasses.dataclass(frozen=True)
class _Plan:
    token_chunk: int
    vocab_size: int  # columns at or past it are padding: never a label, never in the logsumexp
    ignore_index: int
    h_dtype: str
    w_dtype: str


def token_chunk(n_tokens: int, vocab: int, tile_bytes: int = TILE_BYTES) -> int:
    """Tokens a chunk: as many as keep its fp32 logits within tile_bytes, a multiple of 128, all of them if fewer."""
    rows = max(128, tile_bytes // (4 * vocab) // 128 * 128)
    return min(n_tokens, rows)


def _chunk_loss(h_c, w, labels_c, plan: _Plan):
    """fp32 logits [Nc, V], the labels' one-hot mask, the labelled rows' mask, the row logsumexps and the loss sum."""
    z = jnp.dot(h_c, w, preferred_element_type=jnp.float32)
    cols = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if plan.vocab_size < w.shape[1]:
        z = jnp.where(cols < plan.vocab_size, z, -jnp.inf)
    lse = jax.nn.logsumexp(z, axis=1)
    is_label = cols == labels_c[:, None]
    valid = labels_c != plan.ignore_index
    # A masked sum, not a gather: the label's logit is read in the same pass as the logsumexp.
    z_label = jnp.sum(jnp.where(is_label, z, 0.0), axis=1)
    return z, is_label, valid, lse, jnp.sum(jnp.where(valid, lse - z_label, 0.0))


def _chunked(h, labels, plan: _Plan):
    """h [N, D] and labels [N] as [k, Nc, ...] chunks; padded rows are ignored tokens."""
    n, nc = h.shape[0], plan.token_chunk
    pad = -n % nc
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad), constant_values=plan.ignore_index)
    return h.reshape(-1, nc, h.shape[1]), labels.reshape(-1, nc)


def _loss(h, w, labels, plan: _Plan):
    def step(total, xs):
        return total + _chunk_loss(xs[0], w, xs[1], plan)[-1], None

    total, _ = lax.scan(step, jnp.zeros((), jnp.float32), _chunked(h, labels, plan))
    return total


def _loss_and_grads(h, w, labels, plan: _Plan):
    def step(dw, xs):
        h_c, labels_c = xs
        z, is_label, valid, lse, loss = _chunk_loss(h_c, w, labels_c, plan)
        p = jnp.exp(z - lse[:, None])
        dz = jnp.where(valid[:, None], jnp.where(is_label, p - 1.0, p), 0.0).astype(h_c.dtype)
        dh_c = lax.dot_general(dz, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dw = dw + lax.dot_general(h_c, dz, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dw, (loss, dh_c)

    dw, (loss_k, dh_knd) = lax.scan(step, jnp.zeros(w.shape, jnp.float32), _chunked(h, labels, plan))
    return jnp.sum(loss_k), dh_knd.reshape(-1, h.shape[1])[:h.shape[0]], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lce_sum(h, w, labels, plan):
    return _loss(h, w.astype(h.dtype), labels, plan)


def _lce_sum_fwd(h, w, labels, plan):
    loss, dh, dw = _loss_and_grads(h, w.astype(h.dtype), labels, plan)
    return loss, (dh, dw)


def _lce_sum_bwd(plan, res, g):
    dh, dw = res
    return (g * dh).astype(plan.h_dtype), (g * dw).astype(plan.w_dtype), None


_lce_sum.defvjp(_lce_sum_fwd, _lce_sum_bwd)


def linear_cross_entropy_sum(h, w, labels, *, vocab_size: int | None = None, ignore_index: int = -100,
                             tokens_per_chunk: int | None = None):
    """sum over labelled tokens of -log softmax(h @ w)[label], fp32 scalar; differentiable in h and w.

    h [N, D], w [D, V] (cast to h's dtype for the GEMMs; its gradient comes back in w's dtype), labels [N] ints
    in [0, vocab_size) or ignore_index. Columns of w at or past vocab_size (padding to shard the vocabulary) take
    no part. tokens_per_chunk: tokens a chunk (default: token_chunk's choice).
    """
    check_head_args(h, w, labels)
    v = w.shape[1] if vocab_size is None else vocab_size
    if not 0 < v <= w.shape[1]:
        raise ValueError(f"vocab_size must be in [1, {w.shape[1]}] (w's columns); got {vocab_size}")
    nc = token_chunk(h.shape[0], w.shape[1]) if tokens_per_chunk is None else tokens_per_chunk
    if not isinstance(nc, int) or nc < 1:
        raise ValueError(f"tokens_per_chunk must be a positive int; got {tokens_per_chunk!r}")
    plan = _Plan(token_chunk=min(nc, h.shape[0]), vocab_size=int(v), ignore_index=int(ignore_index),
                 h_dtype=jnp.dtype(h.dtype).name, w_dtype=jnp.dtype(w.dtype).name)
    return _lce_sum(h, w, labels.astype(jnp.int32), plan)
