"""Every parallel layout computes what one device computes: losses over 5 steps and gradients.

fp32 compute, so the only differences are the order of floating-point reductions across devices:
losses agree to rtol 1e-5, gradients to 1e-5 of each tensor's largest entry.
"""
import numpy as np
import pytest

from helpers import assert_grads_close, first_gradients, make_setup, single_device, tiny_config, train_losses

LAYOUTS = {
    "dp8": ["mesh.dp=8", "mesh.fsdp=1"],
    "fsdp8_zero1": ["mesh.fsdp=8", "train.zero_stage=1"],
    "fsdp8_zero2": ["mesh.fsdp=8", "train.zero_stage=2"],
    "fsdp8_zero3": ["mesh.fsdp=8", "train.zero_stage=3"],
    "fsdp2_tp4": ["mesh.fsdp=2", "mesh.tp=4", "train.zero_stage=3"],
    "fsdp4_tp2_sp": ["mesh.fsdp=4", "mesh.tp=2", "parallel.sequence_parallel=true", "train.zero_stage=3"],
    "dp2_fsdp2_tp2": ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.zero_stage=2"],
    # tp + SP with the collectives as shard_map rings (parallel/tensor.py)
    "fsdp4_tp2_sp_ring": ["mesh.fsdp=4", "mesh.tp=2", "parallel.sequence_parallel=true", "train.zero_stage=3",
                          "parallel.tp_overlap=collective_matmul"],
    "dp2_tp4_sp_ring": ["mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "parallel.sequence_parallel=true",
                        "parallel.tp_overlap=collective_matmul"],
}


@pytest.fixture(scope="module")
def reference():
    cfg = single_device(tiny_config())
    setup = make_setup(cfg, 1)
    return train_losses(setup, 5), first_gradients(setup)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device(layout, reference):
    ref_losses, ref_grads = reference
    setup = make_setup(tiny_config(*LAYOUTS[layout]), 8)
    assert setup.mesh.devices.size == 8
    assert_grads_close(first_gradients(setup), ref_grads)
    losses = train_losses(setup, 5)
    assert ref_losses[-1] < ref_losses[0] - 0.1, "the reference run must learn, or equal losses prove little"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_grad_accum_matches_big_batch():
    """4 microbatches of 4 sequences == one batch of 16 (normalized by the step's total tokens)."""
    base = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"]
    big = train_losses(make_setup(tiny_config(*base, "train.grad_accum=1"), 8), 5)
    accum = train_losses(make_setup(tiny_config(*base, "train.grad_accum=2"), 8), 5)
    accum4 = train_losses(make_setup(tiny_config("mesh.fsdp=2", "mesh.tp=4", "train.grad_accum=4"), 8), 5)
    np.testing.assert_allclose(accum, big, rtol=1e-5)
    np.testing.assert_allclose(accum4, big, rtol=1e-5)
