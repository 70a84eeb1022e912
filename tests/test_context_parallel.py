"""Context parallelism (ring attention over cp) and Ulysses (all-to-all over sp) compute what one
device computes, on 8 simulated devices: fp32 losses over 3 steps (rtol 1e-5) in every case (the first step
only with the interpreted Pallas kernels), and
first-step gradients (1e-5 of each tensor's largest entry) in the three that span the data movement
(the zig-zag ring, Ulysses inside the ring with tp, and the ring under fsdp+tp+SP with ZeRO-3).

The cases are combined so that every required feature appears at least once without compiling a
run per combination: cp 2/4/8, sp 2/4, cp x sp x tp, cp with fsdp, tp, Megatron SP and ZeRO-3,
both cp_impl, both layouts, the Pallas kernels (interpret mode), grad_accum=2. Every case masks
documents, so one single-device reference serves them all.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from helpers import assert_grads_close, first_gradients, make_setup, single_device, tiny_config
from meshtrain.config import ConfigError, validate
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step

STEPS = 3
EOS = 71  # the synthetic corpus's most frequent token: a third of the rows hold a document boundary
# Every case masks documents, on half the tiny model's batch (8 rows, 2 to 8 on each device): the interpreted
# Pallas kernels launch a program per row of a device's shard, and the other cases cost the same whatever the batch.
DATA = ("data.document_mask=true", f"data.eos_id={EOS}", "train.global_batch=8")

CASES = {
    "cp2_fsdp4_zero3": ("mesh.cp=2", "mesh.fsdp=4", "train.zero_stage=3"),
    "cp4_dp2": ("mesh.cp=4", "mesh.dp=2", "mesh.fsdp=1"),
    "cp4_dp2_contiguous": ("mesh.cp=4", "mesh.dp=2", "mesh.fsdp=1", "parallel.cp_layout=contiguous"),
    "cp8_allgather_accum2": ("mesh.cp=8", "mesh.fsdp=1", "parallel.cp_impl=allgather", "train.grad_accum=2"),
    "sp2_fsdp4": ("mesh.sp=2", "mesh.fsdp=4"),
    "sp4_fsdp2": ("mesh.sp=4", "mesh.fsdp=2"),
    "cp2_sp2_tp2": ("mesh.cp=2", "mesh.sp=2", "mesh.tp=2", "mesh.fsdp=1"),
    "cp2_fsdp2_tp2_seqpar_zero3": ("mesh.cp=2", "mesh.fsdp=2", "mesh.tp=2", "parallel.sequence_parallel=true",
                                   "train.zero_stage=3"),
    "cp2_fsdp2_tp2_pallas": ("mesh.cp=2", "mesh.fsdp=2", "mesh.tp=2", "model.attention=pallas"),
}
GRADIENT_CASES = ("cp2_fsdp4_zero3", "cp2_sp2_tp2", "cp2_fsdp2_tp2_seqpar_zero3")
ONE_STEP_CASES = ("cp2_fsdp2_tp2_pallas",)  # interpreted kernels run slowly on the CPU: the first step's loss


def run(setup, grads: bool, n_steps: int = STEPS):
    """Losses of n steps, the first-step gradients if asked, and the compiled step's HLO text."""
    batches = make_batches(setup)
    state = init_state(setup)
    compiled = make_train_step(setup).lower(state, batches.batch(0)).compile()
    losses = []
    for i in range(n_steps):
        state, m = compiled(state, batches.batch(i))
        losses.append(float(m["loss"]))
    return {"losses": losses, "grads": first_gradients(setup) if grads else None, "hlo": compiled.as_text()}


class Runs(dict):
    """Each run computed on first use and shared by every test of the module."""

    def __missing__(self, name):
        if name == "reference":
            self[name] = run(make_setup(single_device(tiny_config(*DATA)), 1), grads=True)
        else:
            self[name] = run(make_setup(tiny_config(*CASES[name], *DATA), 8), grads=name in GRADIENT_CASES,
                             n_steps=1 if name in ONE_STEP_CASES else STEPS)
        return self[name]


@pytest.fixture(scope="module")
def runs():
    return Runs()


