"""Pieces shared by the Mosaic GPU (Hopper) attention kernels: version shims, shared-memory specs,
the producer warpgroup's copy loop, and the consumers' bookkeeping around it.

Every kernel here runs 2 consumer warpgroups and 1 producer warpgroup per CTA:

  producer (wg 2, 24 registers)       consumer wg 0 / wg 1 (240 registers each)
  for step in [0, n):                 skip:  steps before my range: wait the data, release the slot
    slot = step % stages              work:  steps in my range: wait the data, wgmma, release
    wait slot released (step>=stages) tail:  steps after my range: wait the data, release the slot
    TMA gmem -> smem[slot], arrive

A slot is released by an arrive on its `consumed` barrier from each consumer (num_arrivals = 2).
A consumer waits on every data barrier of every step, even one it skips: Mosaic tracks each
barrier's phase per thread, so a skipped wait would put later waits a phase behind, and a consumer
that released slots without waiting could release the same slot twice in one phase.
"""
from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

N_CONSUMERS = 2
# FlashAttention-3's split of the 64K registers (2 x 128 x 240 + 128 x 24): the producer only issues
# TMA copies, and the dK/dV kernel's consumers spill even so at E = 128 (ptxas: 352 bytes at 240,
# 436 at 232, both under dq_atomic); on an H200 240/24 ran forward+backward level to 3% faster (2026-11-28).
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 24
ROWS_PER_WARPGROUP = 64  # the M of one Hopper wgmma
SMEM_BYTES = 227 * 1024  # shared memory a Hopper CTA may allocate

# `plgpu.load(ref, idx)` became `plgpu.load(ref.at[idx])`; newer jax warns when idx is passed.
_LOAD_TAKES_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load_vector(ref, layout):
    """A whole 1-D SMEM ref as an array in `layout`."""
    if _LOAD_TAKES_IDX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def owned_ids(ids_gmem, ids_smem, barrier):
    """A consumer's own segment ids (one per row of its tiles): TMA into SMEM, wait, load as ROW."""
    plgpu.copy_gmem_to_smem(ids_gmem, ids_smem, barrier)
    plgpu.barrier_wait(barrier)
    return load_vector(ids_smem, ROW)


ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile (e.g. a query's lse)
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a wgmma tile


def full(shape, value, layout=plgpu.Layout.WGMMA, dtype=jnp.float32):
    return plgpu.layout_cast(jnp.full(shape, value, dtype), layout)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def rows(vec, shape):
    """Broadcast a per-row vector over a tile."""
    return lax.broadcast_in_dim(vec, shape, [0])


def cols(vec, shape):
    """Broadcast a per-column vector over a tile."""
    return lax.broadcast_in_dim(vec, shape, [1])


def tile_mask(plan, q_start, k_start, shape, q_seg, k_seg, keys_on_rows: bool = False):
    """bool tile in the WGMMA layout, True = attend: causal (bottom-right), padded keys, segments.

    shape is [queries, keys], or [keys, queries] with keys_on_rows (the dK/dV kernel's transposed
    tiles); q_seg / k_seg are per-row or per-column vectors to match, or None.
    """
    q_dim, k_dim = (1, 0) if keys_on_rows else (0, 1)
    q_pos = iota(shape, q_dim) + q_start
    k_pos = iota(shape, k_dim) + k_start
    mask = k_pos < plan.s_real
    if plan.causal:
        mask = mask & (k_pos <= q_pos + plan.offset)
    if q_seg is not None:
        spread = (cols, rows) if keys_on_rows else (rows, cols)
        mask = mask & (spread[0](q_seg, shape) == spread[1](k_seg, shape))
    return mask


def tile_smem(shape, dtype):
    """SMEM for wgmma operands and TMA: 128-byte swizzled tiles of 8 rows x 128 bytes (the last dim
    must be a multiple of 128 bytes: 64 bf16 or 32 fp32 values)."""
    width = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(128)))


def compiler_params():
    # approx_math: exp2/log2/division use the fast hardware approximations, as FA3 does.
    return plgpu.CompilerParams(approx_math=True)


def check_smem(scratch, name: str, stages: tuple[str, int]) -> None:
    """Raise where the SMEM tiles of a kernel (a tuple of specs; None for one it does not use) pass
    what a Hopper SM has; barriers add a few bytes and are not counted. stages: the MosaicBlockSizes
    field that sizes the SMEM pipeline, and its value."""
    need = sum(math.prod(spec.shape) * jnp.dtype(spec.dtype).itemsize for spec in scratch if spec is not None)
    if need > SMEM_BYTES:
        field, value = stages
        raise ValueError(f"{name} needs {need / 1024:.0f} KiB of shared memory at MosaicBlockSizes.{field}={value}, "
                         f"more than the {SMEM_BYTES // 1024} KiB of a Hopper SM; lower {field}")


def launch(body, *, out_type, scratch_types, grid, grid_names, name: str, stages: tuple[str, int]):
    """A warp-specialized kernel: N_CONSUMERS + 1 warpgroups per CTA, axis "wg".

    `pl.kernel` over a `plgpu.Mesh`, with the scratch (SMEM, barriers) allocated by `run_scoped` and
    shared by the warpgroups, as `plgpu.kernel` does; unlike `plgpu.kernel` (whose vmap wrapper
    refuses them) it takes `jax.new_ref` inputs, which the kernel may write in place.
    scratch_types: [SMEM specs, barriers]; `stages`: the setting that sizes the SMEM pipeline (check_smem).
    """
    check_smem(scratch_types[0], name, stages)
    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=N_CONSUMERS + 1, thread_name="wg",
                      kernel_name=name)

    def with_scratch(*refs):
        pl.run_scoped(lambda *scratch: body(*refs, *scratch), *scratch_types, collective_axes="wg")

    return pl.kernel(with_scratch, out_type=out_type, mesh=mesh, compiler_params=compiler_params(), name=name)


def wgmma_accumulate(acc, a, b):
    """acc + a @ b, acc in registers (fp32, WGMMA layout)."""
    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(body)(plgpu.ACC.init(acc))


def producer_loop(n_steps, stages: int, groups):
    """The producer warpgroup. groups: [(released, copies)], in issue order; for each step and group,
    wait until the consumers released the slot (from the second round on), then copies(step, slot)
    issues that group's TMA copies, each arriving on its own data barrier. K and V are separate
    groups in the forward: K's slot frees after QK^T, V's only after PV.
    """
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @pl.loop(0, n_steps)
    def _(step):
        slot = lax.rem(step, stages)
        for released, copies in groups:
            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(released.at[slot])

            copies(step, slot)


def drain(lo, hi, stages: int, data_barriers, released, extra=None):
    """Steps [lo, hi) this consumer does not compute: wait their data, release their slots.

    extra(): called once per step (e.g. the forward's schedule-barrier rounds, which must pair up
    with the other consumer's).
    """
    def body(step, carry):
        slot = lax.rem(step, stages)
        for bar in data_barriers:
            plgpu.barrier_wait(bar.at[slot])
        if extra is not None:
            extra()
        for bar in released:
            plgpu.barrier_arrive(bar.at[slot])
        return carry
    lax.fori_loop(lo, hi, body, None)


def barriers(n: int, count: int, arrivals: int = 1) -> tuple:
    """`count` arrays of `n` barriers, each completing a phase after `arrivals` arrives (or one TMA)."""
    return tuple(plgpu.Barrier(num_arrivals=arrivals, num_barriers=n) for _ in range(count))


def is_hopper() -> bool:
    """Whether the default device is a Hopper GPU (sm_90), the only target these kernels lower for."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") in ("9.0", "9.0a")
