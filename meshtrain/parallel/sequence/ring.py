"""Context-parallel attention over `cp`: ring (K/V blocks travel) or all-gather (Llama 3 style).

Runs inside a shard_map that is manual over cp (parallel/sequence/context.py builds it). Each of n = cp ranks
holds T/n tokens as two chunks of c = T/2n (sequence/zigzag.py): zig-zag rank r holds chunks r and
2n-1-r, contiguous rank r chunks 2r and 2r+1. Its K/V (with positions and segment ids) go round
the ring, one hop to rank r+1 per step; the transfer for step j+1 is issued before step j's block is
computed, so it can hide behind it. n = 4, forward, zig-zag (q chunks | kv chunks of the source):

    step 0   own kv:       diagonal, causal             send own kv ───────────> r+1
    step j   kv of r-j:    source s = (r-j) mod n       send what arrived ─────> r+1  (not after the last)
               s < r:  all q    x  first kv chunk (chunk s; its other chunk 2n-1-s lies in every query's future)
               s > r:  2nd q    x  both kv chunks (chunk r is in the past of neither; chunk 2n-1-r sees both)

Every step after the first is two c x c blocks on every rank (balanced); fully masked pairs are never
computed. Contiguous (the unbalanced baseline): s < r is a full 2c x 2c block, s > r is discarded;
rank n-1 sees every block, so the others computing theirs costs no wall time.
Partials merge by log-sum-exp. Backward (custom_vjp) runs the ring again with the saved rows'
(o, lse): K/V travel as before and their dK/dV accumulators travel with them, one hop behind, so
after n hops every dK/dV is home. Nothing but the local q, k, v, o, lse is saved: no device holds the
sequence's K/V or scores. (Autodiff through the ppermutes would save every visiting K/V block.)

`allgather`: all-gather K/V over cp once, then the same steps read the source's slice; plain autodiff
(the all-gather transposes to a reduce-scatter of dK/dV). Holds all K/V, so it pays off when kv heads
are few (GQA) and the one big collective beats n-1 small ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from meshtrain.parallel.sequence.block import BlockAttention, merge

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Ring:
    """Static description of the ring (hashable: a custom_vjp non-differentiable argument)."""

    axis: str
    size: int
    layout: str
    block: BlockAttention
    # How a block hops: a collective permute, or (two ranks only) a swap written as an all-to-all within the
    # cp group. Inside a pipeline stage each stage runs its own branch of a switch, and a permute's pairs span
    # every stage's cp group, so it would wait for devices of other stages; an all-to-all's replica groups
    # stay within the stage (step/pipeline/executor.py).
    hop: str = "permute"


def ring_attention(q_bthe, k_bske, v_bske, pos_bt, seg_bt, ring: Ring):
    """Local shards in, local o [B, T/n, H, E] (q's dtype) out; K/V pass round the ring."""
    return _ring(q_bthe, k_bske, v_bske, pos_bt, seg_bt, ring)


def allgather_attention(q_bthe, k_bske, v_bske, pos_bt, seg_bt, ring: Ring):
    """Local shards in, local o out; K/V (and their positions, segments) all-gathered over cp."""
    gathered = jax.lax.all_gather((k_bske, v_bske, pos_bt, seg_bt), ring.axis, axis=1, tiled=True)
    r, t = jax.lax.axis_index(ring.axis), q_bthe.shape[1]
    own = (k_bske, v_bske, pos_bt, seg_bt)
    o, lse = ring.block.forward(q_bthe, *own[:2], pos_bt, seg_bt, *own[2:], causal=True)
    for j in range(1, ring.size):
        src = (r - j) % ring.size
        kv = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, src * t, t, axis=1), gathered)
        o, lse = _step_forward(ring, q_bthe, pos_bt, seg_bt, kv, r, src, o, lse)
    return o.astype(q_bthe.dtype)


# ------------------------------------------------------------------------------- one ring step


def _send(ring: Ring, x):
    """Pass x one hop round the ring: rank i -> i+1."""
    if ring.hop == "swap":
        return jax.tree.map(lambda a: _swap(a, ring.axis), x)
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return jax.lax.ppermute(x, ring.axis, perm)


def _swap(a, axis: str):
    """Two ranks exchange a: an all-to-all whose piece j goes to rank j (the piece a rank sends itself is a
    local copy), then each keeps the other's."""
    got = jax.lax.all_to_all(jnp.stack([a, a]), axis, 0, 0, tiled=False)  # got[j]: rank j's a
    return jax.lax.dynamic_index_in_dim(got, 1 - jax.lax.axis_index(axis), 0, keepdims=False)


def _after(kv, done):
    """K/V as usable only once `done` (the previous step's result) exists. Without this tie the
    compiler may issue every hop at once (the CPU scheduler does), holding all n blocks; with it, one
    hop is in flight beside the block being computed. Positions and segment ids are left free: they
    do not change between layers, so the compiler hoists their hops out of the layer loop."""
    (k, v), done = jax.lax.optimization_barrier(((kv[0], kv[1]), done))
    return (k, v, kv[2], kv[3]), done