def test_reference_learns_on_documents(runs):
    """Equal losses prove little unless the reference learns and its batches hold document boundaries."""
    segment_ids = make_batches(make_setup(single_device(tiny_config(*DATA)), 1)).local_fields(0)["segment_ids"]
    assert (segment_ids.max(axis=1) > 0).any(), "no row holds a document boundary"
    losses = runs["reference"]["losses"]
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_device(case, runs):
    ref, got = runs["reference"], runs[case]
    if case in GRADIENT_CASES:
        assert_grads_close(got["grads"], ref["grads"])
    np.testing.assert_allclose(got["losses"], ref["losses"][:len(got["losses"])], rtol=1e-5)


def test_zigzag_and_contiguous_layouts_give_the_same_loss(runs):
    zig = make_batches(make_setup(tiny_config(*CASES["cp4_dp2"], *DATA), 8)).local_fields(0)["tokens"]
    con = make_batches(make_setup(tiny_config(*CASES["cp4_dp2_contiguous"], *DATA), 8)).local_fields(0)["tokens"]
    assert not np.array_equal(zig, con), "the two layouts must order the sequence differently"
    np.testing.assert_allclose(runs["cp4_dp2"]["losses"], runs["cp4_dp2_contiguous"]["losses"], rtol=1e-5)


COLLECTIVE = re.compile(r"= \S+ (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(kind, instruction line) of every collective in an HLO module text."""
    return [(m.group(1), line) for line in hlo.splitlines() if (m := COLLECTIVE.search(line))]


def test_ring_program_moves_kv_by_collective_permutes_over_cp_only(runs):
    setup = make_setup(tiny_config(*CASES["cp4_dp2"], *DATA), 8)
    found = collectives(runs["cp4_dp2"]["hlo"])
    kinds = {k for k, _ in found}
    assert "collective-permute" in kinds
    assert not kinds & {"all-gather", "all-to-all", "reduce-scatter"}, kinds  # only grad all-reduces besides
    # Every permute sends from cp rank i to cp rank i+1 of the same ring (partition id = flat mesh index).
    coords = {i: np.unravel_index(i, setup.mesh.devices.shape) for i in range(8)}
    cp_dim = setup.mesh.axis_names.index("cp")
    for _, line in found:
        if "collective-permute" not in line:
            continue
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
        assert len(pairs) == 8
        for a, b in pairs:
            ca, cb = list(coords[a]), list(coords[b])
            assert (ca[cp_dim] + 1) % 4 == cb[cp_dim], line
            ca[cp_dim] = cb[cp_dim] = 0
            assert ca == cb, f"permute crosses a non-cp axis: {line}"
    # The all-gather variant does gather over cp: the check above can fail.
    assert "all-gather" in {k for k, _ in collectives(runs["cp8_allgather_accum2"]["hlo"])}


def _problems(*overrides: str, devices: int = 8) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(*overrides), devices)
    assert all("\n" not in p for p in err.value.problems)
    return err.value.problems


@pytest.mark.parametrize("overrides, expected", [
    (("mesh.cp=2", "mesh.sp=2", "mesh.fsdp=2", "data.seq_len=12"),
     r"^data.seq_len=12: must be divisible by 2\*mesh.cp\*mesh.sp = 8; choose a multiple of 8$"),
    (("mesh.cp=2", "mesh.tp=2", "mesh.fsdp=2", "parallel.sequence_parallel=true", "data.seq_len=12"),
     r"^data.seq_len=12: must be divisible by 2\*mesh.cp\*mesh.sp\*mesh.tp \(sequence_parallel\) = 8"),
    (("mesh.sp=8", "mesh.fsdp=1"), r"^model.n_heads=4: must be divisible by mesh.tp\*mesh.sp = 8 .* lower mesh.sp$"),
    (("mesh.sp=4", "mesh.fsdp=2", "model.n_heads=12", "model.n_kv_heads=3", "model.head_dim=16"),
     r"^model.n_kv_heads=3: with mesh.tp\*mesh.sp = 4 it must be a multiple or a divisor of 4 .* change mesh.sp"),
    (("mesh.cp=2", "mesh.fsdp=4", "model.attention=cudnn"),
     r"^model.attention=cudnn cannot run with the sequence split \(mesh.cp=2, mesh.sp=1\).* use model.attention=pallas"),
    (("mesh.pp=2", "mesh.cp=4", "mesh.fsdp=1", "train.grad_accum=2"),
     r"^mesh.pp=2 with mesh.cp=4 and parallel.cp_impl=ring: inside a pipeline stage the ring runs on two ranks "
     r"only; set mesh.cp=2 or parallel.cp_impl=allgather$"),
])
def test_config_errors(overrides, expected):
    problems = _problems(*overrides)
    assert any(re.search(expected, p) for p in problems), problems


