"""The collective table: every collective of a compiled step, named by the mesh axes it runs over.

XLA prints who talks to whom as partition ids (positions in the mesh's flattened device grid), in
several formats; each is expanded to explicit groups and mapped back to axis names:

    {{0,2},{1,3}}                                  explicit groups
    [4,2]<=[8]   [4,2]<=[4,2]T(1,0)                iota: arange(8).reshape(4,2).T -> 4 groups of 2
    mesh['axis_0'=4,'axis_1'=2] {'axis_1'}         a mesh of the program's own, groups along axis_1
      (optionally `device_ids=([2,2,2]T(1,0,2))`: that mesh's ids are this iota, not arange)
    source_target_pairs={{0,1},{1,0}}              collective-permute

A group's axes are the mesh axes along which its members' coordinates differ: `{0,2}` on a
dp=2 x fsdp=2 x tp=2 mesh differ in fsdp only, so the op runs over `fsdp`; a group spanning dp and
fsdp runs over `dp,fsdp`.

Rows are (op, axes, phase); count and bytes are per step (a collective inside the scanned layer
stack runs once per layer). bytes is the collective's buffer per device, as nccl-tests count
"size": all-gather its gathered result, the others their operand. Phase comes from the op's
metadata: inside `transpose(jvp(...))` it is backward, inside `jvp(...)` forward, in the pipeline
executor's own scope (its messages between stages, the stack's permutation, the sum of the shared
parameters' gradients over pp) pipeline, elsewhere the optimizer update (gradient clipping's norm,
ZeRO's parameter gather after the sharded update).

Backends differ: the CPU compiler leaves a reduce-scatter as an all-reduce whose result each
device slices to its shard; such an all-reduce is reported as the reduce-scatter it is.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from meshtrain.planning.hlo import Instr, Module, bytes_of, dims_of, multipliers
from meshtrain.step.pipeline.ticks import TRANSFER_SCOPE

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
PHASES = ("forward", "backward", "pipeline", "optimizer")


@dataclass(frozen=True)
class Collective:
    op: str
    axes: str  # "fsdp", "dp,fsdp", ...; "" for a collective over a single device
    count: int  # per step
    bytes: int  # per device per step, summed over the count
    phase: str

    def to_json(self) -> dict:
        return asdict(self)


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def replica_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """Explicit groups of partition ids from an instruction's attribute text; None if it has none."""
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = _ints(m.group(1))
        return _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
                  r"(?:\s*\{([^}]*)\})?", attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3) or "")
    m = re.search(r"replica_groups=\{(.*?)\}(?:,|$)", attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1) + "}")]
        groups = [g for g in groups if g]
        return groups or [list(range(n_devices))]
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [_ints(p) for p in re.findall(r"\{([\d,]+)\}", m.group(1) + "}")]
    return None


def _mesh_groups(axes_text: str, device_ids: str | None, selected: str) -> list[list[int]]:
    names = re.findall(r"'([^']+)'=(\d+)", axes_text)
    sizes = [int(n) for _, n in names]
    if device_ids and device_ids.startswith("["):
        dm = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids)
        grid = _iota(_ints(dm.group(1)), _ints(dm.group(2)) if dm.group(2) else None).reshape(sizes)
    elif device_ids:
        grid = np.array(_ints(device_ids)).reshape(sizes)
    else:
        grid = np.arange(int(np.prod(sizes))).reshape(sizes)
    # Split sub-axes ('axis_0':(k)n: the n-sized middle factor of an axis) into their own dims.
    dims, keep = [], []
    picked = {a: (int(k) if k else None, int(n) if n else None)
              for a, k, n in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", selected)}
    for name, size in zip([a for a, _ in names], sizes):
        if name in picked and picked[name][0] is not None:
            k, n = picked[name]
            dims += [k, n, size // (k * n)]
            keep += [False, True, False]
        else:
            dims.append(int(size))
            keep.append(name in picked)
    grid = grid.reshape(dims)
    group_axes = [i for i, k in enumerate(keep) if k]
    other = [i for i, k in enumerate(keep) if not k]
    size = int(np.prod([dims[i] for i in group_axes])) if group_axes else 1
    return grid.transpose(other + group_axes).reshape(-1, size).tolist()


def axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """Mesh axes along which members of a group differ, in mesh order (e.g. 'dp,fsdp')."""
    sizes = list(mesh_shape.values())
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g), sizes)).T  # [members, axes]
        varying |= {i for i in range(len(sizes)) if len(set(coords[:, i])) > 1}
    return ",".join(a for i, a in enumerate(mesh_shape) if i in varying)


