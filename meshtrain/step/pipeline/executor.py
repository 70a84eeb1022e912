"""The pipeline executor: a schedule (schedules.py) run as one jitted shard_map program over `pp`.

It replaces the step's microbatch scan when mesh.pp > 1 and returns what that scan returns,
(gradient sum, loss sum, token count, model state, logged sums), so the optimizer, clipping and non-finite handling are
unchanged. Manual over `pp` only: dp, fsdp, tp stay automatic inside a stage, so ZeRO and
Megatron TP run within each stage as they do without the pipeline.

Who holds what:
  layers      the stacked [L, ...] block params, `layers` sharded over pp in the stages' order
              (layout.py: the train state keeps interleaved's and dualpipe_v's chunks where they
              run). Stage s's shard is its v chunks of k = L/(p·v) layers, one tree per chunk.
  embedding,  replicated over pp (they are small next to the stack). Only the stages holding
  final_norm, the first / last virtual stage touch them; at the end one psum over pp adds the
  lm_head     stages' gradients (the embedding's two uses add up when it is tied to the head),
              leaving every stage the same gradient, as a replicated parameter needs.

One tick, every stage at once (p = 4, 1F1B steady state: two lanes, ticks.py):

    stage 0        stage 1        stage 2        stage 3
    F mb6          F mb5          F mb4          (F mb3)        lane 0: lax.switch on its op table
    B mb0          B mb1          B mb2          F+B mb3, loss  lane 1: lax.switch on its op table
      │ x→ ←dy       │ x→ ←dy       │ x→ ←dy       │ ←dy
      └── at most one message per link and stage: ppermute +1 (what a lane sends on) and -1 ──┘
    pool[slot] ← what came from below / from above / from its own lanes, per the receive tables

Ops, as a step without the pipeline runs them (ops.py): F runs a chunk and keeps its pullback (the
residuals train.remat saves) in the stage's stash; B spends it, so a stage holds its peak-in-flight
microbatches' chunk activations, as the memory estimate counts them:
    F  x → chunk (stage 0, chunk 0: embed first) → y, sent on; the pullback kept in stash[slot]
    B  dy, stash[slot] → dx sent back; dW accumulated (split: all but the matmul sites', whose output
       gradients go into stash[slot])
    W  stash[slot] (the sites' inputs from F, output gradients from B) → the sites' dW accumulated
    the last chunk: F does nothing, B runs chunk, head, loss and backward at once and sends dx back (split:
    its sites' inputs and output gradients go into stash[slot] for its W)

The stash is a list of slots, each a list of buffers, and every branch names its slot statically (a
branch per op kind, chunk position and slot; up to MAX_STATIC_SLOTS slots, past which the slot is a traced
index again): F's chunk forward writes its pullback straight into its
slot's buffers and B hands them to its backward where they are. With the slot as a traced index, F
copied every kept leaf into the stash and B copied it out again (2x H100, llama1b, pp=2, m=8: 1F1B
312 -> 293 ms). Each lane runs two switches, one over the ops that fill the stash (F) and one over
those that spend it (B, W): a branch that hands a stash buffer to its backward's loop and also passes
the stash on as the switch's result makes the compiler copy the whole stash at every tick (zb_h1,
one lane: 508 ms with one switch, 377 with two). The branches update the stash and the gradient
accumulators in place: on the GPU that measured faster (1F1B at pp=2, before the static slots: 310
against 348 ms in one call) than returning what they made and adding it after the switch, which costs
zeros for every field a branch does not make (the CPU's compiler, unlike the GPU's, copies operands a
branch passes through).

What this costs against the formula (F = 1, B = 2; or B = W = 1 split): the program's ticks cost
the schedule's makespan in those units (ticks.py: `makespan`). The last chunk's F and B run as one
op of 3 units at its B, which 1F1B places in the same tick anyway (split: 2, and its W 1, placed where
the schedule defers it). A split B pulls back once, for the input gradient and the sites' output
gradients, and its W is one matmul per site (ops.py, weight_grads.py): 1 unit each by the formula's
clock, about 3:1 in time (on an H100, llama1b's half: B 12 ms, W 4 ms, the unsplit B 16 ms). The first
chunk's split backward is all W (its B does nothing: nobody waits for its input gradient), which the
lockstep ticks of zb_h1 at pp=2 favour.
Every tick sends one [b, T, D] message each way, whether or not a stage has one; the embedding/head psum
adds one all-reduce of those parameters over pp per step (ticks.py `executor_op_units` prices the ops).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain import fp8
from meshtrain.data import Batch
from meshtrain.model.layers import FP8_META
from meshtrain.model.transformer import stacked_layers, unrolled_layers
from meshtrain.step.loss import Accumulated, GradFn
from meshtrain.step.pipeline.ops import Stash, chunk_ops, chunk_weights
from meshtrain.step.pipeline.ticks import B, F, LAST, TRANSFER_SCOPE, W, TickTables, tick_tables
from meshtrain.step.pipeline.layout import join_blocks, split_blocks
from meshtrain.step.pipeline.schedules import make_schedule
from meshtrain.step.state import Setup


# --------------------------------------------------------------------------- the executor

NO_SLOT = -1  # an op that neither fills nor spends the stash, or one that finds its slot by a traced index
# Up to this many stash slots, every slot has branches of its own (module docstring): each slot compiles the
# chunk's forward and backward once more. AFAB holds all m microbatches (at m=32, 32 slots: its program took
# 157 s to compile on a 2-core CPU), so past it the slot is a traced index and the stash is copied into and
# out of its slot, as every schedule did before the static slots. 1F1B holds at most 2p-1, zb_h1 and
# interleaved a few per stage.
MAX_STATIC_SLOTS = 8


def index(tree, i):
    """Entry i of every leaf's leading axis."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def make_pipeline_grad_fn(setup: Setup) -> GradFn:
    """(params, Batch [A, b, T], scale=1.0, model_state={}) -> Accumulated (gradient of scale * objective sum,
    the layer stacks of params, model state and gradients in the state's order, `Setup.layers_order`;
    objective sum, token count, model_state, {"loss": cross-entropy sum, sown metrics: token-weighted sums}),
    summed over the A microbatches, computed by the pipeline schedule `setup.cfg.pipeline`.

    fp8_delayed: each chunk's amax histories travel in the stage's carry. A microbatch's F reads them as they
    stand when it runs, and the op that pulls its chunk back pushes that microbatch's amaxes onto them, in
    microbatch order per chunk, so after the step they hold what the microbatch scan's hold. What differs: the
    scan's F of microbatch i reads histories that already hold microbatch i-1's amaxes, and a pipeline runs F
    of later microbatches before B of earlier ones, so its scales may come from a history a few pushes older."""
    cfg, mesh, model = setup.cfg, setup.mesh, setup.model
    p, v = mesh.shape["pp"], cfg.pipeline.virtual_stages
    schedule = make_schedule(cfg.pipeline.schedule, p, cfg.train.grad_accum, v)
    ticks = tick_tables(schedule)
    k = cfg.model.n_layers // (p * v)  # layers per chunk
    # Per lane, one switch over the ops that fill the stash (F) and one over those that spend it (B, W), each
    # left out where the lane runs none of its ops. A branch that hands a stash buffer to its chunk's backward
    # must not also pass the stash on as the switch's result, or the compiler copies the whole stash per tick:
    # a switch whose branches only read the stash passes nothing of it out.
    static = ticks.n_stash_slots <= MAX_STATIC_SLOTS
    # A split B writes the sites' output gradients into its slot and W reads them: in one switch, W's branches
    # would pass on what they read, so each gets its own.
    switch_kinds = ((F,), (B,), (W,)) if schedule.split_backward else ((F,), (B,))
    lane_switches = [[table for table in (_branch_table(ticks, lane, kinds, static) for kinds in switch_kinds)
                      if table[1]] for lane in range(ticks.n_lanes)]

    def stage_program(layers, meta_layers, shared, batch: Batch, scale):
        # Inside, pp is a manual axis: the model's sharding annotations name the other axes of this
        # (abstract) mesh, or their transposes in the backward would not match the context.
        rules = dataclasses.replace(model.rules, mesh=jax.sharding.get_abstract_mesh())
        stage = lax.axis_index("pp")
        # The stage's chunks, one tree each: every branch names its chunk statically, so an op reads its
        # chunk's weights and adds to its chunk's gradients where they are (a traced chunk index copied both
        # in and out of the [v, ...] stack at every op). The stored shard holds them in order (layout.py).
        blocks = split_blocks(layers, v)
        meta_c = split_blocks(meta_layers, v)  # fp8_delayed histories, or {} per chunk
        weights_c = [chunk_weights(model, lp, k) for lp in blocks]  # made once a step
        b, t = batch.tokens.shape[1:]
        pool = jnp.zeros((ticks.n_slots + 1, b, t, cfg.model.d_model), model.policy.compute_dtype)
        ops, stash_of, layers_sowing = chunk_ops(model.clone(rules=rules), k, schedule.split_backward,
                                                 (weights_c[0], pool[0], index(batch, 0), meta_c[0]),
                                                 last_remat=setup.exe.pipeline.last_chunk_remat)
        # Per stash slot, one buffer per kept leaf of a chunk's pullback. Each branch names its slot statically
        # (_branch_table), so F's pullback is computed in its slot's buffers and B reads them where they are: a
        # slot picked by a traced index would copy every leaf into the slot at F and out of it at B. Past
        # MAX_STATIC_SLOTS: one [n_slots, ...] buffer per kept leaf, and the slot a traced index.
        n_stash = max(ticks.n_stash_slots, 1)
        stash = ([[jnp.zeros(a.shape, a.dtype) for a in stash_of.buffers] for _ in range(n_stash)] if static else
                 [jnp.zeros((n_stash, *a.shape), a.dtype) for a in stash_of.buffers])

        # ZeRO-2/3: the accumulated gradients live where the step wants them (reduce-scattered over
        # fsdp), not whole on every device of the stage. Per layer, as the ops return them: the stacked layer
        # axis (sharded over pp) is gone.
        mesh_in = rules.mesh
        g_layer_sh = unrolled_layers(setup.grad_shardings["layers"], k, model.every,  # a layer's, as weights_c
                                     take=lambda sh, i: jax.sharding.NamedSharding(mesh_in, P(*sh.spec[1:])))
        g_shared_sh = jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh_in, sh.spec),
                                   {name: setup.grad_shardings[name] for name in shared})

        def op(kind, pos, slot, c):
            """The switch branch running ops[kind, pos] on chunk c and stash slot `slot`: (carry, me) -> (carry,
            message)."""

            def branch(carry, me):
                pool, stash, g_layers, g_shared, sums, meta_c = carry
                kept = (stash[slot] if slot != NO_SLOT else []) if static else index(stash, me["stash_slot"])
                out = ops[kind, pos](weights_c[c], shared, index(pool, me["x_slot"]),
                                     index(pool, me["dy_slot"]), index(batch, me["microbatch"]), scale, kept,
                                     meta_c[c])
                if out.kept is not None and static:
                    stash = [*stash[:slot], Stash.written(stash[slot], out.kept), *stash[slot + 1:]]
                elif out.kept is not None:  # None: that buffer keeps its value
                    stash = [buf if a is None else lax.dynamic_update_index_in_dim(buf, a, me["stash_slot"], 0)
                             for buf, a in zip(stash, out.kept)]
                if out.d_layers is not None:  # accumulate into this chunk's gradients
                    d_layers = fp8.master_grads(out.d_layers)
                    g = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), g_layers[c], d_layers)
                    g_layers = [*g_layers[:c], lax.with_sharding_constraint(g, g_layer_sh), *g_layers[c + 1:]]
                if out.d_shared is not None:
                    g_shared = lax.with_sharding_constraint(jax.tree.map(jnp.add, g_shared, out.d_shared),
                                                            g_shared_sh)
                made = {"loss": out.loss, "count": out.count, "ce": out.ce, **(out.metrics or {})}
                sums = {name: total + made[name] if made.get(name) is not None else total
                        for name, total in sums.items()}
                message = out.message if out.message is not None else jnp.zeros(pool.shape[1:], pool.dtype)
                if out.meta is not None:  # this microbatch's amaxes, pushed onto the chunk's histories as they are now
                    meta_c = [*meta_c[:c], jax.tree.map(fp8.push_newest_of, meta_c[c], out.meta), *meta_c[c + 1:]]
                return (pool, stash, g_layers, g_shared, sums, meta_c), message

            return branch

        def idle(carry, me):
            return carry, jnp.zeros(pool.shape[1:], pool.dtype)

        # Per switch, only the (kind, position, slot, chunk) keys it runs: an unused op is never compiled.
        branches = [[[idle] + [op(*key) for key in keys] for _, keys in switches]
                    for switches in lane_switches]
        nothing = jnp.zeros(pool.shape[1:], pool.dtype)

        def tick(carry, row):
            lanes, links = row
            outs = []
            for lane, lane_row in enumerate(lanes):  # in order: lane 0's F before lane 1's B
                me = {name: col[stage] for name, col in lane_row.items()}
                out = nothing
                for i, switch in enumerate(branches[lane]):  # a lane runs one op a tick: one switch is not idle
                    carry, made = lax.switch(me["branch"][i], switch, carry, me)
                    out = made if len(branches[lane]) == 1 else jnp.where(me["branch"][i] > 0, made, out)
                outs.append(out)
            link = {name: col[stage] for name, col in links.items()}
            # At most one message per link per stage and tick (ticks.py): pick the lane it comes from.
            up = lax.select_n(link["up_lane"] + 1, nothing, *outs)
            down = lax.select_n(link["down_lane"] + 1, nothing, *outs)
            with jax.named_scope(TRANSFER_SCOPE):
                from_below = lax.ppermute(up, "pp", [(i, (i + 1) % p) for i in range(p)])
                from_above = lax.ppermute(down, "pp", [(i, (i - 1) % p) for i in range(p)])
            pool = carry[0]
            kept = [(link["from_below"], from_below), (link["from_above"], from_above)]
            kept += [(lane_row["from_self"][stage], out) for lane_row, out in zip(lanes, outs)]
            for slot, msg in kept:
                pool = lax.dynamic_update_index_in_dim(pool, msg, slot, 0)
            return (pool,) + carry[1:], None

        # The objective, the labelled tokens, the cross-entropy and each sown metric (token-weighted), summed.
        sums = {name: jnp.zeros((), jnp.float32) for name in ("loss", "count", "ce", *layers_sowing)}
        zeros_c = [lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, lp), g_layer_sh) for lp in
                   (unrolled_layers(lp, k, model.every) for lp in blocks)]  # fp32, and every chunk's shapes alike
        carry = (pool, stash, zeros_c,
                 lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, shared), g_shared_sh), sums, meta_c)
        lane_rows = tuple({**{name: jnp.asarray(table[:, :, lane]) for name, table in ticks.lane_tables().items()},
                           "branch": jnp.asarray(np.stack([branch_of for branch_of, _ in switches], axis=-1))}
                          for lane, switches in enumerate(lane_switches))
        link_rows = {name: jnp.asarray(table) for name, table in ticks.link_tables().items()}
        (_, _, g_layers, g_shared, sums, meta_c), _ = lax.scan(tick, carry, (lane_rows, link_rows))
        g_layers = join_blocks([stacked_layers(g, k, model.every) for g in g_layers])
        meta_layers = join_blocks(meta_c)
        with jax.named_scope(TRANSFER_SCOPE):
            sums = lax.psum(sums, "pp")
        # A metric's logged value is its mean over the layers that sow it (step/loss.py): p·v chunks of them.
        logged = {"loss": sums["ce"]} | {name: sums[name] / (n * p * v) for name, n in layers_sowing.items()}
        with jax.named_scope(TRANSFER_SCOPE):
            return g_layers, meta_layers, lax.psum(g_shared, "pp"), sums["loss"], sums["count"], logged

    program = jax.shard_map(stage_program, mesh=mesh, in_specs=(P("pp"), P("pp"), P(), P(), P()),
                            out_specs=(P("pp"), P("pp"), P(), P(), P(), P()), axis_names={"pp"}, check_vma=False)

    def grad_fn(params, batch: Batch, scale=1.0, model_state=None):
        shared = {name: sub for name, sub in params.items() if name != "layers"}
        # The layers' fp8_delayed histories: every fp8_delayed site is in the layers (run_checks refuses the head).
        model_state = model_state or {}
        meta_layers = model_state.get(FP8_META, {}).get("layers", {})
        g_layers, meta_layers, g_shared, loss, count, logged = program(params["layers"], meta_layers, shared, batch,
                                                                       jnp.asarray(scale, jnp.float32))
        grads = {**g_shared, "layers": g_layers}
        grads = jax.lax.with_sharding_constraint(grads, setup.grad_shardings)
        if meta_layers:
            model_state = {**model_state, FP8_META: {**model_state[FP8_META], "layers": meta_layers}}
        return Accumulated(grads, loss, count, model_state, logged)

    return grad_fn


