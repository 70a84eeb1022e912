"""The pipeline executor computes what one device computes, for every schedule, and its memory
does not grow with the number of microbatches.

fp32 compute: losses agree to rtol 1e-5 and gradients to 1e-5 of each tensor's largest entry, the
reduction-order differences of a sharded run. One single-device reference trajectory (4 steps,
parameters kept before each) is shared by every case but the interpreted kernels' (its first step, of
a smaller model, against a reference of its own); a case compiles only its gradient function and evaluates
it at each of the reference's parameters, so a case costs one compile. Two cases
also run the real train step (optimizer, clipping, sharded gradients) and carry a checkpoint
across pp. The non-pp axes differ from case to case (dp, fsdp with ZeRO-1/2/3, tp), so each
schedule also runs composed with another layout.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import assert_grads_close, make_setup, model_order_grad_fn, single_device, tiny_config
from meshtrain.checkpoint import Checkpointer, abstract_state
from meshtrain.evaluation import make_eval_step
from meshtrain.step.pipeline.layout import permutation, stage_order
from meshtrain.step.pipeline.ticks import tick_tables
from meshtrain.step.pipeline.schedules import make_schedule
from meshtrain.resume import restore_or_init
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import abstract_params, init_state, make_batches
from meshtrain.step.train_step import make_train_step

# 8 layers so that pp=4 with two chunks per stage still has a whole layer per chunk.
SMALL = ["model.n_layers=8", "model.d_model=32", "model.d_ff=64", "model.vocab_size=64", "data.seq_len=8"]
N_STEPS = 4

# id -> overrides: every schedule at pp=2 and pp=4, each over another layout of the other axes.
CASES = {
    "afab-pp2-dp4": ["pipeline.schedule=afab", "mesh.pp=2", "mesh.dp=4", "mesh.fsdp=1", "train.grad_accum=4"],
    "1f1b-pp2-fsdp2-tp2-zero3": ["pipeline.schedule=1f1b", "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2",
                                 "train.zero_stage=3", "train.grad_accum=4"],
    "interleaved-v2-pp2-fsdp4-zero2": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "mesh.pp=2",
                                       "mesh.fsdp=4", "train.zero_stage=2", "train.grad_accum=4"],
    # the stash under a policy that reruns the elementwise work, the last chunk keeping everything (auto)
    "zb_h1-pp2-dp2-tp2-save_dots_attn": ["pipeline.schedule=zb_h1", "mesh.pp=2", "mesh.dp=2", "mesh.fsdp=1",
                                         "mesh.tp=2", "train.grad_accum=4", "train.remat=save_dots_attn"],
    "dualpipe_v-pp2-dp2-fsdp2": ["pipeline.schedule=dualpipe_v", "pipeline.virtual_stages=2", "mesh.pp=2",
                                 "mesh.dp=2", "mesh.fsdp=2", "train.grad_accum=4"],
    "afab-pp4-tp2": ["pipeline.schedule=afab", "mesh.pp=4", "mesh.fsdp=1", "mesh.tp=2", "train.grad_accum=8"],
    # every chunk rematerialized but the last, which is told to keep everything
    "1f1b-pp4-fsdp2-zero3-full-last-none": ["pipeline.schedule=1f1b", "mesh.pp=4", "mesh.fsdp=2", "train.zero_stage=3",
                                            "train.grad_accum=8", "train.remat=full", "pipeline.last_chunk_remat=none"],
    "interleaved-v2-pp4-dp2": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "mesh.pp=4",
                               "mesh.dp=2", "mesh.fsdp=1", "train.grad_accum=8"],
    "zb_h1-pp4-fsdp2-zero2": ["pipeline.schedule=zb_h1", "mesh.pp=4", "mesh.fsdp=2", "train.zero_stage=2",
                              "train.grad_accum=8"],
    "dualpipe_v-pp4-tp2": ["pipeline.schedule=dualpipe_v", "pipeline.virtual_stages=2", "mesh.pp=4",
                           "mesh.fsdp=1", "mesh.tp=2", "train.grad_accum=8"],
    # the sequence split inside the stages: cp by all-gathered K/V, cp by the ring (its hops as swaps within the
    # stage's cp group) with tp's sequence parallelism, sp (Ulysses) with tp's sequence parallelism
    "1f1b-pp2-cp2-fsdp2-allgather": ["pipeline.schedule=1f1b", "mesh.pp=2", "mesh.cp=2", "mesh.fsdp=2",
                                     "parallel.cp_impl=allgather", "train.grad_accum=4"],
    "zb_h1-pp2-cp2-tp2-seqpar-ring": ["pipeline.schedule=zb_h1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=2", "mesh.fsdp=1",
                                      "parallel.sequence_parallel=true", "parallel.cp_impl=ring", "train.grad_accum=4"],
    "interleaved-v2-pp2-sp2-tp2-seqpar": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "mesh.pp=2",
                                          "mesh.sp=2", "mesh.fsdp=1", "mesh.tp=2", "parallel.sequence_parallel=true",
                                          "train.grad_accum=4"],
    # sp (Ulysses) without tp: each stage's heads all-to-all over sp alone, beside dp
    "zb_h1-pp2-sp2-dp2": ["pipeline.schedule=zb_h1", "mesh.pp=2", "mesh.sp=2", "mesh.dp=2", "mesh.fsdp=1",
                          "train.grad_accum=4"],
    # the fused kernels inside the stages (interpreted on the CPU), each called on its device's shard
    "1f1b-pp2-fsdp2-tp2-kernels": ["pipeline.schedule=1f1b", "mesh.pp=2", "mesh.fsdp=2", "mesh.tp=2",
                                   "train.grad_accum=4", "model.attention=pallas", "model.norm=pallas",
                                   "model.loss=fused"],
}
STEP_CASE = "1f1b-pp2-fsdp2-tp2-zero3"  # also runs the real train step and the checkpoint round trips
# Interpreted kernels run slowly on the CPU, and a step calls them once per layer and microbatch on each device:
# these cases check the first step only (gradients and loss), of the model cut to fewer layers (2: one per stage
# at pp=2), against one device's first step of the same cut model at the reference's initial parameters. Each
# device's shard, and so each kernel call, has the shapes it has in the 8-layer model.
FIRST_STEP_ONLY = {"1f1b-pp2-fsdp2-tp2-kernels": 2}  # case -> layers


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device: parameters before each of N_STEPS steps, the steps' losses, the first gradients
    (mean over tokens), and a checkpoint after step 2."""
    setup = make_setup(single_device(tiny_config(*SMALL)), 1)
    batches, state, step = make_batches(setup), init_state(setup), make_train_step(setup)
    grads, _, n, _, _ = jax.jit(make_grad_fn(setup))(state.params, batches.batch(0))
    ckpt_dir = tmp_path_factory.mktemp("pp1") / "checkpoints"
    params, losses = [], []
    for i in range(N_STEPS):
        if i == 2:
            save(ckpt_dir, state, setup)
        params.append(host(state.params))
        state, metrics = step(state, batches.batch(i))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.1, "the reference must learn, or equal losses prove little"
    return dict(setup=setup, step=step, params=params, losses=losses, ckpt=ckpt_dir,
                grads=jax.tree.map(lambda g: np.asarray(g) / float(n), grads))


