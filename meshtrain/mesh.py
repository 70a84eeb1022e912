"""The device mesh: always the 7 named axes `pp, dp, fsdp, ep, cp, sp, tp`, outermost first.

Axis order is link order: the axes that talk least (pp, dp, fsdp: one collective per step or per
layer) are outermost and are the ones laid across hosts; cp, sp and tp talk inside every layer and
stay inside a host (NVLink). Unused axes have size 1, so every PartitionSpec may name any axis.

Multi-host: `initialize_distributed()` calls `jax.distributed.initialize` when the config or the
environment asks for it (explicit coordinator, JAX_* variables, or a multi-task SLURM job).
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from meshtrain.config import MESH_AXES, ConfigError, DistributedConfig

# Axes that may cross hosts, outermost first; the others must fit inside one process.
DCN_AXES = ("pp", "dp", "fsdp")


def initialize_distributed(dist: DistributedConfig) -> bool:
    """Start jax.distributed if this is one process of many. Returns True when it did.

    Must run before anything touches a device. SLURM is detected by jax itself when no coordinator
    is given; explicit config fields win over JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID.
    """
    coordinator = dist.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    num_processes = dist.num_processes or _env_int("JAX_NUM_PROCESSES", 0)
    process_id = dist.process_id if dist.process_id >= 0 else _env_int("JAX_PROCESS_ID", -1)
    in_slurm = _env_int("SLURM_NTASKS", 1) > 1 and "SLURM_JOB_ID" in os.environ
    if not coordinator and not in_slurm:
        if num_processes > 1:
            raise ConfigError(f"distributed.num_processes={num_processes} needs distributed.coordinator "
                              f"(host:port of process 0), or JAX_COORDINATOR_ADDRESS")
        return False
    if dist.cpu_collectives != "none":
        # CPU devices of different processes can only exchange data through gloo or MPI.
        jax.config.update("jax_cpu_collectives_implementation", dist.cpu_collectives)
    local_ids = [int(i) for i in dist.local_device_ids.split(",")] if dist.local_device_ids else None
    if coordinator:
        if num_processes < 1 or process_id < 0:
            raise ConfigError(f"distributed.coordinator={coordinator!r} needs distributed.num_processes and "
                              f"distributed.process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
        jax.distributed.initialize(coordinator, num_processes, process_id, local_device_ids=local_ids)
    else:
        jax.distributed.initialize(local_device_ids=local_ids)  # SLURM: jax reads the job's variables
    return True


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r}: must be an integer") from None


def split_across_hosts(degrees: dict[str, int], n_processes: int) -> tuple[list[int], list[int]]:
    """Split each degree into (within-host, across-host) factors; hosts take the slow axes first."""
    ici = [degrees[a] for a in MESH_AXES]
    dcn = [1] * len(MESH_AXES)
    left = n_processes
    for a in DCN_AXES:
        i = MESH_AXES.index(a)
        g = math.gcd(left, ici[i])
        dcn[i], ici[i], left = g, ici[i] // g, left // g
    if left != 1:
        raise ConfigError(
            f"mesh: {n_processes} processes must divide mesh.pp*mesh.dp*mesh.fsdp = "
            f"{degrees['pp'] * degrees['dp'] * degrees['fsdp']} (only those axes cross hosts); "
            f"raise dp or fsdp, or use fewer processes")
    return ici, dcn


def build_mesh(degrees: dict[str, int], devices: list | None = None) -> Mesh:
    """A Mesh with all 7 axes in MESH_AXES order. `devices` defaults to every visible device.

    Axis types are Auto on every axis: the compiler propagates shardings from the annotations
    (GSPMD), and the shard_map regions in parallel/ take the axes they need manually.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = [degrees[a] for a in MESH_AXES]
    if math.prod(shape) != len(devices):
        raise ConfigError(f"mesh: degrees {dict(zip(MESH_AXES, shape))} multiply to {math.prod(shape)} but "
                          f"{len(devices)} devices are given")
    n_processes = len({d.process_index for d in devices})
    if n_processes > 1:
        ici, dcn = split_across_hosts(degrees, n_processes)
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    else:
        grid = np.asarray(jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape),
                                        devices=devices).devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    used = [f"{a}={n}" for a, n in mesh.shape.items() if n > 1]
    return f"{' x '.join(used) or 'one device'} ({mesh.devices.size} {mesh.devices.flat[0].platform} devices, " \
           f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''})"
