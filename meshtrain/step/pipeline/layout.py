"""Where the layer stack sits: the train state keeps it in the order the pipeline's stages run it.

The stack [L, ...] (MoE groups: [L/every, ...]) is cut into p·v blocks of layers and sharded over pp in
contiguous runs: stage s holds stored blocks s·v .. s·v+v-1, its chunks 0..v-1. Which model block sits at
each stored position is the run's *order* (`stored_order`). Without the pipeline, and with one chunk per stage,
it is the model's. Interleaved and dualpipe_v give a stage v chunks spread over the model (`stage_order`,
schedules.virtual_stage), and the state keeps the stack in that order, so each stage holds its chunks and
nothing moves during a step. p = 2, v = 2, interleaved:

    the model's order   blocks 0 1 2 3
    stored              stage 0: blocks 0 2      stage 1: blocks 1 3

(Kept in the model's order instead, the blocks that change stage went there at every step's start and their
fp32 gradients came back at its end: on 2x H100, llama1b pp=2 v=2 m=8, 224.8 ms a step against 208.5 without.)

Everything stacked on the layers moves together: the parameters, the optimizer's moments, the fp8_delayed
histories. The optimizer treats the layers alike (elementwise; Adafactor's factored statistics average over
them, in any order) and the clipping norm is a sum, so the step never needs the model's order; what reads
the layers by depth does: the eval step (`reorder` inside its jit), and whoever reads a checkpoint, which
records the order it was written in (checkpoint.py) and is put into the reader's order on restore. `reorder`
moves only the blocks that change stage, each once, by partial permutes over pp (`exchange`): a permutation of
the global stack written as a gather lowers to an all-gather of every stage's shard to every stage.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.step.pipeline.schedules import virtual_stage

LAYERS = "layers"  # the key of the stacked subtree, in the params and in everything shaped like them
MODEL_ORDER = np.arange(1)  # the model's order, at any number of blocks (`permutation` refines it)


def stage_order(kind: str, p: int, v: int) -> np.ndarray:
    """order[i] = the virtual stage (model chunk) at block i of the stage layout, where stage s
    holds blocks s·v .. s·v+v-1, its chunks 0..v-1 (schedules.virtual_stage)."""
    return np.array([virtual_stage(kind, p, s, c) for s in range(p) for c in range(v)])


def stored_order(kind: str, p: int, v: int) -> np.ndarray:
    """The order a run keeps its layer stack in (module docstring): p·v blocks, the model's order unless
    the pipeline gives a stage chunks spread over the model."""
    return stage_order(kind, p, v) if p > 1 else MODEL_ORDER


def is_model_order(order: np.ndarray) -> bool:
    return bool(np.array_equal(order, np.arange(len(order))))


def split_blocks(tree: Any, v: int) -> list[Any]:
    """A stage's [v·rows, ...] leaves as v trees of [rows, ...] leaves, one per block."""
    return [jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:])[i], tree) for i in range(v)]


def join_blocks(blocks: list[Any]) -> Any:
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *blocks)


# --------------------------------------------------------------------------- moving the stack between orders


def _refined(order: np.ndarray, n: int) -> np.ndarray:
    """`order` over n blocks (a multiple of its own): each block cut into n / len(order) in sequence."""
    f = n // len(order)
    return (np.asarray(order)[:, None] * f + np.arange(f)).reshape(-1)


def permutation(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Over lcm(len(source), len(target)) blocks: position i of the `target` order takes block perm[i] of the
    `source` order (both: the model block at each stored position)."""
    n = math.lcm(len(source), len(target))
    return np.argsort(_refined(source, n))[_refined(target, n)]


def is_stacked(path: tuple, leaf: Any, rows: int) -> bool:
    """A leaf of the layer stack: under a `layers` key, `rows` leading rows (not an optimizer's placeholder)."""
    return (any(getattr(k, "key", None) == LAYERS for k in path) and getattr(leaf, "ndim", 0) >= 1
            and leaf.shape[0] == rows)


def reorder(tree: Any, source: np.ndarray, target: np.ndarray, rows: int, mesh: jax.sharding.Mesh | None) -> Any:
    """Inside a jit: every stacked leaf of `tree` (`rows` leading rows) from the `source` order to `target`.
    Over a mesh with pp > 1 the stacked leaves must be sharded over pp on their rows (the rules table does so):
    the blocks that change stage are sent there; elsewhere the rows are permuted in place."""
    perm = permutation(source, target)
    if is_model_order(perm):
        return tree
    n = len(perm)
    p = mesh.shape["pp"] if mesh is not None else 1

    def move(x):
        if p == 1:
            return x.reshape(n, rows // n, *x.shape[1:])[perm].reshape(x.shape)
        # The stage index comes in as data: lax.axis_index lowers to a partition id, which the partitioner refuses
        # where the other axes leave a leaf replicated (the fp8 histories under tp).
        moved = jax.shard_map(lambda a, stage: join_blocks(exchange(split_blocks(a, n // p), perm, p, stage[0])),
                              mesh=mesh, in_specs=(P("pp"), P("pp")), out_specs=P("pp"), axis_names={"pp"},
                              check_vma=False)
        return moved(x, jnp.arange(p, dtype=jnp.int32))

    return jax.tree_util.tree_map_with_path(lambda path, x: move(x) if is_stacked(path, x, rows) else x, tree)


def reorder_arrays(tree: Any, source: np.ndarray, target: np.ndarray, rows: int) -> Any:
    """`reorder` for arrays already on the devices (a restored checkpoint): leaf by leaf, each donated, so
    the move needs room for one leaf beside the state, not a second state."""
    if is_model_order(permutation(source, target)):
        return tree

    def move(path, x):
        if not is_stacked(path, x, rows):
            return x
        mesh = x.sharding.mesh if isinstance(x.sharding, jax.sharding.NamedSharding) else None
        pp = mesh if mesh is not None and mesh.shape.get("pp", 1) > 1 else None
        return jax.jit(lambda a: reorder({LAYERS: a}, source, target, rows, pp)[LAYERS], donate_argnums=0,
                       out_shardings=x.sharding)(x)

    return jax.tree_util.tree_map_with_path(move, tree)


def exchange(blocks: list[Any], source: np.ndarray, p: int, stage: jax.Array) -> list[Any]:
    """Inside the pp-manual region: this stage's v blocks (trees of like leaves) -> the v blocks it holds
    next, where position i of stage s becomes block source[s·v+i] of the layout the blocks are in now
    (block b at stage b // v, position b % v). A block that stays on its stage is not sent."""
    v = len(blocks)
    if np.array_equal(source, np.arange(p * v)):
        return blocks
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