def first_step_reference(reference: dict, n_layers: int) -> dict:
    """One device, the first step only, of the model cut to its first n_layers: the reference's initial
    parameters with the layer stack [L, ...] cut to n_layers, and the loss and gradients (mean over tokens)
    there."""
    setup = make_setup(single_device(tiny_config(*SMALL, f"model.n_layers={n_layers}")), 1)
    params = dict(reference["params"][0])
    params["layers"] = jax.tree.map(lambda a: a[:n_layers], params["layers"])
    grads, loss_sum, n, _, _ = jax.jit(make_grad_fn(setup))(params, make_batches(setup).batch(0))
    return dict(params=[params], losses=[float(loss_sum / n)],
                grads=jax.tree.map(lambda g: np.asarray(g) / float(n), grads))


def save(directory, state, setup) -> None:
    ckpt = Checkpointer(str(directory), keep=2, async_save=False)
    ckpt.save(int(state.step), state, setup.cfg.to_dict(), setup.layers_order)
    ckpt.wait()
    ckpt.close()


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_single_device(case, reference):
    check_case(case, reference)


def test_stash_slots_by_traced_index_match_single_device(reference, monkeypatch):
    """Past executor.MAX_STATIC_SLOTS (AFAB at many microbatches) the stash slot is a traced index, not a branch
    of its own: the same schedule, every slot that way, against one device."""
    from meshtrain.step.pipeline import executor

    monkeypatch.setattr(executor, "MAX_STATIC_SLOTS", 0)
    check_case("afab-pp2-dp4", reference)


def check_case(case: str, reference: dict) -> None:
    """CASES[case] on 8 devices: first-step gradients and the losses at the reference's parameters."""
    model = []
    if case in FIRST_STEP_ONLY:
        reference = first_step_reference(reference, FIRST_STEP_ONLY[case])
        model = [f"model.n_layers={FIRST_STEP_ONLY[case]}"]
    setup = make_setup(tiny_config(*SMALL, *model, *CASES[case]), 8)
    assert setup.mesh.shape["pp"] in (2, 4)
    grad_fn = model_order_grad_fn(setup)
    batches = make_batches(setup)
    losses = []
    points = reference["params"]
    for i, params in enumerate(points):
        params = jax.device_put(params, setup.state_shardings.params)
        grads, loss_sum, n_tokens, _, _ = grad_fn(params, batches.batch(i))
        if i == 0:
            assert_grads_close(jax.tree.map(lambda g: np.asarray(g) / float(n_tokens), grads), reference["grads"])
        losses.append(float(loss_sum / n_tokens))
    np.testing.assert_allclose(losses, reference["losses"][:len(points)], rtol=1e-5)


