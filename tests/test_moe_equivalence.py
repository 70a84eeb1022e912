"""An MoE model over expert parallelism, alone, with the sequence split over cp or sp, and in pipeline
stages, computes what one device computes (fp32, dropless): losses of 3 steps to rtol 1e-5, first-step gradients to 1e-5 of each
tensor's largest entry.

One model covers the cases together, to keep compilations few: 4 layers with an MoE FFN in every
second one (`moe.every=2`: a scan over groups of a dense and an MoE block), a shared expert, the
auxiliary and z losses on, documents masked, and 2 accumulated microbatches. The single device runs the
experts without any exchange; the layouts run the all-gather exchange (`moe.dispatch=auto`), one the padded
all-to-all. Capacity mode is compared with room for every token (capacity_factor = experts / top-k: an
expert can take all of a device's tokens): its capacity is per device, so with drops the dropped set
would depend on the layout.
"""
import jax
import numpy as np
import pytest

from helpers import flatten, make_setup, single_device, tiny_config
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step

EOS = 71  # the synthetic corpus's most frequent token: a third of the rows hold a document boundary
MOE = ["model.n_layers=4", "moe.n_experts=8", "moe.top_k=2", "moe.d_ff_expert=32", "moe.every=2", "moe.n_shared=1",
       "moe.aux_loss_coef=0.1", "moe.z_loss_coef=0.01", "train.grad_accum=2", "data.document_mask=true",
       f"data.eos_id={EOS}"]
LAYOUTS = {
    "ep2_cp2_dp2": ["mesh.ep=2", "mesh.cp=2", "mesh.dp=2", "mesh.fsdp=1"],
    "ep2_sp2_tp2_padded": ["mesh.ep=2", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=1", "moe.dispatch=padded"],
    "ep2_fsdp2_tp2_zero3": ["mesh.ep=2", "mesh.fsdp=2", "mesh.tp=2", "train.zero_stage=3"],
    "ep4_cp2_capacity": ["mesh.ep=4", "mesh.cp=2", "mesh.fsdp=1", "moe.capacity_factor=4.0"],
    # the experts inside pipeline stages (1F1B): each chunk's aux losses and metrics join the step's
    "pp2_ep2_tp2": ["mesh.pp=2", "mesh.ep=2", "mesh.tp=2", "mesh.fsdp=1"],
    "pp2_ep2_tp2_capacity": ["mesh.pp=2", "mesh.ep=2", "mesh.tp=2", "mesh.fsdp=1", "moe.capacity_factor=4.0"],
}
STEPS = 3


def run(setup):
    """(first-step mean gradients, losses and moe metrics of STEPS steps), from one initialization."""
    batches = make_batches(setup)
    state = init_state(setup)
    grads, _, n, _, _ = jax.jit(make_grad_fn(setup))(state.params, batches.batch(0))
    grads = jax.tree.map(lambda g: np.asarray(g) / float(n), grads)
    step = make_train_step(setup)
    records = []
    for i in range(STEPS):
        state, m = step(state, batches.batch(i))
        records.append({k: float(v) for k, v in m.items() if k == "loss" or k.startswith("moe_")})
    return grads, records


@pytest.fixture(scope="module")
def reference():
    return run(make_setup(single_device(tiny_config(*MOE)), 1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_single_device(layout, reference):
    ref_grads, ref_records = reference
    setup = make_setup(tiny_config(*MOE, *LAYOUTS[layout]), 8)
    grads, records = run(setup)
    flat, flat_ref = flatten(grads), flatten(ref_grads)
    assert flat.keys() == flat_ref.keys()
    assert any("/moe/" in k for k in flat) and any("/shared/" in k for k in flat) and any("/mlp/" in k for k in flat)
    for name, want in flat_ref.items():
        scale = float(np.max(np.abs(want)))
        assert scale > 0, f"{name}: reference gradient is all zeros; the comparison would prove nothing"
        np.testing.assert_allclose(flat[name], want, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    assert ref_records[-1]["loss"] < ref_records[0]["loss"] - 0.1, "the reference must learn"
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in ref_records], rtol=1e-5, err_msg=key)
    assert all(r["moe_dropped"] == 0.0 for r in records)
