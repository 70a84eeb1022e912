"""Pipeline schedules as data: which op each pipeline stage runs, in which order, and when.

The layer stack is cut into p·v chunks (p stages, v chunks per stage), numbered by virtual
stage j. Megatron's interleaved assignment (every kind but dualpipe_v) gives stage s the virtual
stages j = chunk·p + s, so activations go round the stages v times; DualPipeV folds the stack
into a V (chunk 1 of stage s is 2p-1-s), so activations go down the stages and come back up:

    interleaved, p=4, v=2                        dualpipe_v, p=4
    stage:     0    1    2    3                  stage:     0    1    2    3
    chunk 0:   j0 → j1 → j2 → j3 ─┐              chunk 0:   j0 → j1 → j2 → j3 ─┐
    chunk 1:┌→ j4 → j5 → j6 → j7  │              chunk 1:   j7 ← j6 ← j5 ← j4 ←┘ (on stage 3)
            └─────────────────────┘  (stage p-1 → stage 0)

F of j reads the output of F of j-1; B of j the input grad from B of j+1 (the last virtual
stage: its own F, which computed the loss); W its own B.

Ops: F forward; B backward (only the input grad when the schedule splits the backward); W the
weight grad of a split backward. Each op is placed on two clocks, both as early as the stage's
order and the op's inputs allow:
  - start/end, in cost units (F=1, B=2; or F=B=W=1 when split): the timeline of a runtime whose
    stages run freely and whose transfers are free. bubble_ratio is measured on it.
  - tick, the lockstep step of the SPMD executor: at every tick each stage runs at most one op,
    then collective permutes move each output one stage on, to the stage holding its reader
    (activations forward and gradients back, cyclically; both ways for the V), so an op may
    only use what was produced at a strictly earlier tick, on its own stage too.

1F1B, p=4, m=8, one column per tick (`python -m meshtrain.schedule --schedule 1f1b --pp 4`):

    stage 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
    stage 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
    stage 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

The two clocks agree when every op costs 1 (zb_h1, dualpipe_v). Otherwise a tick lasts as long
as its slowest op, so the executor's time is lockstep_makespan = Σ_tick max_stage cost ≥ makespan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

# The kinds and the argument rules are the config's (pure Python, below this floor); they are part of this
# module's API too: the command and the tests take them from here with the builders.
from meshtrain.config.pipeline import KINDS, Kind, validate_args  # noqa: F401
from meshtrain.step.pipeline import builders
SPLIT_KINDS = frozenset({"zb_h1", "dualpipe_v"})  # backward split into B (input grad) and W


class ScheduleError(ValueError):
    """A schedule that cannot be built from these arguments, or that breaks a dependency."""


def op_costs(split_backward: bool) -> dict[str, int]:
    return {"F": 1, "B": 1, "W": 1} if split_backward else {"F": 1, "B": 2}


def virtual_stage(kind: str, n_stages: int, stage: int, chunk: int) -> int:
    """Which slice of the layer stack (of p·v) a stage's chunk holds: chunk·p + stage, except
    DualPipeV's V, where chunk 1 runs back up the stages (stage s holds s and 2p-1-s)."""
    if kind == "dualpipe_v" and chunk == 1:
        return 2 * n_stages - 1 - stage
    return chunk * n_stages + stage


def stage_and_chunk(kind: str, n_stages: int, j: int) -> tuple[int, int]:
    """The inverse of virtual_stage."""
    if kind == "dualpipe_v" and j >= n_stages:
        return 2 * n_stages - 1 - j, 1
    return j % n_stages, j // n_stages


@dataclass(frozen=True)
class Op:
    kind: Literal["F", "B", "W"]
    microbatch: int
    chunk: int  # the stage's model chunk, 0..v-1; see virtual_stage()
    stage: int
    start: float  # cost units
    end: float
    tick: int  # lockstep step