# --------------------------------------------------------------------------- the train step, checkpoints


@pytest.fixture(scope="module")
def pipelined_run(reference, tmp_path_factory):
    """The real train step at pp=2 for N_STEPS, with a checkpoint after step 2."""
    setup = make_setup(tiny_config(*SMALL, *CASES[STEP_CASE]), 8)
    batches, state, step = make_batches(setup), init_state(setup), make_train_step(setup)
    ckpt_dir = tmp_path_factory.mktemp("pp2") / "checkpoints"
    losses = []
    for i in range(N_STEPS):
        if i == 2:
            save(ckpt_dir, state, setup)
        state, metrics = step(state, batches.batch(i))
        losses.append(float(metrics["loss"]))
    return dict(setup=setup, step=step, losses=losses, ckpt=ckpt_dir)


def test_train_step_with_pipeline_matches_single_device(pipelined_run, reference):
    np.testing.assert_allclose(pipelined_run["losses"], reference["losses"], rtol=1e-5)


def resume_losses(run: dict, ckpt_dir) -> list[float]:
    """Restore the checkpoint of step 2 into `run`'s setup (another pp) and run the last steps."""
    setup = run["setup"]
    ckpt = Checkpointer(str(ckpt_dir), keep=2, async_save=False)
    state, resumed = restore_or_init(setup, ckpt)
    ckpt.close()
    assert resumed == 2
    batches, losses = make_batches(setup), []
    for i in range(2, N_STEPS):
        state, metrics = run["step"](state, batches.batch(i))
        losses.append(float(metrics["loss"]))
    return losses


def test_checkpoint_saved_at_pp2_resumes_at_pp1(pipelined_run, reference):
    # The saved tree does not depend on pp: the layer stack is [L, ...] whatever shards it.
    shapes = [jax.eval_shape(lambda s=s: init_state(s)).params for s in (pipelined_run["setup"], reference["setup"])]
    assert jax.tree.map(lambda a: a.shape, shapes[0]) == jax.tree.map(lambda a: a.shape, shapes[1])
    np.testing.assert_allclose(resume_losses(reference, pipelined_run["ckpt"]), reference["losses"][2:], rtol=1e-5)


def test_checkpoint_saved_at_pp1_resumes_at_pp2(pipelined_run, reference):
    np.testing.assert_allclose(resume_losses(pipelined_run, reference["ckpt"]), reference["losses"][2:], rtol=1e-5)


# --------------------------------------------------------------------------- the stages' order in the state


def in_order(tree, order: np.ndarray):
    """numpy: every `layers` leaf of a params-like tree with its p·v blocks in `order` (the model block at each
    position)."""
    return {k: jax.tree.map(lambda a: a.reshape(len(order), -1, *a.shape[1:])[order].reshape(a.shape), v)
            if k == "layers" else v for k, v in tree.items()}


def restored(setup, ckpt_dir):
    ckpt = Checkpointer(str(ckpt_dir), keep=2, async_save=False)
    state, step = restore_or_init(setup, ckpt)
    ckpt.close()
    assert step == 2
    return state


def test_permutation_between_orders():
    interleaved = stage_order("interleaved", 2, 2)
    assert list(interleaved) == [0, 2, 1, 3]
    assert list(permutation(np.arange(1), interleaved)) == [0, 2, 1, 3]
    assert list(permutation(interleaved, np.arange(1))) == [0, 2, 1, 3]  # its own inverse
    # dualpipe_v at pp=4 (8 blocks) from interleaved at pp=2 (4 blocks): through the model's order, 8 blocks
    dual = stage_order("dualpipe_v", 4, 2)
    assert list(dual) == [0, 7, 1, 6, 2, 5, 3, 4]
    perm = permutation(interleaved, dual)
    halves = np.array([[2 * b, 2 * b + 1] for b in interleaved]).reshape(-1)  # the model block at each position
    assert list(halves[perm]) == list(dual)


