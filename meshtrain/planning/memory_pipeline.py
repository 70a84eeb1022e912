"""What a pipeline stage keeps for its schedule (step/pipeline/executor.py), per device.

The executor runs the schedule as a scan over ticks. Its carry holds, per stage:

    stash      n_stash_slots x (what F's pullback keeps of one chunk for B: the remat policy's residuals of
               the chunk's k layers; for a split schedule also the tapped sites, and what the split pullback
               keeps more); slots are interval-coloured from F (the split last chunk: B) to the last reader
               (ticks.py)
    pool       the [b, T, D] messages in flight (small: one activation per slot, not per layer)
    weights    the stage's layer weights as the ops read them, a copy of the stored shard (split into chunks,
               exchanged between stages where the schedule holds chunks spread over the model)

XLA:CPU's buffer assignment holds every stash leaf twice: once in the carry, once as the result of the switch
that fills its slot (the peak's live buffers list each stash leaf as a `copy` beside a `cond{i}` of the same
size), so there the stash counts twice; XLA:GPU's holds it once (the 1.36B config at pp=2: 17.4 GiB measured).
The last chunk's B runs that chunk's forward too (head and loss included), so the stage also holds one chunk's
residuals while it runs, under pipeline.last_chunk_remat, as one computation keeps them (memory.py).
"""
from __future__ import annotations

import functools

from meshtrain.planning.layout import Layout
from meshtrain.step.pipeline.schedules import SPLIT_KINDS, ScheduleError, make_schedule
from meshtrain.step.pipeline.ticks import TickTables, tick_tables


@functools.lru_cache(maxsize=None)
def program(kind: str, pp: int, microbatches: int, virtual_stages: int) -> TickTables | None:
    """The program the executor runs for this schedule (ticks.py), or None where the schedule cannot run
    these arguments. Read by this module (what a stage holds) and by timing.py (how long the program takes)."""
    try:
        return tick_tables(make_schedule(kind, pp, microbatches, virtual_stages))
    except ScheduleError:
        return None


@functools.lru_cache(maxsize=None)
def _peak(kind: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[int, int]:
    """(peak in flight, stash slots: chunk-microbatches held from F to their last reader)."""
    ticks = program(kind, pp, microbatches, virtual_stages)
    if ticks is None:
        return microbatches, microbatches  # the schedule cannot run this; all forward, then all backward
    return max(ticks.peak_in_flight), ticks.n_stash_slots


def in_flight(lay: Layout) -> int:
    """Microbatches whose activations a stage holds at its peak, in the order the pipeline executor runs the
    schedule (step/pipeline/ticks.py)."""
    if lay.degrees["pp"] == 1:
        return 1
    return _peak(lay.schedule, lay.degrees["pp"], lay.grad_accum, lay.virtual_stages)[0]


def stash_slots(lay: Layout) -> int:
    return _peak(lay.schedule, lay.degrees["pp"], lay.grad_accum, lay.virtual_stages)[1]


def chunk_layers(n_layers: int, lay: Layout) -> float:
    return n_layers / (lay.degrees["pp"] * lay.virtual_stages)


def is_tapped(lay: Layout) -> bool:
    """Whether the stash's slots hold the tapped sites too: a split backward's middle and last chunks keep them
    for their W (step/pipeline/ops.py), and every slot has room for them."""
    return lay.schedule in SPLIT_KINDS


def stage_activation_bytes(n_layers: int, lay: Layout, kept_per_layer: float, split_per_layer: float,
                           last_kept_per_layer: float, stash_copies: int = 2) -> float:
    """The stash, `stash_copies` times (twice on XLA:CPU, module docstring; once on GPUs), and the last chunk's
    own forward (`last_kept_per_layer`: what a layer of it keeps under pipeline.last_chunk_remat, memory.py).
    `split_per_layer`: what a tapped layer keeps more per microbatch (memory_layer.split_backward_bytes)."""
    k = chunk_layers(n_layers, lay)
    stash = stash_slots(lay) * k * (kept_per_layer + (split_per_layer if is_tapped(lay) else 0.0))
    return stash_copies * stash + k * last_kept_per_layer
