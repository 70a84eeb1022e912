"""The model with its Pallas kernels switched on (interpret mode on the CPU) computes what the jnp
model computes on one device: the first step's loss and gradients (the interpreted kernels run slowly on
the CPU), on sharded meshes where each device runs the kernel on its own shard. fp32 compute; the kernels
reorder sums (online softmax), hence rtol 1e-4."""
import jax
import numpy as np
import pytest

from helpers import flatten, make_setup, single_device, tiny_config
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import init_state, make_batches

KERNELS = ["model.attention=pallas", "model.norm=pallas", "model.loss=fused"]
# The interpreter's cost grows with the programs a kernel launches, one per few rows of a device's shard: half
# the tiny model's batch, still 2 or more rows on every device (attention's grid keeps 2+ programs over the
# batch; the norm's, 4+ over rows), and a sequence of one whole attention tile as before (16, no padding).
SHAPE = ["train.global_batch=8"]


def first_step(setup) -> tuple[float, dict]:
    """(mean loss, mean-over-tokens gradients) of the first batch at the initial parameters."""
    state = init_state(setup)
    grads, loss_sum, n, _, _ = jax.jit(make_grad_fn(setup))(state.params, make_batches(setup).batch(0))
    return float(loss_sum / n), jax.tree.map(lambda g: np.asarray(g) / float(n), grads)


@pytest.fixture(scope="module")
def reference():
    return first_step(make_setup(single_device(tiny_config(*SHAPE)), 1))


@pytest.mark.parametrize("layout", [
    ["mesh.fsdp=2", "mesh.tp=4", "train.zero_stage=3"],  # kv heads replicated over tp: one per shard
    ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "parallel.sequence_parallel=true"],
], ids=["fsdp2_tp4", "dp2_fsdp2_tp2_sp"])
def test_kernels_match_reference_model(layout, reference):
    ref_loss, ref_grads = reference
    loss, grads = first_step(make_setup(tiny_config(*SHAPE, *layout, *KERNELS), 8))
    got = flatten(grads)
    for name, want in flatten(ref_grads).items():
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-4)


@pytest.mark.parametrize("layout", [
    ["mesh.cp=2", "mesh.fsdp=2", "mesh.tp=2"],  # tokens split over cp (zig-zag): each device sums its own
    ["mesh.sp=2", "mesh.dp=2", "mesh.tp=2"],
], ids=["cp2_fsdp2_tp2", "sp2_dp2_tp2"])
def test_fused_loss_matches_reference_model_over_the_sequence_axes(layout, reference):
    """The fused loss's per-device sums, one [1, 1] block a device, add up to the one-device loss and gradients
    where the sequence, not only the batch, is split."""
    ref_loss, ref_grads = reference
    loss, grads = first_step(make_setup(tiny_config(*SHAPE, *layout, "model.loss=fused"), 8))
    got = flatten(grads)
    for name, want in flatten(ref_grads).items():
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-4)
