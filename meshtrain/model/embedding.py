"""Token embedding lookup: a plain gather forward, and a choice of backward (`model.embedding_grad`).

    forward    x [B, T, D] = take(table [V, D] cast to the compute dtype, tokens [B, T])
    backward   dtable [V, D] fp32 = for every id v, the sum of the gradient rows of the tokens equal to v

Autodiff of the gather ("scatter") adds every token's gradient row into its table row with atomics, in
the compute dtype. Real token streams repeat ids (byte-level data holds ~100 of a 32k vocabulary), so
the atomics contend on a few rows, and a bf16 row that absorbs thousands of additions keeps only ~8
bits of their sum. The other backwards accumulate in fp32 without contention:

    sorted_segment_sum  sort the ids (stable), permute the gradient rows to match, sum each run of equal
                        ids: a scatter marked indices_are_sorted, for which XLA:GPU picks an emitter whose
                        warps sum runs of equal ids in registers, one atomic per run (when there are more
                        rows than 4 warps per SM). Cost: a sort of N ids and one pass over N x D.
    onehot              one_hot(tokens)^T @ g as one GEMM with fp32 accumulation: data-independent, but
                        2*N*V*D flops and an [N, V] one-hot operand, so only for small vocabularies.

The table arrives in its fp32 master dtype and is cast inside the custom_vjp, so the gradient leaves
the backward in fp32 without a round trip through the compute dtype.

Sharding: the forward gathers from a replicated compute-dtype table (as before). Under a mesh the
tokens are split over the batch and sequence shards; the sort runs within each shard's own tokens
(a sort along a sharded axis would gather every token's gradient row onto every device), each shard
sums into its own fp32 [V, D] partial, and the partials are added: the same reduction over the
token shards that the scatter's [V, D] result needed. Under ZeRO-3 the sum is split along V over
fsdp (`_reduce_over_token_shards` says why), then moved into the table's own sharding.
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple, get_args, get_type_hints

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.config import ModelConfig
from meshtrain.sharding import TOKENS, ShardingRules, entry_axes, spec_axes

EMBEDDING_GRADS = get_args(get_type_hints(ModelConfig)["embedding_grad"])  # the config field's choices


def embedding_lookup(table_vd: jax.Array, tokens_bt: jax.Array, *, compute_dtype: jnp.dtype, grad: str,
                     rules: ShardingRules | None = None) -> jax.Array:
    """Rows of `table_vd` at `tokens_bt`, in `compute_dtype`: [B, T, D]. `grad` picks the backward
    (module docstring); the gradient wrt `table_vd` comes back in its own dtype."""
    if grad not in EMBEDDING_GRADS:
        raise ValueError(f"embedding grad {grad!r}: expected one of {', '.join(EMBEDDING_GRADS)}")
    how = _How(grad, jnp.dtype(compute_dtype), rules)
    if grad == "scatter":  # plain autodiff: the baseline
        return _gather(table_vd, tokens_bt, how)
    return _lookup(table_vd, tokens_bt, how)


class _How(NamedTuple):  # the static half of a lookup (hashable: custom_vjp's nondiff argument)
    grad: str
    compute_dtype: jnp.dtype
    rules: ShardingRules | None


def _gather(table_vd: jax.Array, tokens_bt: jax.Array, how: _How) -> jax.Array:
    table_c_vd = table_vd.astype(how.compute_dtype)
    if how.rules is not None:
        # A gather from a sharded table would make the compiler replicate its output anyway, and the
        # table is small next to the layer stack: all-gather it once, in the compute dtype.
        table_c_vd = how.rules.constrain(table_c_vd, (None, None))
    return jnp.take(table_c_vd, tokens_bt, axis=0)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table_vd: jax.Array, tokens_bt: jax.Array, how: _How) -> jax.Array:
    return _gather(table_vd, tokens_bt, how)


def _lookup_fwd(table_vd, tokens_bt, how):
    # The fp32 table is a parameter, alive anyway: keeping it costs nothing and carries V and its dtype.
    return _gather(table_vd, tokens_bt, how), (table_vd, tokens_bt)


def _lookup_bwd(how, residuals, g_btd):
    table_vd, tokens_bt = residuals
    vocab = table_vd.shape[0]
    if how.grad == "onehot":
        # Exact 0/1 operand, products exact, sums fp32; the contraction over the sharded token dims is
        # a local GEMM per shard and one reduction of [V, D].
        onehot_btv = jax.nn.one_hot(tokens_bt, vocab, dtype=how.compute_dtype)
        precision = jax.lax.Precision.HIGHEST if how.compute_dtype == jnp.float32 else None
        dtable_vd = jnp.einsum("btv,btd->vd", onehot_btv, g_btd, precision=precision,
                               preferred_element_type=jnp.float32)
    else:
        dtable_vd = _per_shard_sorted_sums(tokens_bt, g_btd, vocab, how.rules)
    return dtable_vd.astype(table_vd.dtype), None  # tokens: integer, no cotangent


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def sorted_segment_sum(ids_n: jax.Array, g_nd: jax.Array, vocab: int) -> jax.Array:
    """[V, D] fp32: row v is the sum of the rows of g_nd whose id is v (absent ids: exactly zero)."""
    order_n = jnp.argsort(ids_n, stable=True)  # stable: an id's rows keep their token order
    return jax.ops.segment_sum(g_nd[order_n].astype(jnp.float32), ids_n[order_n], num_segments=vocab,
                               indices_are_sorted=True)


def _per_shard_sorted_sums(tokens_bt: jax.Array, g_btd: jax.Array, vocab: int,
                           rules: ShardingRules | None) -> jax.Array:
    """sorted_segment_sum over all tokens, sorting only within each token shard (module docstring)."""
    b, t = tokens_bt.shape
    gb, gt = token_shards(rules, b, t)
    if gb * gt == 1:
        return sorted_segment_sum(tokens_bt.reshape(-1), g_btd.reshape(b * t, -1), vocab)

    def by_shard(x_bt: jax.Array) -> jax.Array:  # [B, T, ...] -> [Gb, Gt, B/Gb * T/Gt, ...], no data moved
        rest = x_bt.shape[2:]
        x = x_bt.reshape(gb, b // gb, gt, t // gt, *rest).swapaxes(1, 2).reshape(gb, gt, -1, *rest)
        names = [axis if n > 1 else None for axis, n in zip(TOKENS, (gb, gt))]
        return rules.constrain(x, (*names, *(None,) * (x.ndim - 2)))

    local = jax.vmap(jax.vmap(partial(sorted_segment_sum, vocab=vocab)))
    return _reduce_over_token_shards(local(by_shard(tokens_bt), by_shard(g_btd)), rules)


def _reduce_over_token_shards(partials_ggvd: jax.Array, rules: ShardingRules) -> jax.Array:
    """Sum the per-shard [V, D] tables; where the table's D is split over token axes, split the sum
    over those axes along V instead.

    Left to itself, XLA reduce-scatters the partials straight into the table's sharding, which under
    ZeRO-3 splits D over fsdp; to make that split contiguous it gives the partials a D-major layout,
    and the scatter that builds them then writes every row with a stride of V. On two H100s that
    scatter took 11.8 ms per step for Llama-3-8B's table (V 128256, D 4096, 8192 tokens per GPU;
    docs/PROFILE.md). Split along V, the reduction is contiguous in the scatter's own row-major layout;
    moving the V-split sum to the table's sharding is then one all-to-all of the reduced table. Where
    D is not split (ZeRO-0/1), XLA all-reduces the partials in their row-major layout: left alone; so
    is a pipeline (pp > 1).
    """
    dtable_vd = partials_ggvd.sum(axis=(0, 1))
    if rules.mesh.shape["pp"] > 1:
        # Under a pipeline the embedding runs in one stage's branch of the schedule; a collective of its
        # own there would wait for devices of the other stages, which never reach it.
        return dtable_vd
    embed_axes = set(spec_axes(rules.spec(("embed",))))
    axes = tuple(a for a in spec_axes(rules.spec(TOKENS)) if a in embed_axes and rules.mesh.shape[a] > 1)
    if not axes or dtable_vd.shape[0] % math.prod(rules.mesh.shape[a] for a in axes):
        return dtable_vd  # D is not split over the token shards, or V does not split evenly
    return jax.lax.with_sharding_constraint(dtable_vd, NamedSharding(rules.mesh, P(axes, None)))


def token_shards(rules: ShardingRules | None, b: int, t: int) -> tuple[int, int]:
    """How many pieces the batch and sequence dims of the tokens are cut into (1 where they do not divide)."""
    if rules is None:
        return 1, 1
    pieces = []
    for size, entry in zip((b, t), rules.spec(TOKENS)):
        n = math.prod(rules.mesh.shape[a] for a in entry_axes(entry))
        pieces.append(n if size % n == 0 else 1)
    return pieces[0], pieces[1]
