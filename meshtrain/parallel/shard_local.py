"""Run a per-device function on each shard of sharded arrays (jax.shard_map), with the specs taken
from the logical-axis rules.

Used for Pallas kernels: a pallas_call has no partitioning rule, so under plain jit the compiler
would gather its operands onto every device. Wrapped here, each device runs the kernel on its own
block and nothing moves:

    q [B, T, H, E] sharded (batch over dp·fsdp, heads over tp)
        device (i, j) ── kernel(q[b_i, :, h_j, :]) ──> o[b_i, :, h_j, :]

Operands whose spec names no axis are all-gathered first by the compiler (e.g. a ZeRO-3 weight).
A kernel region manual over tp with fewer kv heads than tp holds every kv head on every tp shard;
`tp_shard_kv_head` keeps the one the shard's query heads read.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax

from meshtrain.sharding import LogicalNames, ShardingRules


def shard_local(fn: Callable, rules: ShardingRules, in_names: Sequence[LogicalNames],
                out_names: LogicalNames | Sequence[LogicalNames]) -> Callable:
    in_specs = tuple(rules.spec(n) for n in in_names)
    multi = bool(out_names) and isinstance(out_names[0], (tuple, list))
    out_specs = tuple(rules.spec(n) for n in out_names) if multi else rules.spec(out_names)
    # Inside a region already manual over some axes (a pipeline stage: pp), go manual over the rest.
    manual = set(getattr(rules.mesh, "manual_axes", ()))
    axes = frozenset(a for a in rules.mesh.axis_names if a not in manual)
    # check_vma off: the kernels are opaque to JAX's replication checker.
    return jax.shard_map(fn, mesh=rules.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes,
                         check_vma=False)


def tp_shard_kv_head(kv_bske: jax.Array, n_heads: int, tp: int) -> jax.Array:
    """Inside a region manual over tp, with every kv head on every tp shard (fewer kv heads than tp,
    replicated Megatron style): [B, S, K, E] -> [B, S, 1, E], the one kv head this shard's query heads read.

    This shard's n_heads/tp query heads all read one kv head, (first head) // (n_heads / K): validate()
    requires tp % n_kv_heads == 0 here, so a shard never straddles two groups.
    """
    first = jax.lax.axis_index("tp") * (n_heads // tp)
    return jax.lax.dynamic_slice_in_dim(kv_bske, first // (n_heads // kv_bske.shape[2]), 1, axis=2)