def _step_forward(ring: Ring, q, q_pos, q_seg, kv, r, src, o, lse):
    """Merge the block of source `src` (src != r) into (o, lse), computing only the visible pairs.

    Zig-zag: the pair (2nd q chunk, 1st kv chunk) is visible whichever side src is on; the other
    visible pair is (1st q, 1st kv) when src < r and (2nd q, 2nd kv) when src > r, picked by a
    dynamic offset rather than lax.cond: every device then runs the same instructions, so the
    compiler may place collectives (for the automatic axes) anywhere without devices disagreeing.
    """
    k, v, kv_pos, kv_seg = kv
    fwd = functools.partial(ring.block.forward, causal=False)
    if ring.layout == "contiguous":
        # Unbalanced by nature (rank n-1 sees every block), so computing and discarding the future
        # blocks costs no wall time: the step waits for rank n-1 either way.
        o_b, lse_b = fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
        return merge(o, lse, o_b, jnp.where(src < r, lse_b, -jnp.inf))
    c = q.shape[1] // 2
    o1, lse1 = merge(o[:, c:], lse[..., c:], *fwd(q[:, c:], k[:, :c], v[:, :c], q_pos[:, c:], q_seg[:, c:],
                                                   kv_pos[:, :c], kv_seg[:, :c]))
    o = jnp.concatenate([o[:, :c], o1], axis=1)
    lse = jnp.concatenate([lse[..., :c], lse1], axis=-1)
    at = jnp.where(src < r, 0, c)  # (1st, 1st) or (2nd, 2nd)
    q_a, q_pos_a, q_seg_a, o_a = _chunk(at, c, q, q_pos, q_seg, o)
    k_a, v_a, kv_pos_a, kv_seg_a = _chunk(at, c, k, v, kv_pos, kv_seg)
    (lse_a,) = _chunk(at, c, lse, axis=2)
    o2, lse2 = merge(o_a, lse_a, *fwd(q_a, k_a, v_a, q_pos_a, q_seg_a, kv_pos_a, kv_seg_a))
    return (jax.lax.dynamic_update_slice_in_dim(o, o2, at, axis=1),
            jax.lax.dynamic_update_slice_in_dim(lse, lse2, at, axis=2))


def _chunk(at, c, *xs, axis=1):
    """Chunk [at, at + c) of each array along `axis` (at is traced: 0 or c)."""
    return tuple(jax.lax.dynamic_slice_in_dim(x, at, c, axis=axis) for x in xs)


def _step_backward(ring: Ring, q, q_pos, q_seg, kv, o, lse, do, r, src, dq):
    """dq += this block's share; returns (dq, dk, dv) with dk/dv this block's share for the source."""
    k, v, kv_pos, kv_seg = kv
    bwd = functools.partial(ring.block.backward, causal=False)
    if ring.layout == "contiguous":
        dq_b, dk, dv = bwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, o, lse, do)
        past = src < r
        return dq + jnp.where(past, dq_b, 0.0), jnp.where(past, dk, 0.0), jnp.where(past, dv, 0.0)
    c = q.shape[1] // 2
    dq1, dk1, dv1 = bwd(q[:, c:], k[:, :c], v[:, :c], q_pos[:, c:], q_seg[:, c:], kv_pos[:, :c], kv_seg[:, :c],
                        o[:, c:], lse[..., c:], do[:, c:])
    at = jnp.where(src < r, 0, c)
    q_a, q_pos_a, q_seg_a, o_a, do_a = _chunk(at, c, q, q_pos, q_seg, o, do)
    k_a, v_a, kv_pos_a, kv_seg_a = _chunk(at, c, k, v, kv_pos, kv_seg)
    (lse_a,) = _chunk(at, c, lse, axis=2)
    dq2, dk2, dv2 = bwd(q_a, k_a, v_a, q_pos_a, q_seg_a, kv_pos_a, kv_seg_a, o_a, lse_a, do_a)
    dq = dq.at[:, c:].add(dq1)
    dq = jax.lax.dynamic_update_slice_in_dim(dq, _chunk(at, c, dq)[0] + dq2, at, axis=1)
    pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
    dk, dv = pad(dk1), pad(dv1)
    dk = jax.lax.dynamic_update_slice_in_dim(dk, _chunk(at, c, dk)[0] + dk2, at, axis=1)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, _chunk(at, c, dv)[0] + dv2, at, axis=1)
    return dq, dk, dv


# ---------------------------------------------------------------------------- ring with its vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, pos, seg, ring):
    return _ring_fwd(q, k, v, pos, seg, ring)[0]


def _ring_fwd(q, k, v, pos, seg, ring):
    r = jax.lax.axis_index(ring.axis)
    kv = (k, v, pos, seg)
    incoming = _send(ring, kv)  # issued first: in flight while the diagonal block computes
    o, lse = ring.block.forward(q, k, v, pos, seg, pos, seg, causal=True)
    for j in range(1, ring.size):
        kv, (o, lse) = _after(incoming, (o, lse))
        if j < ring.size - 1:
            incoming = _send(ring, kv)
        o, lse = _step_forward(ring, q, pos, seg, kv, r, (r - j) % ring.size, o, lse)
    o = o.astype(q.dtype)
    return o, (q, k, v, pos, seg, o, lse)


def _ring_bwd(ring, res, do):
    q, k, v, pos, seg, o, lse = res
    r = jax.lax.axis_index(ring.axis)
    kv = (k, v, pos, seg)
    incoming = _send(ring, kv)
    dq, dk, dv = ring.block.backward(q, k, v, pos, seg, pos, seg, o, lse, do, causal=True)
    # dK/dV of a block travel with it, one hop behind: sent after this step's share is added, awaited
    # only at the end of the next step, so the transfer overlaps that step's compute.
    travelling = _send(ring, (dk, dv))
    for j in range(1, ring.size):
        kv, dq = _after(incoming, dq)
        if j < ring.size - 1:
            incoming = _send(ring, kv)
        dq, dk_b, dv_b = _step_backward(ring, q, pos, seg, kv, o, lse, do, r, (r - j) % ring.size, dq)
        travelling = _send(ring, (travelling[0] + dk_b, travelling[1] + dv_b))
    dk, dv = travelling  # n hops: back at the block's home rank
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
