"""Attention over a sequence sharded on cp and sp: Ulysses inside, the ring (or all-gather) across.

The residual stream and q/k/v arrive sequence-sharded over (cp, sp), cp major: cp rank i holds its
T/cp tokens (two zig-zag chunks), split once more over sp. One shard_map region does the rest:

    q, k, v [B, T/(cp*sp), H, E]  (heads over tp)
      ── Ulysses all-to-all over sp ──>  [B, T/cp, H/sp, E]        sequence/ulysses.py (sp > 1)
      ── ring over cp: K/V blocks hop ─> o [B, T/cp, H/sp, E]      sequence/ring.py (cp > 1)
      ── Ulysses all-to-all back ──────> o [B, T/(cp*sp), H, E]

Which axes the region takes over. With the jnp block it is manual over cp and sp only, the axes it
owns; batch (dp, fsdp) and heads (tp) stay automatic, so the compiler partitions the block's
einsums along them and the region's collectives stay on cp and sp. A Pallas kernel has no
partitioning rule: the compiler would gather its operands over every automatic axis inside the
region. So with `model.attention=pallas` the region is manual over every mesh axis, as
parallel/shard_local.py is for a kernel alone (a host callback, which runs the Triton kernels in
their interpreter, is allowed nowhere else). Collectives are still only over cp and sp; the others
merely stop being automatic.
"""
from __future__ import annotations

import jax

from meshtrain.parallel.sequence import ulysses
from meshtrain.parallel.sequence.block import BlockAttention
from meshtrain.parallel.sequence.ring import Ring, allgather_attention, ring_attention
from meshtrain.parallel.shard_local import tp_shard_kv_head
from meshtrain.sharding import KV, Q, SEQ, ShardingRules, only_axes

CP_IMPLS = ("ring", "allgather")


def active(rules: ShardingRules) -> bool:
    """True when the sequence is split over cp or sp, i.e. attention must run through this module."""
    return rules.mesh.shape["cp"] * rules.mesh.shape["sp"] > 1


def context_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, positions_bt: jax.Array,
                      segment_ids_bt: jax.Array, *, impl: str, document_mask: bool, cp_impl: str, cp_layout: str,
                      rules: ShardingRules, attention_kernel: str = "", interpret: bool = False) -> jax.Array:
    """Causal attention of sequence-sharded q/k/v (see the module docstring); o like q."""
    if cp_impl not in CP_IMPLS:
        raise ValueError(f"parallel.cp_impl={cp_impl!r}: must be one of {', '.join(CP_IMPLS)}")
    shape = rules.mesh.shape
    cp, sp, tp = shape["cp"], shape["sp"], shape["tp"]
    kernel = impl == "pallas"
    block = BlockAttention(impl, document_mask, interpret=interpret, backend=attention_kernel or "auto")
    specs = [rules.spec(n) for n in (Q, KV, KV, SEQ, SEQ)]
    manual = set(rules.mesh.axis_names) if kernel else {"cp", "sp"}
    head_groups = 1 if "tp" in manual else tp  # tp shards of the head axis this view still spans
    n_heads, n_kv = q_bthe.shape[2], k_bske.shape[2]
    # Inside a pipeline stage (pp manual, step/pipeline/executor.py) the ring's hops must stay within the stage.
    in_pipeline_stage = "pp" in getattr(rules.mesh, "manual_axes", ()) and shape["pp"] > 1
    if in_pipeline_stage and cp_impl == "ring" and cp > 2:
        raise ValueError(f"parallel.cp_impl=ring with mesh.cp={cp} inside a pipeline stage: the ring's hops run "
                         f"as a swap of two ranks there; use mesh.cp=2 or parallel.cp_impl=allgather")

    def local(q, k, v, pos, seg):
        if kernel and tp > 1 and n_kv % tp:  # replicated kv heads: keep the one this tp shard reads
            k, v = tp_shard_kv_head(k, n_heads, tp), tp_shard_kv_head(v, n_heads, tp)
        if sp > 1:
            ways = sp * head_groups
            k, v = ulysses.kv_for_heads(k, ways), ulysses.kv_for_heads(v, ways)
            q, k, v = (ulysses.seq_to_heads(x, "sp", sp, head_groups) for x in (q, k, v))
            pos, seg = ulysses.gather_tokens(pos, "sp"), ulysses.gather_tokens(seg, "sp")
        if cp > 1:
            ring = Ring("cp", cp, cp_layout, block, hop="swap" if in_pipeline_stage else "permute")
            o = (ring_attention if cp_impl == "ring" else allgather_attention)(q, k, v, pos, seg, ring)
        else:
            o = block.forward(q, k, v, pos, seg, pos, seg, causal=True)[0].astype(q.dtype)
        if sp > 1:
            o = ulysses.heads_to_seq(o, "sp", sp, head_groups)
        return o

    in_specs = tuple(only_axes(s, manual) for s in specs)
    # check_vma off: Pallas kernels are opaque to JAX's replication checker.
    region = jax.shard_map(local, mesh=rules.mesh, in_specs=in_specs, out_specs=in_specs[0],
                           axis_names=frozenset(manual), check_vma=False)
    operands = (q_bthe, k_bske, v_bske, positions_bt, segment_ids_bt)
    if in_pipeline_stage:
        # The operands' layouts pinned over the automatic axes too: with tp's sequence parallelism the compiler
        # otherwise carried some of them into the region still split over tp and realigned the ring's chunk
        # slices with collective permutes between tp ranks, which inside a stage pair devices of every stage.
        # Outside a pipeline the compiler's choice is kept (pinning cost the cp=2 1B step at 32k 1% on 2x H100).
        operands = [rules.constrain(x, n) for x, n in zip(operands, (Q, KV, KV, SEQ, SEQ))]
    return region(*operands)

