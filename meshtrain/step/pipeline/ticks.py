"""A schedule compiled into the constant tables the pipeline executor indexes by (tick, stage).

Pure Python and numpy: everything the executor decides per tick is decided here, once.

Each stage keeps one buffer pool of [b, T, D] slots for the two kinds of message it receives:
the input activation x of one of its chunks for one microbatch (what F reads, and what B and W
recompute the chunk from), and the gradient dy of that chunk's output (what B and W pull back).
A message occupies a slot from the end of the tick that sends it until the last op that reads it
(B, or W when the backward is split); slots are assigned by interval colouring, so the pool holds
as many slots as the most messages live at once on any stage: 1F1B's grows with p, not with m.
The last slot is a trash slot: a receive with nothing to keep writes there, so every store is an
unconditional dynamic update.

    tick t, stage s:   op = kind[t, s] on (microbatch[t, s], chunk[t, s]), position first/mid/last
                       reads pool[x_slot[t, s]], pool[dy_slot[t, s]]; outputs one message
    end of tick t:     out ──ppermute +1──> stage s+1 stores it in pool[from_below[t, s+1]]
                       out ──ppermute -1──> stage s-1 stores it in pool[from_above[t, s-1]]
                       out ──────(self)───> stage s   stores it in pool[from_self[t, s]]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtrain.step.pipeline.schedules import Schedule, stage_and_chunk

IDLE, F, B, W = 0, 1, 2, 3
KIND_CODE = {"F": F, "B": B, "W": W}
FIRST, MID, LAST = 0, 1, 2  # where the op's chunk sits in the model: embeds / plain / computes the loss


@dataclass(frozen=True)
class TickTables:
    """[n_ticks, n_stages] int32 tables (see the module docstring) and the pool size."""

    kind: np.ndarray
    position: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    x_slot: np.ndarray
    dy_slot: np.ndarray
    from_below: np.ndarray
    from_above: np.ndarray
    from_self: np.ndarray
    n_slots: int  # live slots; the pool has one more (trash)

    @property
    def trash(self) -> int:
        return self.n_slots

    @property
    def n_ticks(self) -> int:
        return self.kind.shape[0]

    def tables(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in ("kind", "position", "microbatch", "chunk", "x_slot", "dy_slot",
                                              "from_below", "from_above", "from_self")}


def tick_tables(s: Schedule) -> TickTables:
    p, n_virtual = s.n_stages, s.n_stages * s.virtual_stages
    grid = s.grid()
    n_ticks = len(grid)
    last_reader = "W" if s.split_backward else "B"

    # Every message: (what, microbatch, virtual stage it is for) -> (sender stage, tick, receiver stage).
    sent: dict[tuple[str, int, int], tuple[int, int, int]] = {}
    used: dict[tuple[str, int, int], int] = {}  # -> tick of the last op reading it
    for t, row in enumerate(grid):
        for op in row:
            if op is None:
                continue
            j = s.virtual_stage(op)
            if op.kind == "F" and j < n_virtual - 1:
                sent[("x", op.microbatch, j + 1)] = (op.stage, t, stage_and_chunk(s.kind, p, j + 1)[0])
            if op.kind == "B" and j > 0:
                sent[("dy", op.microbatch, j - 1)] = (op.stage, t, stage_and_chunk(s.kind, p, j - 1)[0])
            if op.kind == "F" or op.kind == last_reader:
                if j > 0:
                    used[("x", op.microbatch, j)] = max(used.get(("x", op.microbatch, j), -1), t)
            if op.kind in ("B", "W") and j < n_virtual - 1:
                used[("dy", op.microbatch, j)] = max(used.get(("dy", op.microbatch, j), -1), t)
    assert sent.keys() == used.keys(), "every message is read, and every read message is sent"

    # Interval colouring per stage: a message lives in (sent tick, last read tick].
    slot: dict[tuple[str, int, int], int] = {}
    n_slots = 0
    for stage in range(p):
        mine = sorted((sent[k][1], used[k], k) for k in sent if sent[k][2] == stage)
        free_at: list[int] = []  # per slot: the tick after which it is free again
        for arrive, last, key in mine:
            assert last > arrive, f"{key} is read at tick {last}, not after it arrives at the end of tick {arrive}"
            idx = next((i for i, f in enumerate(free_at) if f <= arrive), len(free_at))
            if idx == len(free_at):
                free_at.append(last)
            else:
                free_at[idx] = last
            slot[key] = idx
        n_slots = max(n_slots, len(free_at))
    trash = n_slots

    shape = (n_ticks, p)
    kind, position, microbatch, chunk = (np.zeros(shape, np.int32) for _ in range(4))
    x_slot, dy_slot, from_below, from_above, from_self = (np.full(shape, trash, np.int32) for _ in range(5))
    for t, row in enumerate(grid):
        for op in row:
            if op is None:
                continue
            st, j = op.stage, s.virtual_stage(op)
            kind[t, st], microbatch[t, st], chunk[t, st] = KIND_CODE[op.kind], op.microbatch, op.chunk
            position[t, st] = FIRST if j == 0 else LAST if j == n_virtual - 1 else MID
            x_slot[t, st] = slot.get(("x", op.microbatch, j), trash)
            dy_slot[t, st] = slot.get(("dy", op.microbatch, j), trash)
    for key, (sender, t, receiver) in sent.items():
        if receiver == sender:
            table = from_self
        elif receiver == (sender + 1) % p:  # with p = 2 both neighbours are one stage: take the +1 link
            table = from_below
        elif receiver == (sender - 1) % p:
            table = from_above
        else:
            raise AssertionError(f"{key} goes from stage {sender} to stage {receiver}, not a neighbour")
        assert table[t, receiver] == trash, f"two messages for stage {receiver} on one link at tick {t}"
        table[t, receiver] = slot[key]
    return TickTables(kind, position, microbatch, chunk, x_slot, dy_slot, from_below, from_above, from_self, n_slots)
