"""Run a per-device function on each shard of sharded arrays (jax.shard_map), with the specs taken
from the logical-axis rules.

Used for Pallas kernels: a pallas_call has no partitioning rule, so under plain jit the compiler
would gather its operands onto every device. Wrapped here, each device runs the kernel on its own
block and nothing moves:

    q [B, T, H, E] sharded (batch over dp·fsdp, heads over tp)
        device (i, j) ── kernel(q[b_i, :, h_j, :]) ──> o[b_i, :, h_j, :]

Operands whose spec names no axis are all-gathered first by the compiler (e.g. a ZeRO-3 weight).
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
    # check_vma off: the kernels are opaque to JAX's replication checker.
    return jax.shard_map(fn, mesh=rules.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