def phase_of(op_name: str) -> str:
    if TRANSFER_SCOPE in op_name:
        return "pipeline"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "optimizer"


def _base_op(op: str) -> str | None:
    base = op[:-len("-start")] if op.endswith("-start") else op
    return base if base in OPS else None


def _elems(shape: str) -> int:
    return int(np.prod(dims_of(shape))) if "[" in shape else 0


def _sliced_to_shard(value: str, group_size: int, mod: Module, seen: int = 0) -> bool:
    """True when every use of `value` keeps 1/group_size of it through a dynamic-slice (possibly
    inside a fusion, behind bitcasts or tuple element reads)."""
    users = mod.users.get(value, [])
    if not users or seen > 8:
        return False
    total = _elems(mod.by_name[value].shape) if value in mod.by_name else 0
    for u in users:
        if u.op in ("bitcast", "copy", "convert", "get-tuple-element") and _sliced_to_shard(u.name, group_size, mod, seen + 1):
            continue
        if u.op == "dynamic-slice" and u.operands[0] == value and _elems(u.shape) * group_size == total:
            continue
        if u.op == "fusion" and (callee := u.attr("calls")):
            body = mod.computations.get(callee, [])
            if all(i.op in ("parameter", "convert", "bitcast", "copy") for i in body) and \
                    _sliced_to_shard(u.name, group_size, mod, seen + 1):
                continue  # a dtype cast (bf16 gradients) between the reduction and the slice
            params = {i.name: int(i.args) for i in mod.computations.get(callee, []) if i.op == "parameter"}
            slots = [k for k, o in enumerate(u.operands) if o == value]
            inner = [p for p, k in params.items() if k in slots]
            if inner and all(_sliced_to_shard(p, group_size, mod, seen + 1) for p in inner):
                continue
        return False
    return True


def collectives(mod: Module, mesh_shape: dict[str, int]) -> list[Collective]:
    """The step's collective table, rows merged by (op, axes, phase)."""
    mult = multipliers(mod)
    n_devices = int(np.prod(list(mesh_shape.values())))
    rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for comp, times in mult.items():
        for ins in mod.computations[comp]:
            op = _base_op(ins.op)
            if op is None:
                continue
            groups = replica_groups(ins.attrs, n_devices) or [list(range(n_devices))]
            size = max(len(g) for g in groups)
            operand_bytes = sum(bytes_of(mod.by_name[o].shape) for o in ins.operands if o in mod.by_name)
            if op == "all-gather":
                nbytes = operand_bytes * size
            else:
                nbytes = operand_bytes
            if op == "all-reduce" and size > 1 and _reduces_to_shard(ins, size, mod):
                op = "reduce-scatter"
            key = (op, axes_of(groups, mesh_shape), phase_of(ins.op_name))
            rows[key][0] += times
            rows[key][1] += times * nbytes
    return sorted((Collective(op, axes, c, b, ph) for (op, axes, ph), (c, b) in rows.items()),
                  key=lambda r: (OPS.index(r.op), r.axes, PHASES.index(r.phase)))


def _reduces_to_shard(ins: Instr, size: int, mod: Module) -> bool:
    if ins.shape.startswith("("):  # a combined all-reduce: every element read and sliced
        reads = [u for u in mod.users.get(ins.name, []) if u.op == "get-tuple-element"]
        return bool(reads) and len(reads) == len(mod.users.get(ins.name, [])) and \
            all(_sliced_to_shard(r.name, size, mod) for r in reads)
    return _sliced_to_shard(ins.name, size, mod)

