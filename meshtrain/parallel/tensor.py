"""Collective matmul: tensor parallelism with sequence parallelism, each collective cut into ring steps
that overlap the matmuls (Wang et al., ASPLOS 2023). A shard_map manual over tp only.

Under sequence parallelism the residual stream is split along the sequence over tp: device i holds
chunk i of T/tp tokens. The column-parallel matmuls (q/k/v, gate/up) need every token, and the
row-parallel ones (wo, down) produce partial sums that go back onto the chunks. GSPMD runs each as a
whole collective before or after its matmul; here the collective moves one chunk per step while the
matmul of the chunk in hand runs (n = tp, every device at once):

  gather_matmuls   x [B, T/n, D] chunk i, w [D, F/n]  ->  y [B, T, F/n]
      step k = 0 .. n-1:   y[chunk (i+k) % n] = x_k @ w        x_{k+1} = x_k of device i+1
  matmul_scatter   h [B, T, F/n], w [F/n, D]          ->  y [B, T/n, D] chunk i
      step k = 0 .. n-1:   acc = (acc of device i+1) + h[chunk (i+k+1) % n] @ w   (acc = 0 at k = 0)
                           after the last step device i holds the sum for chunk i

Each step's ppermute does not depend on that step's matmul, so the two can run at once. The backward
comes from autodiff: a ppermute transposes to the reverse ppermute, so the gradient of the gather is
a ring reduce-scatter and that of the scatter a ring all-gather, again one chunk per matmul.

Only tp is manual; batch axes (dp, fsdp) stay automatic, so a ZeRO-3 weight is gathered over fsdp by
the compiler as before. `active()` says when a layer should take this path (parallel.tp_overlap).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from meshtrain.sharding import RESIDUAL, LogicalNames, ShardingRules, entry_axes, only_axes

AXIS = "tp"


def active(tp_overlap: str, rules: ShardingRules) -> bool:
    """collective_matmul asked for, and the residual stream really split over tp (SP, tp > 1)."""
    if tp_overlap != "collective_matmul" or rules.mesh.shape[AXIS] == 1:
        return False
    return AXIS in entry_axes(rules.spec(RESIDUAL)[1])  # the sequence entry: tp joins it under SP


def gather_matmuls(x_btd: jax.Array, ws: Sequence[jax.Array], w_names: Sequence[LogicalNames],
                   out_names: Sequence[LogicalNames], matmul: Callable, rules: ShardingRules) -> list[jax.Array]:
    """matmul(x_full, ws) -> [y, ...] for the sequence-sharded x, without gathering x first.

    `matmul(x_chunk, ws_local)` returns one output per weight; each output keeps the token axis at
    position 1 and holds its tp-sharded dim where `out_names` says. Several weights share the ring, so
    q/k/v (or gate/up) move x once.
    """
    n = rules.mesh.shape[AXIS]

    def local(x_btd, *ws):
        i = jax.lax.axis_index(AXIS)
        t_chunk = x_btd.shape[1]
        outs = None
        for k in range(n):
            ys = matmul(x_btd, ws)
            if outs is None:  # whole-sequence buffers; each step writes its chunk in place
                outs = [jnp.zeros((y.shape[0], n * t_chunk, *y.shape[2:]), y.dtype) for y in ys]
            start = ((i + k) % n) * t_chunk  # the chunk this step holds
            outs = [jax.lax.dynamic_update_slice_in_dim(o, y, start, axis=1) for o, y in zip(outs, ys)]
            if k < n - 1:
                x_btd = _from_next(x_btd, n)
        return outs

    x_spec = only_axes(rules.spec(RESIDUAL), {AXIS})
    in_specs = (x_spec, *(only_axes(rules.spec(names), {AXIS}) for names in w_names))
    out_specs = [only_axes(rules.spec(names), {AXIS}) for names in out_names]
    return jax.shard_map(local, mesh=rules.mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                         check_vma=False)(x_btd, *ws)


def matmul_scatter(h: jax.Array, w: jax.Array, h_names: LogicalNames, w_names: LogicalNames, matmul: Callable,
                   rules: ShardingRules) -> jax.Array:
    """matmul(h, w) summed over tp and left split along the sequence ([B, T/tp, D] chunk i on device i),
    without a separate reduce-scatter. h has its token axis at position 1."""
    n = rules.mesh.shape[AXIS]

    def local(h, w):
        i = jax.lax.axis_index(AXIS)
        t_chunk = h.shape[1] // n
        acc = None
        for k in range(n):
            chunk = jax.lax.dynamic_slice_in_dim(h, ((i + k + 1) % n) * t_chunk, t_chunk, axis=1)
            part = matmul(chunk, w)
            acc = part if acc is None else _from_next(acc, n) + part
        return acc

    in_specs = (only_axes(rules.spec(h_names), {AXIS}), only_axes(rules.spec(w_names), {AXIS}))
    out_spec = only_axes(rules.spec(RESIDUAL), {AXIS})
    return jax.shard_map(local, mesh=rules.mesh, in_specs=in_specs, out_specs=out_spec, axis_names={AXIS},
                         check_vma=False)(h, w)


def _from_next(x: jax.Array, n: int) -> jax.Array:
    """Device i receives device (i + 1) % n's x."""
    return jax.lax.ppermute(x, AXIS, [(j, (j - 1) % n) for j in range(n)])
