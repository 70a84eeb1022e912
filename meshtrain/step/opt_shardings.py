"""Where each leaf of the optimizer state lives: by the parameter it belongs to, under the ZeRO view.

Any optax state is found this way, however its transformations nest (a chain, a partition into
masked branches, per-parameter statistics of another shape): a leaf whose tree path ends with a
parameter's path belongs to that parameter. Its sharding follows from the two shapes:

    same shape as the parameter          the parameter's optimizer-state spec (AdamW's and Lion's
                                         moments, Muon's momentum; sharded over fsdp from ZeRO-1)
    the parameter's shape less one axis  that spec less the axis's entry (Adafactor's row and column
                                         statistics: means of grad^2 over that axis, laid out like the rest)
    anything else                        replicated (step counts, placeholders, Newton-Schulz coefficients)
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.sharding import replicated


def opt_state_shardings(abstract_opt: Any, abstract_params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """`abstract_opt`, `abstract_params`: shapes (jax.eval_shape); `param_shardings`: params-shaped, the
    optimizer-state view of each parameter. Returns the state's tree of NamedShardings."""
    params = {tuple(path): (leaf.shape, sh.spec) for (path, leaf), sh in
              zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_shardings))}
    longest_first = sorted(params, key=len, reverse=True)

    def leaf_sharding(path, leaf) -> NamedSharding:
        owner = next((p for p in longest_first if len(p) <= len(path) and tuple(path[len(path) - len(p):]) == p), None)
        if owner is None:
            return replicated(mesh)
        shape, spec = params[owner]
        return NamedSharding(mesh, spec_like_param(leaf.shape, shape, spec))

    return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_opt)


def spec_like_param(shape: tuple[int, ...], param_shape: tuple[int, ...], param_spec: P) -> P:
    """The spec of a state leaf of `shape` that belongs to a parameter of `param_shape`, `param_spec`."""
    entries = tuple(param_spec) + (None,) * (len(param_shape) - len(param_spec))
    if tuple(shape) == tuple(param_shape):
        return P(*entries)
    if len(shape) == len(param_shape) - 1:
        # When two neighbouring axes have the same size either may be the one reduced; the first that fits
        # is taken. Both keep a valid layout (equal sizes divide alike); a wrong guess costs a reshard in
        # the update, never a wrong value.
        for axis in range(len(param_shape)):
            if tuple(param_shape[:axis] + param_shape[axis + 1:]) == tuple(shape):
                return P(*(entries[:axis] + entries[axis + 1:]))
    return P()