def test_valid_layouts_pass_validation():
    for overrides in CASES.values():
        validate(tiny_config(*overrides, *DATA), 8)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_blockwise_backward_with_merged_rows_equals_autodiff(impl):
    """Two key blocks: merging the forward partials and running each block's backward with the merged
    (o, lse) gives the gradients of attention over all keys (the identity the ring's backward uses)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from meshtrain.parallel.sequence.block import BlockAttention, merge

    b, t, s, h, kv, e = 2, 16, 32, 4, 2, 16
    keys = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(keys[0], (b, t, h, e))
    k, v = (jax.random.normal(kk, (b, s, kv, e)) for kk in keys[1:3])
    do = jax.random.normal(keys[3], (b, t, h, e))
    q_seg = jax.random.randint(keys[4], (b, t), 0, 2)
    kv_seg = jax.random.randint(keys[5], (b, s), 0, 2).at[:, :2].set(jnp.array([0, 1]))
    q_pos, kv_pos = jnp.full((b, t), s), jnp.broadcast_to(jnp.arange(s), (b, s))  # every key in the past
    full = lambda q, k, v: pk.flash_attention_reference(q, k, v, causal=False, segment_ids=(q_seg, kv_seg))  # noqa
    o_ref, vjp = jax.vjp(full, q, k, v)
    dq_ref, dk_ref, dv_ref = vjp(do)

    blk = BlockAttention(impl, document_mask=True, interpret=True)
    halves = [slice(0, s // 2), slice(s // 2, s)]
    parts = [blk.forward(q, k[:, i], v[:, i], q_pos, q_seg, kv_pos[:, i], kv_seg[:, i], causal=False) for i in halves]
    o, lse = merge(*parts[0], *parts[1])
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    grads = [blk.backward(q, k[:, i], v[:, i], q_pos, q_seg, kv_pos[:, i], kv_seg[:, i], o, lse, do, causal=False)
             for i in halves]
    np.testing.assert_allclose(grads[0][0] + grads[1][0], dq_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([grads[0][1], grads[1][1]], axis=1), dk_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([grads[0][2], grads[1][2]], axis=1), dv_ref, rtol=1e-4, atol=1e-5)


def test_block_attention_passes_its_kernel_backend_to_both_directions():
    """model.attention_kernel reaches the ring's blocks: Mosaic asked for in interpret mode is refused
    by the forward and by the backward alike (and triton runs)."""
    import jax.numpy as jnp

    from meshtrain.parallel.sequence.block import BlockAttention

    q = jnp.ones((1, 16, 2, 16), jnp.float32)
    pos, seg = jnp.broadcast_to(jnp.arange(16), (1, 16)), jnp.zeros((1, 16), jnp.int32)
    mosaic = BlockAttention("pallas", document_mask=False, interpret=True, backend="mosaic")
    with pytest.raises(ValueError, match="backend='mosaic' cannot run here"):
        mosaic.forward(q, q, q, pos, seg, pos, seg, causal=True)
    lse = jnp.zeros((1, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="backend='mosaic' cannot run here"):
        mosaic.backward(q, q, q, pos, seg, pos, seg, q, lse, q, causal=True)
    triton = BlockAttention("pallas", document_mask=False, interpret=True, backend="triton")
    o, _ = triton.forward(q, q, q, pos, seg, pos, seg, causal=True)
    np.testing.assert_allclose(o, q, rtol=1e-6)  # v is all ones: every row averages ones
