"""Logical axis names and the one table that maps them to mesh axes.

Model code names the logical axes of every parameter and of activations at block boundaries; this
module is the only place that knows both vocabularies. Parameters use the short names, activations
the `act_` names, because the two live on different mesh axes (under ZeRO-3 a weight's `embed` dim is
sharded over fsdp while an activation's batch dim already is).

ZeRO over the fsdp axis is the same parameter names mapped three ways:

    zero_stage   parameters     gradients      optimizer state
        0        replicated     replicated     replicated        (fsdp behaves like dp)
        1        replicated     replicated     rows -> fsdp
        2        replicated     rows -> fsdp   rows -> fsdp      (all-reduce becomes reduce-scatter)
        3        rows -> fsdp   rows -> fsdp   rows -> fsdp      (FSDP: all-gather weights per layer)

"rows": ZeRO splits a weight along its leading (row-major outermost) dim, as PyTorch's FSDP2 does, so that
a gather or a reduce-scatter over fsdp moves whole rows. That is `embed` for the weights that read the
residual stream (wq, wk, wv, w_gate, w_up, lm_head) and the heads or the ffn width for the row-parallel ones
that write back into it (wo [H, E, D]: `o_heads`, w_down [F, D]: `down_mlp`). Split along their trailing
`embed` instead, a row-parallel weight's gradient is reduce-scattered in a transposed layout and the
optimizer's update of it becomes a transposing kernel: on Llama-3-8B at fsdp=2, 1.1 ms a layer a step
(docs/PERFORMANCE.md). Where its leading dim does not divide over tp x fsdp, a row-parallel weight falls
back to its `embed` dim (`o_embed`, `down_embed`). The embedding table [V, D] keeps its `embed` split: its
gradient is summed along V before it is moved there (model/embedding.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
LogicalNames = Sequence[str | None]

# The vocabulary of activation layouts, named for what they lay out: model/ and parallel/ import these
# instead of spelling the tuples, so a layout changes here and in the rules table, nowhere else.
RESIDUAL = ("batch", "act_res_seq", "act_embed")  # the residual stream between blocks [B, T, D]
TOKENS = ("batch", "act_res_seq")  # per-token inputs laid out like the residual stream [B, T]
Q = ("batch", "act_seq", "act_heads", None)  # queries and attention outputs [B, T, H, E]
KV = ("batch", "act_seq", "act_kv_heads", None)  # keys and values [B, S, K, E]
SEQ = ("batch", "act_seq")  # per-token inputs inside a block (positions, segment ids, labels) [B, T]
HIDDEN = ("batch", "act_seq", "act_mlp")  # the FFN's hidden activations [B, T, F]
HEAD_IN = ("batch", "act_seq", "act_embed")  # the final hidden states where the head reads them [B, T, D]


def rules_table(*, fsdp_shards_weights: bool, sequence_parallel: bool,
                kv_heads_on_tp: bool, pipeline: bool = False, o_rows: bool = True,
                down_rows: bool = True) -> dict[str, MeshAxes]:
    """THE rules table: logical axis name -> mesh axes. `o_rows`, `down_rows`: wo's heads and w_down's ffn
    width divide over tp x fsdp, so ZeRO splits those (the module docstring)."""
    fsdp = "fsdp" if fsdp_shards_weights else None

    def rows_or_embed(rows: bool) -> tuple[MeshAxes, MeshAxes]:  # (the leading dim, the embed dim)
        return (("tp", "fsdp"), None) if rows and fsdp_shards_weights else ("tp", fsdp)
    (o_heads, o_embed), (down_mlp, down_embed) = rows_or_embed(o_rows), rows_or_embed(down_rows)
    return {
        # Parameters (Megatron column/row split over tp; ZeRO over fsdp on each weight's leading dim).
        "vocab": "tp",
        "embed": fsdp,
        "heads": "tp",
        "kv_heads": "tp" if kv_heads_on_tp else None,  # fewer kv heads than tp: replicated (Megatron)
        "head_dim": None,
        "mlp": "tp",
        # The row-parallel weights (wo [H, E, D], w_down [F, D]): tp over the rows, ZeRO's fsdp inside each
        # tp block, so that a gather over fsdp yields the block this tp rank multiplies with.
        "o_heads": o_heads,
        "o_embed": o_embed,
        "down_mlp": down_mlp,
        "down_embed": down_embed,
        "layers": "pp" if pipeline else None,  # pipeline stages (parallel/pipeline.py)
        "experts": "ep",  # MoE: each ep rank holds n_experts/ep whole experts (their `mlp` still on tp)
        # Activations. Outside the experts ep is one more data axis, so ep ranks never repeat dense work.
        "batch": ("dp", "fsdp", "ep"),
        # Residual stream between blocks; Megatron SP also splits it over tp.
        "act_res_seq": ("cp", "sp", "tp") if sequence_parallel else ("cp", "sp"),
        "act_seq": ("cp", "sp"),  # inside attention/MLP, where tp holds heads or ffn columns
        "act_embed": None,
        "act_heads": "tp",
        "act_kv_heads": "tp" if kv_heads_on_tp else None,
        "act_mlp": "tp",
        "act_vocab": "tp",
    }


@dataclass(frozen=True)
class ShardingRules:
    """A mesh plus a rules table: turns logical names into PartitionSpecs and shardings."""

    mesh: Mesh
    table: tuple[tuple[str, MeshAxes], ...]  # a tuple, not a dict, so the rules stay hashable

    @classmethod
    def create(cls, mesh: Mesh, table: Mapping[str, MeshAxes]) -> "ShardingRules":
        return cls(mesh, tuple(table.items()))

    def spec(self, names: LogicalNames) -> P:
        lookup = dict(self.table)
        axes = []
        for n in names:
            if n is not None and n not in lookup:
                raise KeyError(f"logical axis {n!r} has no rule; known: {sorted(lookup)}")
            axes.append(None if n is None else lookup[n])
        return P(*axes)

    def sharding(self, names: LogicalNames) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def constrain(self, x: jax.Array, names: LogicalNames) -> jax.Array:
        """Pin an activation's layout at a block boundary (a no-op on one device)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(names))

    def tree_shardings(self, logical_tree: Any) -> Any:
        """Map a tree of logical PartitionSpecs (from the model's param metadata) to NamedShardings."""
        return jax.tree.map(lambda s: self.sharding(tuple(s)), logical_tree,
                            is_leaf=lambda x: isinstance(x, P))