def test_interleaved_state_keeps_the_stages_order_and_moves_between_orders(reference, tmp_path):
    """Initialized at interleaved pp=2, and a one-device checkpoint restored there, the state holds each stage's
    chunks on it (the parameters and the optimizer's moments); saved from there (with its order) and restored at
    pp=1 it is the one-device state bit for bit, and a reader (evaluate, generate, export) gets the model's order;
    restored at dualpipe_v pp=4 its stack is in that schedule's order; the eval loss is the one device's."""
    want = jax.device_get(restored(reference["setup"], reference["ckpt"]))
    setup = make_setup(tiny_config(*SMALL, *CASES["interleaved-v2-pp2-fsdp4-zero2"]), 8)
    assert list(setup.layers_order) == [0, 2, 1, 3]
    init = jax.device_get(init_state(setup).params)  # drawn as on one device, then put in the stages' order
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(in_order(reference["params"][0], setup.layers_order))):
        np.testing.assert_array_equal(a, b)
    state = restored(setup, reference["ckpt"])
    got = jax.device_get(state)
    order = setup.layers_order
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(in_order(want.params, order))):
        np.testing.assert_array_equal(a, b)
    mu = [x for x in jax.tree.leaves(got.opt_state) if getattr(x, "ndim", 0) >= 1 and x.shape[0] == 8]
    mu_want = [x for x in jax.tree.leaves(want.opt_state) if getattr(x, "ndim", 0) >= 1 and x.shape[0] == 8]
    assert mu and all(np.array_equal(a, b.reshape(4, 2, *b.shape[1:])[order].reshape(b.shape))
                      for a, b in zip(mu, mu_want))
    assert not np.array_equal(mu[0], mu_want[0]), "the moments must move with their layers"

    batch = make_batches(reference["setup"], "eval").batch(0)
    one = make_eval_step(reference["setup"])(reference["params"][2], batch)
    staged = make_eval_step(setup)(state.params, make_batches(setup, "eval").batch(0))
    np.testing.assert_allclose([float(x) for x in staged], [float(x) for x in one], rtol=1e-5)

    save(tmp_path / "pp2", state, setup)
    back = jax.device_get(restored(reference["setup"], tmp_path / "pp2"))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    reader = Checkpointer(str(tmp_path / "pp2"), keep=2, async_save=False)  # evaluate, generate, export
    params, _ = reader.restore_params_verified(2, abstract_params(setup), fall_back=False)  # on the pp=2 mesh
    reader.close()
    for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(a, b)  # the model's order
    dual = make_setup(tiny_config(*SMALL, *CASES["dualpipe_v-pp4-tp2"]), 8)
    params = jax.device_get(restored(dual, tmp_path / "pp2").params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(in_order(want.params, dual.layers_order))):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- memory


def test_pools_grow_with_stages_not_microbatches():
    """The program's message pool and stash: 1F1B's are fixed by p once m >= 2p, AFAB's grow with m. (With
    F and B in lanes of their own, stage s holds up to 2(p-s)-1 chunks in flight; stage 0's inputs are the
    tokens.)"""
    for p in (2, 4, 8):
        tables = {m: tick_tables(make_schedule("1f1b", p, m)) for m in (2 * p, 4 * p, 8 * p)}
        slots = {m: t.n_slots for m, t in tables.items()}
        stash = {m: t.n_stash_slots for m, t in tables.items()}
        assert len(set(slots.values())) == 1 and slots[2 * p] <= 2 * p, slots
        assert set(stash.values()) == {2 * p - 1}, stash  # stage 0's peak in flight
        afab = tick_tables(make_schedule("afab", p, 8 * p))
        assert afab.n_slots >= 8 * p and afab.n_stash_slots == 8 * p


def temp_bytes(overrides: list[str], n_devices: int) -> tuple[int, int]:
    """Compiled temporary memory of the pipelined gradient function (AOT, nothing runs), and the
    bytes of one pool slot: one microbatch's [b, T, D] activation on a device."""
    setup = make_setup(tiny_config(*overrides), n_devices)
    shapes = jax.eval_shape(lambda: init_state(setup))
    params = abstract_state(setup.state_shardings, shapes).params
    compiled = jax.jit(make_grad_fn(setup)).lower(params, setup.abstract_batch()).compile()
    c = setup.cfg
    slot = setup.micro_batch * c.data.seq_len * c.model.d_model * 4
    return compiled.memory_analysis().temp_size_in_bytes, slot


def test_1f1b_temp_memory_does_not_grow_with_microbatches():
    # 2 rows per microbatch whatever m; the pool dominates so a change of a few slots shows.
    base = ["model.n_layers=4", "model.d_model=64", "data.seq_len=32", "mesh.pp=2", "mesh.fsdp=1"]

    def run(kind, m):
        return temp_bytes(base + [f"pipeline.schedule={kind}", f"train.grad_accum={m}",
                                  f"train.global_batch={2 * m}"], 2)

    (f8, slot), (f32, _), (a32, _) = run("1f1b", 8), run("1f1b", 32), run("afab", 32)
    assert abs(f32 - f8) < 2 * slot, (f8, f32, slot)
    # AFAB holds all 32 microbatches' stage inputs: the measure does see the pool.
    assert a32 - f32 > 20 * slot, (a32, f32, slot)