def _branch_table(ticks: TickTables, lane: int, kinds: tuple[int, ...], static: bool
                  ) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """Number the (op kind, chunk position, stash slot, chunk) keys of `kinds` that `lane` runs, 1.. (0: idle, or
    an op of another kind): [T, S] branch indices and the keys in branch order. The slot is NO_SLOT for ops that
    neither fill nor spend the stash (the last chunk's, unless split), and for every op when the slots are not
    `static`."""
    kind, position, slot, chunk = (getattr(ticks, name)[:, :, lane]
                                   for name in ("kind", "position", "stash_slot", "chunk"))

    def key(t: int, s: int) -> tuple[int, int, int, int]:
        stashed = position[t, s] != LAST or ticks.split_backward and kind[t, s] != F  # the split last chunk's B, W
        kept_in = int(slot[t, s]) if static and stashed else NO_SLOT
        return int(kind[t, s]), int(position[t, s]), kept_in, int(chunk[t, s])

    keys = sorted({key(t, s) for (t, s), kd in np.ndenumerate(kind) if kd in kinds})
    number = {k: i + 1 for i, k in enumerate(keys)}
    table = np.zeros_like(kind)
    for (t, s), kd in np.ndenumerate(kind):
        if kd in kinds:
            table[t, s] = number[key(t, s)]
    return table, keys
