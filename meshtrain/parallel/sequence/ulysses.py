"""Ulysses sequence parallelism over `sp`: an all-to-all swaps a sequence shard for a head shard.

Outside attention every sp rank holds T/sp tokens of every head; attention needs whole rows, so
around it one all-to-all trades tokens for heads and a second one trades back (sp = 2, heads h0..h3):

    rank 0: tokens [0, T/2)  heads h0 h1 h2 h3  ──all-to-all──>  rank 0: tokens [0, T)  heads h0 h1
    rank 1: tokens [T/2, T)  heads h0 h1 h2 h3                   rank 1: tokens [0, T)  heads h2 h3
                                        (attention runs here, per head, on whole sequences)
    rank 0: tokens [0, T)    o of h0 h1         ──all-to-all──>  rank 0: tokens [0, T/2)  o of h0..h3

Each all-to-all moves (sp-1)/sp of the local activation; nothing is replicated. With tp the heads
are split over tp first and each tp shard's heads over sp (`groups` = tp when the head axis is still
sharded over tp by the compiler, so the split never straddles a tp shard). Runs inside a shard_map
that is manual over sp (sequence/context.py); positions and segment ids are all-gathered instead.
When there are fewer kv heads than tp*sp they are repeated first so that every rank holds the one
its query heads read (the Megatron rule for tp, extended to sp).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def seq_to_heads(x_bthe: jax.Array, axis: str, size: int, groups: int) -> jax.Array:
    """[B, T/sp, G*sp*h, E] -> [B, T, G*h, E]: keeps head block (g, this rank) of every group g."""
    b, t, heads, e = x_bthe.shape
    x_btgshe = x_bthe.reshape(b, t, groups, size, heads // (groups * size), e)
    x_btgshe = jax.lax.all_to_all(x_btgshe, axis, split_axis=3, concat_axis=1, tiled=True)
    return x_btgshe.reshape(b, t * size, heads // size, e)


def heads_to_seq(x_bthe: jax.Array, axis: str, size: int, groups: int) -> jax.Array:
    """The inverse: [B, T, G*h, E] -> [B, T/sp, G*sp*h, E]."""
    b, t, heads, e = x_bthe.shape
    x_btgshe = x_bthe.reshape(b, t, groups, 1, heads // groups, e)
    x_btgshe = jax.lax.all_to_all(x_btgshe, axis, split_axis=1, concat_axis=3, tiled=True)
    return x_btgshe.reshape(b, t // size, heads * size, e)


def kv_for_heads(k_bske: jax.Array, ways: int) -> jax.Array:
    """Repeat kv heads so that `ways` (= tp*sp) consecutive head shards each get the kv heads their
    query heads read: unchanged when K % ways == 0, else K -> ways heads (needs ways % K == 0)."""
    kv = k_bske.shape[2]
    if kv % ways == 0:
        return k_bske
    return jnp.repeat(k_bske, ways // kv, axis=2)


def gather_tokens(x_bt: jax.Array, axis: str) -> jax.Array:
    """Positions or segment ids [B, T/sp] -> [B, T] (small int arrays: gathering beats swapping)."""
    return jax.lax.all_gather(x_bt, axis, axis=1, tiled=True)
