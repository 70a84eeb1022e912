"""The pipeline executor: a schedule (schedules.py) run as one jitted shard_map program over `pp`.

It replaces the step's microbatch scan when mesh.pp > 1 and returns what that scan returns,
(gradient sum, loss sum, token count, model state, logged sums), so the optimizer, clipping and non-finite handling are
unchanged. Manual over `pp` only: dp, fsdp, tp stay automatic inside a stage, so ZeRO and
Megatron TP run within each stage as they do without the pipeline.

Who holds what:
  layers      the stacked [L, ...] block params, `layers` sharded over pp. Stage s holds its v
              chunks of k = L/(p·v) layers. For v = 1 that is the stored contiguous shard; for
              interleaved / dualpipe_v the stack is permuted into the stage layout at the start
              of the step and the gradients back at its end (one all-to-all of the stack over
              pp each way), so the saved tree is the same for every pp.
  embedding,  replicated over pp (they are small next to the stack). Only the stages holding
  final_norm, the first / last virtual stage touch them; at the end one psum over pp adds the
  lm_head     stages' gradients (the embedding's two uses add up when it is tied to the head),
              leaving every stage the same gradient, as a replicated parameter needs.

One tick, every stage at once (p = 4, 1F1B steady state):

    stage 0        stage 1        stage 2        stage 3
    B mb0          F mb3          B mb1          F mb2+loss     lax.switch on the op table
      │ (none)       │ x→           │ ←dy          │
      └────────── one message per stage: ppermute +1 and ppermute -1 (cyclic) ───────────┘
    pool[slot] ← what came from below / from above / from itself, per the receive tables

Ops, with recomputation: each stage stashes only the input x of a chunk (and the output
gradient dy where the backward is split); B and W recompute the chunk's forward from x
(jax.vjp at B time) instead of keeping its activations, so a stage holds peak-in-flight
[b, T, D] tensors per the schedule, not a chunk's internal activations:
    F  x → chunk (stage 0, chunk 0: embed first) → y, sent on; the last chunk: head + loss
    B  x, dy → recompute, vjp → dx sent back; dW accumulated (unless split)
    W  x, dy → recompute, vjp wrt weights only → dW accumulated (split schedules)

What this costs against the formula (F = 1, B = 2; or B = W = 1 split): B is 1 + 2, an extra
chunk forward, so the unsplit schedules run at F:B = 1:3; split B is forward + input-grad chain
and W is forward + the full chain (the weight grads of a layer need the grads flowing back
through the layers after it), about 2 and 3: the split costs roughly 6 units per microbatch
where the unsplit one costs 4. The lockstep clock adds more: a tick lasts its slowest op, and
every tick sends one [b, T, D] message each way whether or not a stage has one. Interleaved
and dualpipe_v add the stack permutation per step; the embedding/head psum adds one
all-reduce of those parameters over pp per step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.data import Batch
from meshtrain.step.loss import Accumulated, GradFn
from meshtrain.step.pipeline.ops import chunk_ops
from meshtrain.step.pipeline.ticks import IDLE, TickTables, tick_tables
from meshtrain.step.pipeline.schedules import make_schedule, virtual_stage
from meshtrain.step.state import Setup


# --------------------------------------------------------------------------- the stack's layout


def stage_order(kind: str, p: int, v: int) -> np.ndarray:
    """order[i] = the virtual stage (model chunk) at block i of the stage layout, where stage s
    holds blocks s·v .. s·v+v-1, its chunks 0..v-1 (schedules.virtual_stage)."""
    return np.array([virtual_stage(kind, p, s, c) for s in range(p) for c in range(v)])


def permute_blocks(tree: Any, order: np.ndarray) -> Any:
    """Reorder the leading [L] axis of every leaf as len(order) blocks: out block i = in block order[i]."""
    if np.array_equal(order, np.arange(len(order))):
        return tree  # v = 1: the stored contiguous shards are the stages
    n = len(order)

    def one(a):
        blocks = a.reshape(n, a.shape[0] // n, *a.shape[1:])
        return jnp.take(blocks, jnp.asarray(order), axis=0).reshape(a.shape)

    return jax.tree.map(one, tree)


# --------------------------------------------------------------------------- the executor


def make_pipeline_grad_fn(setup: Setup) -> GradFn:
    """(params, Batch [A, b, T], scale=1.0, model_state={}) -> Accumulated (gradient of scale * loss sum, loss sum,
    token count, model_state, {"loss": loss sum}), summed over the A microbatches, computed by the
    pipeline schedule `setup.cfg.pipeline`. The model state passes through unchanged (validate refuses
    the fp8 recipe that would update it); the loss is the cross-entropy alone (validate refuses MoE,
    whose auxiliary losses and metrics would join it)."""
    cfg, mesh, model = setup.cfg, setup.mesh, setup.model
    p, v = mesh.shape["pp"], cfg.pipeline.virtual_stages
    schedule = make_schedule(cfg.pipeline.schedule, p, cfg.train.grad_accum, v)
    ticks = tick_tables(schedule)
    k = cfg.model.n_layers // (p * v)
    order = stage_order(schedule.kind, p, v)
    inverse = np.argsort(order)
    branch_of, branches_for = _branch_table(ticks)

    def stage_program(layers, shared, batch: Batch, scale):
        # Inside, pp is a manual axis: the model's sharding annotations name the other axes of this
        # (abstract) mesh, or their transposes in the backward would not match the context.
        rules = dataclasses.replace(model.rules, mesh=jax.sharding.get_abstract_mesh())
        ops = chunk_ops(model.clone(rules=rules), k, schedule.split_backward)
        stage = lax.axis_index("pp")
        layers_vk = jax.tree.map(lambda a: a.reshape(v, k, *a.shape[1:]), layers)
        b, t = batch.tokens.shape[1:]
        pool = jnp.zeros((ticks.n_slots + 1, b, t, cfg.model.d_model), model.policy.compute_dtype)

        # ZeRO-2/3: the accumulated gradients live where the step wants them (reduce-scattered over
        # fsdp), not whole on every device of the stage. [v, k] replaces the pp-sharded layer axis.
        mesh_in = rules.mesh
        g_layer_sh = jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh_in, P(None, None, *sh.spec[1:])),
                                  setup.grad_shardings["layers"])
        g_shared_sh = jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh_in, sh.spec),
                                   {name: setup.grad_shardings[name] for name in shared})

        def index(tree, i):
            return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)

        def op(kind, pos):
            """The switch branch running ops[kind, pos]: (carry, me) -> (carry, message)."""

            def branch(carry, me):
                pool, g_layers, g_shared, loss, count = carry
                c = me["chunk"]
                out = ops[kind, pos](index(layers_vk, c), shared, index(pool, me["x_slot"]),
                                     index(pool, me["dy_slot"]), index(batch, me["microbatch"]), scale)
                if out.d_layers is not None:  # accumulate into this chunk's rows
                    g_layers = jax.tree.map(lambda acc, d: lax.dynamic_update_index_in_dim(
                        acc, index(acc, c) + d, c, 0), g_layers, out.d_layers)
                    g_layers = lax.with_sharding_constraint(g_layers, g_layer_sh)
                if out.d_shared is not None:
                    g_shared = lax.with_sharding_constraint(jax.tree.map(jnp.add, g_shared, out.d_shared),
                                                            g_shared_sh)
                if out.loss is not None:
                    loss, count = loss + out.loss, count + out.count
                message = out.message if out.message is not None else jnp.zeros(pool.shape[1:], pool.dtype)
                return (pool, g_layers, g_shared, loss, count), message

            return branch

        def idle(carry, me):
            return carry, jnp.zeros(pool.shape[1:], pool.dtype)

        branches = [idle] + [op(kind, pos) for kind, pos in branches_for]

        def tick(carry, row):
            me = {name: col[stage] for name, col in row.items()}
            carry, out = lax.switch(me["branch"], branches, carry, me)
            from_below = lax.ppermute(out, "pp", [(i, (i + 1) % p) for i in range(p)])
            # With two stages both neighbours are one device: the plan routes everything on +1.
            from_above = from_below if p == 2 else lax.ppermute(out, "pp", [(i, (i - 1) % p) for i in range(p)])
            pool = carry[0]
            for slot, msg in ((me["from_below"], from_below), (me["from_above"], from_above),
                              (me["from_self"], out)):
                pool = lax.dynamic_update_index_in_dim(pool, msg, slot, 0)
            return (pool,) + carry[1:], None

        zero = jnp.zeros((), jnp.float32)
        carry = (pool, lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, layers_vk), g_layer_sh),
                 lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, shared), g_shared_sh), zero, zero)
        rows = {name: jnp.asarray(table) for name, table in ticks.tables().items()}
        rows["branch"] = jnp.asarray(branch_of)
        (_, g_layers, g_shared, loss, count), _ = lax.scan(tick, carry, rows)
        g_layers = jax.tree.map(lambda a: a.reshape(v * k, *a.shape[2:]), g_layers)
        return g_layers, lax.psum(g_shared, "pp"), lax.psum(loss, "pp"), lax.psum(count, "pp")

    program = jax.shard_map(stage_program, mesh=mesh, in_specs=(P("pp"), P(), P(), P()),
                            out_specs=(P("pp"), P(), P(), P()), axis_names={"pp"}, check_vma=False)

    def grad_fn(params, batch: Batch, scale=1.0, model_state=None):
        shared = {name: sub for name, sub in params.items() if name != "layers"}
        layers = permute_blocks(params["layers"], order)
        g_layers, g_shared, loss, count = program(layers, shared, batch, jnp.asarray(scale, jnp.float32))
        grads = {**g_shared, "layers": permute_blocks(g_layers, inverse)}
        grads = jax.lax.with_sharding_constraint(grads, setup.grad_shardings)
        return Accumulated(grads, loss, count, model_state or {}, {"loss": loss})

    return grad_fn


def _branch_table(ticks: TickTables) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Number the (op kind, chunk position) pairs the plan uses, 1.. (0 is idle): the switch's
    branches are only those, so an unused op is never compiled."""
    pairs = sorted({(int(kd), int(ps)) for kd, ps in zip(ticks.kind.ravel(), ticks.position.ravel()) if kd != IDLE})
    index = {pair: i + 1 for i, pair in enumerate(pairs)}
    table = np.zeros_like(ticks.kind)
    for (t, s), kd in np.ndenumerate(ticks.kind):
        if kd != IDLE:
            table[t, s] = index[(int(kd), int(ticks.position[t, s]))]
    return table, pairs
