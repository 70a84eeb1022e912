"""A checkpoint of a one-device MoE run resumes in four pipeline stages (pp=4, experts over ep=2) and goes on as the
one device does: the losses and router metrics of the steps after it to rtol 1e-5 (fp32, dropless). And the other
way: a run in two stages (pp=2, experts over ep=2 and tp=2) saves, and one device resumes it and goes on as its own
run would.

The model is tests/test_pipeline.py's SMALL cut to 4 layers, each with an MoE FFN (one layer per stage), a shared
expert, and the auxiliary and z losses on (4 layers, not 8 with `moe.every=2`: the pp=4 step compiles in 3/4 of
the time). Both runs take 4 microbatches a step: the auxiliary losses are per microbatch, so one device must split the
batch alike. The saved layer stack is [L, ...] and its experts [E, ...] whatever shards them; the pp=4 run restores
them split over pp and ep, and its zero-bubble schedule (zb_h1) splits each stage's backward into B and W.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import make_setup, single_device, tiny_config
from meshtrain.checkpoint import Checkpointer
from meshtrain.resume import restore_or_init
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step
from test_pipeline import SMALL, save

MOE = ["model.n_layers=4", "moe.n_experts=4", "moe.top_k=2", "moe.d_ff_expert=32", "moe.n_shared=1",
       "moe.aux_loss_coef=0.1", "moe.z_loss_coef=0.01", "train.grad_accum=4"]
PP4 = ["pipeline.schedule=zb_h1", "mesh.pp=4", "mesh.ep=2", "mesh.fsdp=1"]
PP2 = ["pipeline.schedule=1f1b", "mesh.pp=2", "mesh.ep=2", "mesh.tp=2", "mesh.fsdp=1"]
N_STEPS, SAVED = 4, 2
KEYS = ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max")


def records(metrics) -> dict[str, float]:
    return {k: float(metrics[k]) for k in KEYS + ("moe_dropped",)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device, N_STEPS steps with a checkpoint of the state after SAVED: the steps' metrics and the directory."""
    setup = make_setup(single_device(tiny_config(*SMALL, *MOE)), 1)
    batches, state, step = make_batches(setup), init_state(setup), make_train_step(setup)
    ckpt_dir = tmp_path_factory.mktemp("moe_pp1") / "checkpoints"
    out = []
    for i in range(N_STEPS):
        if i == SAVED:
            save(ckpt_dir, state, setup)
        state, metrics = step(state, batches.batch(i))
        out.append(records(metrics))
    assert out[-1]["loss"] < out[0]["loss"] - 0.1, "the reference must learn, or equal losses prove little"
    return dict(records=out, ckpt=ckpt_dir, setup=setup, step=step)


def assert_same_records(got: list[dict], want: list[dict]) -> None:
    for key in KEYS:
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5, err_msg=key)
    assert all(r["moe_dropped"] == 0.0 for r in got + want)


@pytest.mark.slow  # the pp=4 MoE step compiles in 35-45 s on 2 CPU cores
def test_moe_checkpoint_saved_at_pp1_resumes_at_pp4(reference):
    setup = make_setup(tiny_config(*SMALL, *MOE, *PP4), 8)
    assert {a: setup.mesh.shape[a] for a in ("pp", "ep")} == {"pp": 4, "ep": 2}
    ckpt = Checkpointer(str(reference["ckpt"]), keep=2, async_save=False)
    state, resumed = restore_or_init(setup, ckpt)
    ckpt.close()
    assert resumed == SAVED
    batches, step, got = make_batches(setup), make_train_step(setup), []
    for i in range(SAVED, N_STEPS):
        state, metrics = step(state, batches.batch(i))
        got.append(records(metrics))
    assert_same_records(got, reference["records"][SAVED:])


@pytest.mark.slow  # the pp=2 MoE step compiles in ~20 s on 2 CPU cores
def test_moe_checkpoint_saved_at_pp2_resumes_at_pp1(reference, tmp_path):
    setup = make_setup(tiny_config(*SMALL, *MOE, *PP2), 8)
    assert {a: setup.mesh.shape[a] for a in ("pp", "ep", "tp")} == {"pp": 2, "ep": 2, "tp": 2}
    batches, state, step, got = make_batches(setup), init_state(setup), make_train_step(setup), []
    for i in range(SAVED):
        state, metrics = step(state, batches.batch(i))
        got.append(records(metrics))
    save(tmp_path, state, setup)
    one = reference["setup"]  # one device, its step already compiled
    ckpt = Checkpointer(str(tmp_path), keep=2, async_save=False)
    state, resumed = restore_or_init(one, ckpt)
    ckpt.close()
    assert resumed == SAVED
    batches = make_batches(one)
    for i in range(SAVED, N_STEPS):
        state, metrics = reference["step"](state, batches.batch(i))
        got.append(records(metrics))
    assert_same_records(got, reference["records"])