@dataclass(frozen=True)
class ZeroLayout:
    """The three rules views of one mesh under a ZeRO stage (see the module docstring)."""

    params: ShardingRules
    grads: ShardingRules
    opt_state: ShardingRules


def make_rules(mesh: Mesh, *, zero_stage: int, sequence_parallel: bool, n_kv_heads: int, n_heads: int = 0,
               ffn_widths: Sequence[int] = ()) -> ZeroLayout:
    """`n_heads`, `ffn_widths`: the leading sizes of wo and of every w_down (dense, experts); ZeRO splits a
    row-parallel weight's leading dim where it divides over tp x fsdp (none given: it does)."""
    tp = mesh.shape["tp"]
    pieces = tp * mesh.shape["fsdp"]
    base = dict(sequence_parallel=sequence_parallel, kv_heads_on_tp=n_kv_heads % tp == 0,
                pipeline=mesh.shape["pp"] > 1, o_rows=n_heads % pieces == 0,
                down_rows=all(f % pieces == 0 for f in ffn_widths))
    view = lambda shard: ShardingRules.create(mesh, rules_table(fsdp_shards_weights=shard, **base))  # noqa: E731
    return ZeroLayout(params=view(zero_stage >= 3), grads=view(zero_stage >= 2), opt_state=view(zero_stage >= 1))


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec_axes(spec: P) -> list[str]:
    """Every mesh axis a PartitionSpec names, in order."""
    return [a for entry in spec for a in entry_axes(entry)]


def only_axes(spec: P, axes: set[str] | frozenset[str]) -> P:
    """The spec with every mesh axis outside `axes` dropped (a shard_map region manual over `axes`
    takes this; the others stay automatic)."""
    return P(*(tuple(a for a in entry_axes(e) if a in axes) or None for e in spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