@dataclass(frozen=True)
class Schedule:
    kind: str
    n_stages: int
    n_microbatches: int
    virtual_stages: int
    split_backward: bool
    ops: tuple[tuple[Op, ...], ...]  # per stage, in execution order

    def virtual_stage(self, op: Op) -> int:
        return virtual_stage(self.kind, self.n_stages, op.stage, op.chunk)

    def grid(self) -> list[tuple[Op | None, ...]]:
        """[tick][stage]: the op each stage runs at that tick, or None when it idles."""
        rows: list[list[Op | None]] = [[None] * self.n_stages for _ in range(self.n_ticks)]
        for stage_ops in self.ops:
            for op in stage_ops:
                rows[op.tick][op.stage] = op
        return [tuple(r) for r in rows]

    @property
    def n_ticks(self) -> int:
        return 1 + max((op.tick for stage_ops in self.ops for op in stage_ops), default=-1)

    @property
    def makespan(self) -> float:
        """End of the last op, in cost units."""
        return max((op.end for stage_ops in self.ops for op in stage_ops), default=0.0)

    def makespan_in(self, cost: Callable[[str, int], float]) -> float:
        """The free-running makespan with each op (kind, virtual stage j) lasting cost(kind, j) instead of
        op_costs: the same orders, each op as early as its inputs and its stage allow."""
        orders = tuple(tuple((op.kind, op.microbatch, op.chunk) for op in stage_ops) for stage_ops in self.ops)
        placed = _place(orders, self.kind, self.n_stages, self.virtual_stages, self.split_backward, cost)
        return max((op.end for stage_ops in placed for op in stage_ops), default=0.0)

    @property
    def lockstep_makespan(self) -> float:
        """Σ over ticks of the slowest op of the tick: the cost-unit time of the tick executor."""
        costs = op_costs(self.split_backward)
        return float(sum(max((costs[op.kind] for op in row if op is not None), default=0)
                         for row in self.grid()))

    @property
    def bubble_ratio(self) -> float:
        """Idle time / busy time over all stages, each stage counted from 0 to the makespan."""
        busy = sum(op.end - op.start for stage_ops in self.ops for op in stage_ops)
        return (self.n_stages * self.makespan - busy) / busy

    @property
    def peak_in_flight(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) forward activations held at once, counted from
        F until B, in units of one chunk's activations for one microbatch (1/v of the stage's
        layers). B frees what the input grad needs; a split schedule's W still needs the chunk's
        layer inputs and output grads: peak_in_flight_w counts those. Transfer buffers of the
        executor are not counted."""
        return [_peak(stage_ops, "B") for stage_ops in self.ops]

    @property
    def peak_in_flight_w(self) -> list[int]:
        """As peak_in_flight, but held from F until the weight grad is done (W, or B when the
        backward is not split)."""
        return [_peak(stage_ops, "W" if self.split_backward else "B") for stage_ops in self.ops]


def _peak(stage_ops: tuple[Op, ...], freed_by: str) -> int:
    held = peak = 0
    for op in stage_ops:
        if op.kind == "F":
            held += 1
            peak = max(peak, held)
        elif op.kind == freed_by:
            held -= 1
    return peak


def _inputs(kind: str, microbatch: int, j: int, n_virtual: int) -> tuple[tuple[str, int, int], ...]:
    """The ops, as (kind, microbatch, virtual stage), whose outputs this op reads."""
    if kind == "F":
        return (("F", microbatch, j - 1),) if j > 0 else ()
    if kind == "B":  # the last virtual stage starts the backward from its own forward (the loss)
        return (("B", microbatch, j + 1),) if j < n_virtual - 1 else (("F", microbatch, j),)
    return (("B", microbatch, j),)


# --------------------------------------------------------------------------- building


def make_schedule(kind: Kind, n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build, time and check a schedule; raises ScheduleError for arguments it cannot take."""
    problems = validate_args(kind, n_stages, n_microbatches, virtual_stages)
    if problems:
        raise ScheduleError("; ".join(problems))
    p, m, v = n_stages, n_microbatches, virtual_stages
    orders = {
        "afab": lambda: builders.afab(p, m),
        "1f1b": lambda: builders.one_f_one_b(p, m),
        "interleaved": lambda: builders.interleaved(p, m, v),
        "zb_h1": lambda: builders.zb_h1(p, m),
        "dualpipe_v": lambda: builders.dualpipe_v(p, m),
    }[kind]()
    split = kind in SPLIT_KINDS
    schedule = Schedule(kind, p, m, v, split, _place(orders, kind, p, v, split))
    check_schedule(schedule)  # a builder bug must not reach the executor
    return schedule


