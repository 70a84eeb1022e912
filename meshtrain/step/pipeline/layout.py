"""Where a stage's layers come from: the stored contiguous shard of the stack, exchanged into the chunks
the schedule gives the stage, and its gradients exchanged back.

The stack [L, ...] is stored sharded over pp in contiguous blocks (stage s holds blocks s·v .. s·v+v-1
of the p·v chunks of k layers), so the saved tree is the same for every pp and schedule. With one chunk
per stage (v = 1) that shard is the stage's chunk. With interleaved or dualpipe_v a stage runs v chunks
spread over the model (`stage_order`): p = 2, v = 2, interleaved:

    stored      stage 0: blocks 0 1      stage 1: blocks 2 3
    stage order stage 0: chunks 0 2      stage 1: chunks 1 3     (block 1 goes up, block 2 comes down)

`exchange` moves only the blocks that change stage, each once, by partial permutes over pp (one per
destination position and stage distance that carries a block): inside the pp-manual region, where the
whole-array permutation of the global stack would lower to an all-gather of every stage's shard to
every stage (2x H100, llama1b pp=2 v=2: about 11 ms of all-gather a step and device).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain.step.pipeline.schedules import virtual_stage


def stage_order(kind: str, p: int, v: int) -> np.ndarray:
    """order[i] = the virtual stage (model chunk) at block i of the stage layout, where stage s
    holds blocks s·v .. s·v+v-1, its chunks 0..v-1 (schedules.virtual_stage)."""
    return np.array([virtual_stage(kind, p, s, c) for s in range(p) for c in range(v)])


def split_blocks(tree: Any, v: int) -> list[Any]:
    """A stage's [v·rows, ...] leaves as v trees of [rows, ...] leaves, one per block."""
    return [jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:])[i], tree) for i in range(v)]


def join_blocks(blocks: list[Any]) -> Any:
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *blocks)


def exchange(blocks: list[Any], source: np.ndarray, p: int) -> list[Any]:
    """Inside the pp-manual region: this stage's v blocks (trees of like leaves) -> the v blocks it holds
    next, where position i of stage s becomes block source[s·v+i] of the layout the blocks are in now
    (block b at stage b // v, position b % v). A block that stays on its stage is not sent."""
    v = len(blocks)
    if np.array_equal(source, np.arange(p * v)):
        return blocks
    stage = lax.axis_index("pp")
    src_stage, src_pos = (source // v).reshape(p, v), (source % v).reshape(p, v)
    out = []
    for i in range(v):
        got = None
        for d in range(p):  # from the stage d above (mod p)
            receivers = [s for s in range(p) if src_stage[s, i] == (s + d) % p]
            if not receivers:
                continue
            sent_from = np.zeros(p, np.int32)  # per sender: the position of the block it sends
            for s in receivers:
                sent_from[(s + d) % p] = src_pos[s, i]
            block = _select(blocks, jnp.asarray(sent_from)[stage])
            if d:  # a permute leaves zeros where nothing arrives
                block = lax.ppermute(block, "pp", [((s + d) % p, s) for s in receivers])
            else:  # kept on its stage: zeros on the stages that receive their block i from elsewhere
                keeps = jnp.asarray(np.isin(np.arange(p), receivers))[stage]
                block = jax.tree.map(lambda a: jnp.where(keeps, a, jnp.zeros_like(a)), block)
            # Exactly one term of the sum is not zero on each stage.
            got = block if got is None else jax.tree.map(jnp.add, got, block)
        out.append(got)
    return out


def _select(blocks: list[Any], i: jax.Array) -> Any:
    """blocks[i] for a traced i (a stage-dependent position)."""
    if len(blocks) == 1:
        return blocks[0]
    return jax.tree.map(lambda *a: lax.select_n(i, *a), *blocks)
