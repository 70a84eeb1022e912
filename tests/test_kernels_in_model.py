"""The model with its Pallas kernels switched on (interpret mode on the CPU) computes what the jnp
model computes on one device: loss and gradients, on sharded meshes where each device runs the kernel
on its own shard. fp32 compute; the kernels reorder sums (online softmax), hence rtol 1e-4."""
import numpy as np
import pytest

from helpers import first_gradients, flatten, make_setup, single_device, tiny_config, train_losses

KERNELS = ["model.attention=pallas", "model.norm=pallas", "model.loss=fused"]


@pytest.fixture(scope="module")
def reference():
    setup = make_setup(single_device(tiny_config()), 1)
    return train_losses(setup, 2), first_gradients(setup)


@pytest.mark.parametrize("layout", [
    ["mesh.fsdp=2", "mesh.tp=4", "train.zero_stage=3"],  # kv heads replicated over tp: one per shard
    ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "parallel.sequence_parallel=true"],
], ids=["fsdp2_tp4", "dp2_fsdp2_tp2_sp"])
def test_kernels_match_reference_model(layout, reference):
    ref_losses, ref_grads = reference
    setup = make_setup(tiny_config(*layout, *KERNELS), 8)
    got = flatten(first_gradients(setup))
    for name, want in flatten(ref_grads).items():
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
    np.testing.assert_allclose(train_losses(setup, 2), ref_losses, rtol=1e-4)