def _place(orders: builders.Orders, kind: str, p: int, v: int, split: bool,
           cost: Callable[[str, int], float] | None = None) -> tuple[tuple[Op, ...], ...]:
    """Place each stage's ops in order, each as early as its inputs and its stage allow, on
    both clocks. `cost(kind, virtual stage)`: an op's length in time (default: op_costs).
    Raises ScheduleError if the orders deadlock (every stage waits on another)."""
    costs = op_costs(split)
    cost = cost or (lambda op_kind, j: costs[op_kind])
    done: dict[tuple[str, int, int], Op] = {}
    placed: list[list[Op]] = [[] for _ in range(p)]
    total = sum(len(o) for o in orders)
    while len(done) < total:
        progressed = False
        for s in range(p):
            while len(placed[s]) < len(orders[s]):
                op_kind, mb, chunk = orders[s][len(placed[s])]
                j = virtual_stage(kind, p, s, chunk)
                inputs = [done.get(key) for key in _inputs(op_kind, mb, j, p * v)]
                if None in inputs:
                    break
                prev = placed[s][-1] if placed[s] else None
                start = max([prev.end if prev else 0.0] + [i.end for i in inputs])
                tick = max([prev.tick + 1 if prev else 0] + [i.tick + 1 for i in inputs])
                op = Op(op_kind, mb, chunk, s, float(start), float(start + cost(op_kind, j)), tick)
                placed[s].append(op)
                done[(op_kind, mb, j)] = op
                progressed = True
        if not progressed:
            waiting = [orders[s][len(placed[s])] for s in range(p) if len(placed[s]) < len(orders[s])]
            raise ScheduleError(f"the stage orders deadlock; next ops waiting: {waiting}")
    return tuple(tuple(stage_ops) for stage_ops in placed)


# --------------------------------------------------------------------------- checking


def _name(op: Op, s: Schedule) -> str:
    return (f"{op.kind} of microbatch {op.microbatch}, chunk {op.chunk} on stage {op.stage} "
            f"(virtual stage {s.virtual_stage(op)}, tick {op.tick}, time {op.start:g}-{op.end:g})")


def check_schedule(s: Schedule) -> None:
    """Prove `s` runnable: every (microbatch, virtual stage) gets F, B (and W when split) exactly
    once on the stage that holds it; each op starts after its inputs end and at a strictly later
    tick; a stage runs its ops one at a time on both clocks. Raises ScheduleError on the first
    violation, naming the op."""
    p, m, v = s.n_stages, s.n_microbatches, s.virtual_stages
    if len(s.ops) != p:
        raise ScheduleError(f"{len(s.ops)} stage op lists for n_stages={p}")
    if s.kind == "dualpipe_v" and v != 2:  # its V layout has exactly two arms
        raise ScheduleError(f"dualpipe_v with virtual_stages={v}; it has 2")
    costs = op_costs(s.split_backward)
    by_key: dict[tuple[str, int, int], Op] = {}
    for stage, stage_ops in enumerate(s.ops):
        prev = None
        for op in stage_ops:
            if op.stage != stage:
                raise ScheduleError(f"{_name(op, s)} is listed under stage {stage}")
            if op.kind not in costs or not 0 <= op.microbatch < m or not 0 <= op.chunk < v:
                raise ScheduleError(f"{_name(op, s)}: no such op in a schedule of m={m}, v={v}, "
                                    f"split_backward={s.split_backward}")
            if op.end - op.start != costs[op.kind] or op.start < 0 or op.tick < 0:
                raise ScheduleError(f"{_name(op, s)}: must last {costs[op.kind]} unit(s) from time >= 0, "
                                    f"at tick >= 0")
            if prev is not None and (op.start < prev.end or op.tick <= prev.tick):
                raise ScheduleError(f"{_name(op, s)} overlaps or precedes the stage's previous op, "
                                    f"{_name(prev, s)}")
            key = (op.kind, op.microbatch, s.virtual_stage(op))
            if key in by_key:
                raise ScheduleError(f"{_name(op, s)} runs twice (also {_name(by_key[key], s)})")
            by_key[key] = op
            prev = op
    for key in ((k, mb, j) for k in costs for mb in range(m) for j in range(p * v)):
        if key not in by_key:
            kind, mb, j = key
            stage, chunk = stage_and_chunk(s.kind, p, j)
            raise ScheduleError(f"{kind} of microbatch {mb} on virtual stage {j} (stage {stage}, "
                                f"chunk {chunk}) never runs")
    for (kind, mb, j), op in by_key.items():
        for key in _inputs(kind, mb, j, p * v):
            src = by_key[key]
            if src.end > op.start or src.tick >= op.tick:
                raise ScheduleError(f"{_name(op, s)} reads the output of {_name(src, s)}, which is "
                                    f"not ready: it must end by the op's start and run at an earlier tick")
