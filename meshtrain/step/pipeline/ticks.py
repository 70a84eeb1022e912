"""A schedule compiled into the program the pipeline executor runs: constant tables indexed by
(tick, stage, lane). Pure Python and numpy: everything the executor decides per tick is decided here.

The executor is lockstep (one SPMD program): a tick ends with collective permutes, and lasts as long
as its slowest stage. Running the schedule's ops one per tick wastes the difference whenever F and
B cost differently and neighbouring stages are in opposite phases (1F1B's steady state: one stage
runs F while the next runs B, so every tick lasts a B). So a tick has lanes:

    lanes = 2 (1f1b, interleaved, F=1 B=2):  lane 0 runs an F, lane 1 a B, one after the other;
            in the steady state every stage runs one F and one B per tick, so no tick waits.
    lanes = 3 (zb_h1, dualpipe_v, B split into B and W):  lane 0 an F, lane 1 a B (or a W, where
            no B runs), lane 2 a W, in that order; a W may follow its own B in the same tick.
    lanes = 1 (afab): one op per tick; it runs all F, then all B.

The split schedules' ops do not cost alike (executor_op_units): the last chunk's F and B run as one op of
2 units (its W apart, 1), the first chunk's backward is all W (2). One op per tick, as their schedules place
them, every tick lasts its slowest stage's op, and at pp=2 and 8 microbatches that program took 1.21x
1F1B's time (2x H100, llama1b, when the last chunk's op also held its W). In three lanes a steady tick
holds a stage's F, B and W, 3 units on every stage, as 1F1B's ticks do. What the lanes gain over 1F1B is
the cool-down: a W waits behind the ops its schedule puts before it (ZB-H1 defers the last stage's W by
a B, and its last Ws to the end), so the ticks that carry the last microbatch's input gradient down the
stages hold one B and a deferred W each instead of a B with its own W; and since nothing waits for a W,
a W that alone makes its tick longer than the stages without it moves to a later tick with room for it
(_fill_with_ws: lane 2 or an idle lane 1, no more pool or stash slots). zb_h1 costs 25 units where 1F1B
costs 27 at pp=2 and 8 microbatches, 28 against 33 at pp=4 (measured on two H200s: 179.9 against 186.1 ms
at pp=2). The rest of ZB-H1's advantage needs stages that run freely: at pp=4 its first ticks are paced by
the last stage's F+B while stage 0 runs one F a tick (27 units free-running). In the schedule's units
(F = B = W = 1) such a program costs at least the free-running makespan (`makespan` below).

Ops are placed as soon as possible, in the order of the schedule's free-running timeline: at the
first tick where the op's lane on its stage is free, its inputs exist (made at an earlier tick, or
earlier in the same tick on the same stage when nothing has to travel: the loss's B after its F,
a W after its B), the link its output leaves on is free, and, for a W, not before the op its stage's
order puts before it (where the schedule defers a W, so does the program); then Ws move into ticks with
room for them (above). With two lanes this starts
forwards earlier than the schedule's order would (stage s of 1F1B holds up to 2(p-s)-1 microbatches
instead of p-s); `peak_in_flight` says what the program holds, and the memory estimate reads it.
`makespan` is the program's time in the schedule's cost units (Σ over ticks of the slowest stage's
ops), comparable with the schedule's free-running makespan.

Each stage keeps one buffer pool of [b, T, D] slots for the two kinds of message it receives:
the input activation x of one of its chunks for one microbatch (what F reads; the last chunk's B
runs that chunk whole from it), and the gradient dy of that chunk's output (what B and W pull back).
A message occupies a slot from the end of the tick that sends it until the last op that reads it;
slots are assigned by interval colouring, so the pool holds as many slots as the most messages live
at once on any stage. The last slot is a trash slot: a receive with nothing to keep writes there, so
every store is an unconditional dynamic update. A second, larger pool, the stash, holds what F keeps
of a chunk (its pullback, ops.py) from F until its last reader (B, or W when split), coloured the
same way: `stash_slot` is where F writes it and B / W find it (split, the last chunk's B writes its sites'
inputs and output gradients there for its W).

    tick t, stage s, lane l:  op = kind[t, s, l] on (microbatch, chunk)[t, s, l], position first/mid/last,
                              reads pool[x_slot[t, s, l]], pool[dy_slot[t, s, l]], stash[stash_slot[t, s, l]];
                              yields one message
    end of tick t:  the output of lane up_lane[t, s]   ──ppermute +1──> s+1 keeps it in pool[from_below]
                    the output of lane down_lane[t, s] ──ppermute -1──> s-1 keeps it in pool[from_above]
                    the output of lane l               ──(self)───────> s   keeps it in pool[from_self[.., l]]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtrain.step.pipeline.schedules import Op, Schedule, _inputs, op_costs, stage_and_chunk

IDLE, F, B, W = 0, 1, 2, 3
KIND_CODE = {"F": F, "B": B, "W": W}
FIRST, MID, LAST = 0, 1, 2  # where the op's chunk sits in the model: embeds / plain / computes the loss
NO_LANE = -1  # up_lane / down_lane: nothing leaves on that link
LANES = {"1f1b": 2, "interleaved": 2, "zb_h1": 3, "dualpipe_v": 3}  # the kinds' lanes (module docstring); else 1
# The name scope of the executor's own collectives (messages between stages, the stack's permutation, the
# shared parameters' gradient sum); the inspector's collective table calls their phase "pipeline".
TRANSFER_SCOPE = "pipeline_transfer"


@dataclass(frozen=True)
class TickTables:
    """The executor's program (module docstring): [n_ticks, n_stages, n_lanes] op tables,
    [n_ticks, n_stages] link tables, and the pool size."""

    kind: np.ndarray
    position: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    x_slot: np.ndarray
    dy_slot: np.ndarray
    from_self: np.ndarray  # [T, S, L]
    up_lane: np.ndarray  # [T, S]
    down_lane: np.ndarray
    from_below: np.ndarray
    from_above: np.ndarray
    stash_slot: np.ndarray  # [T, S, L]: where F keeps a chunk's pullback and B / W find it
    n_slots: int  # live slots; the pool has one more (trash)
    n_stash_slots: int
    split_backward: bool

    @property
    def trash(self) -> int:
        return self.n_slots

    @property
    def n_ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def n_lanes(self) -> int:
        return self.kind.shape[2]

    def lane_tables(self) -> dict[str, np.ndarray]:
        """The [T, S, L] tables, by name."""
        return {k: getattr(self, k) for k in ("kind", "position", "microbatch", "chunk", "x_slot", "dy_slot",
                                              "from_self", "stash_slot")}

    def link_tables(self) -> dict[str, np.ndarray]:
        """The [T, S] tables, by name."""
        return {k: getattr(self, k) for k in ("up_lane", "down_lane", "from_below", "from_above")}

    def tick_costs(self) -> np.ndarray:
        """[T, S]: the cost units stage s is busy in tick t (F=1, B=2; or 1 each when split)."""
        costs = op_costs(self.split_backward)
        unit = np.zeros(4)
        for name, code in KIND_CODE.items():
            unit[code] = costs.get(name, 0)
        return unit[self.kind].sum(axis=2)

    @property
    def makespan(self) -> float:
        """The program's time in cost units: Σ over ticks of the busiest stage."""
        return float(self.tick_costs().max(axis=1).sum())

    @property
    def op_makespan(self) -> float:
        """The program's time in what its ops cost (`executor_op_units`), not in the schedule's units:
        Σ over ticks of the busiest stage."""
        units = np.vectorize(lambda kind, pos: executor_op_units(kind, pos, self.split_backward))
        return float(units(self.kind, self.position).sum(axis=2).max(axis=1).sum())

    @property
    def peak_in_flight(self) -> list[int]:
        """Per stage: the most microbatch chunks whose forward ran and whose B has not (as
        Schedule.peak_in_flight counts them, for the order this program runs)."""
        peaks = []
        for s in range(self.kind.shape[1]):
            held = peak = 0
            for t in range(self.n_ticks):
                for lane in range(self.n_lanes):  # lanes run in order within a tick
                    held += int(self.kind[t, s, lane] == F) - int(self.kind[t, s, lane] == B)
                    peak = max(peak, held)
            peaks.append(peak)
        return peaks


def executor_op_units(kind: int, position: int, split_backward: bool) -> int:
    """What an op of the executor (ops.py) costs, in units of a chunk's forward: the last chunk's F is folded
    into its B (forward and backward of the chunk: 3, or 2 when split; the head and loss come on top). A split B
    pulls back through its chunk for the input gradient and the sites' output gradients (1) and its W multiplies
    each site's kept input by its output gradient (1; weight_grads.py); the first chunk's split backward is all
    W (2), since nobody waits for its input gradient. Where these differ from the schedule's units (F=1, B=2,
    or 1 each when split), the program takes longer than its `makespan` says."""
    if kind == F:
        return 0 if position == LAST else 1
    if kind == B:
        if not split_backward:
            return 3 if position == LAST else 2
        return 2 if position == LAST else 0 if position == FIRST else 1
    if kind == W:
        return 2 if position == FIRST else 1
    return 0


def _position(j: int, n_virtual: int) -> int:
    """Where virtual stage j's chunk sits in the model: FIRST (embeds), LAST (computes the loss) or MID."""
    return FIRST if j == 0 else LAST if j == n_virtual - 1 else MID


def _op_units(s: Schedule, kind: str, j: int) -> int:
    """executor_op_units of op `kind` on virtual stage j of `s`."""
    return executor_op_units(KIND_CODE[kind], _position(j, s.n_stages * s.virtual_stages), s.split_backward)


def free_running_op_makespan(s: Schedule) -> float:
    """The schedule's free-running makespan (every stage runs its ops in order, each as soon as its inputs are
    made, transfers free) in what the executor's ops cost (`executor_op_units`) instead of the schedule's units:
    the time a runtime whose stages run freely would take for these ops, against which the lockstep program's
    `op_makespan` is measured."""
    return s.makespan_in(lambda kind, j: _op_units(s, kind, j))


@dataclass(frozen=True)
class _Placed:
    tick: int
    lane: int
    link: int  # +1, -1, 0 (kept on its stage) or None (sends nothing)


def tick_tables(s: Schedule, lanes: int | None = None) -> TickTables:
    """The executor's program for `s` (module docstring); `lanes` overrides the kind's choice."""
    lanes = lanes or LANES.get(s.kind, 1)
    placed = _place(s, lanes)
    if s.split_backward and lanes == 3:
        placed = _fill_with_ws(s, placed)
    return _tables(s, placed, lanes)


def _receiver(s: Schedule, kind: str, j: int) -> int | None:
    """The stage that op (kind, virtual stage j)'s message goes to, or None when it sends none."""
    n_virtual = s.n_stages * s.virtual_stages
    if kind == "F" and j < n_virtual - 1:
        return stage_and_chunk(s.kind, s.n_stages, j + 1)[0]
    if kind == "B" and j > 0:
        return stage_and_chunk(s.kind, s.n_stages, j - 1)[0]
    return None


def _place(s: Schedule, lanes: int) -> dict[tuple[str, int, int], _Placed]:
    """Each op (kind, microbatch, virtual stage) -> where the program runs it (module docstring)."""
    p, n_virtual = s.n_stages, s.n_stages * s.virtual_stages
    lane_of = {"F": 0, "B": min(1, lanes - 1), "W": lanes - 1}
    placed: dict[tuple[str, int, int], _Placed] = {}
    busy: set[tuple[int, int, int]] = set()  # (tick, stage, lane)
    links: set[tuple[int, int, int]] = set()  # (tick, sender, direction)
    lane_next: dict[tuple[int, int], int] = {}  # (stage, lane) -> first tick its next op may take
    before = {(b.kind, b.microbatch, s.virtual_stage(b)): (a.kind, a.microbatch, s.virtual_stage(a))
              for stage_ops in s.ops for a, b in zip(stage_ops, stage_ops[1:])}  # the op before, in its stage's order
    timeline: list[Op] = sorted((op for stage_ops in s.ops for op in stage_ops), key=lambda o: (o.start, o.stage))
    for op in timeline:
        j, lane = s.virtual_stage(op), lane_of[op.kind]
        tick = lane_next.get((op.stage, lane), 0)  # a lane runs its ops in the schedule's order
        for key in _inputs(op.kind, op.microbatch, j, n_virtual):
            local = key[0] == "F" and op.kind == "B" or op.kind == "W"  # read on this stage, not sent
            tick = max(tick, placed[key].tick + (0 if local else 1))
        if op.kind == "W" and (op.kind, op.microbatch, j) in before:
            # Where the schedule defers a W behind later ops (ZB-H1's cool-down), so does the program: the W then
            # shares a tick with those ops instead of lengthening its own B's tick.
            tick = max(tick, placed[before[op.kind, op.microbatch, j]].tick)
        receiver = _receiver(s, op.kind, j)
        while True:
            link = None if receiver is None else _link(p, op.stage, receiver, tick, links)
            if (tick, op.stage, lane) not in busy and link != "taken":
                break
            tick += 1
        busy.add((tick, op.stage, lane))
        if link in (1, -1):
            links.add((tick, op.stage, link))
        lane_next[(op.stage, lane)] = tick + 1
        placed[(op.kind, op.microbatch, j)] = _Placed(tick, lane, link)
    return placed


def _fill_with_ws(s: Schedule, placed: dict[tuple[str, int, int], _Placed]) -> dict[tuple[str, int, int], _Placed]:
    """Ws moved later where that shortens a tick and lengthens none (module docstring). A W sends nothing and
    nothing waits for it, so it may run any tick after its B; a tick lasts its busiest stage. Tick by tick: where
    every stage that sets the tick's length sets it only by its W, each of those Ws goes to the first later tick
    in which its stage has lane 2 or 1 free and room under that tick's length; its chunk's Ws then take their
    places in microbatch order. A move is kept only if it takes no more message or stash slots than the program had
    (a deferred W holds its dy and its stash entry longer)."""
    p, n_virtual = s.n_stages, s.n_stages * s.virtual_stages
    stage_of = {j: stage_and_chunk(s.kind, p, j)[0] for j in range(n_virtual)}

    def units(key: tuple[str, int, int]) -> int:
        return _op_units(s, key[0], key[2])

    def ws_by_tick(placed: dict) -> dict[int, dict[int, tuple[str, int, int]]]:
        """tick -> {stage: a W it runs then}"""
        ws_at: dict[int, dict[int, tuple[str, int, int]]] = {}
        for key, pl in placed.items():
            if key[0] == "W":
                ws_at.setdefault(pl.tick, {})[stage_of[key[2]]] = key
        return ws_at

    n_ticks = 1 + max(pl.tick for pl in placed.values())
    load = np.zeros((n_ticks, p), np.int64)  # [tick, stage]: what the stage runs that tick, in op units
    taken: set[tuple[int, int, int]] = set()  # (tick, stage, lane)
    for key, pl in placed.items():
        load[pl.tick, stage_of[key[2]]] += units(key)
        taken.add((pl.tick, stage_of[key[2]], pl.lane))
    budget = _slot_peaks(s, placed)
    ws_at = ws_by_tick(placed)
    for t in range(n_ticks):
        length = load[t].max()
        setters = [st for st in range(p) if load[t, st] == length]
        mine = ws_at.get(t, {})
        if length == 0 or any(st not in mine for st in setters):
            continue
        without = load[t] - np.array([units(mine[st]) if st in setters else 0 for st in range(p)])
        if without.max() >= length:
            continue
        trial, trial_load, moves = dict(placed), load.copy(), []
        for st in setters:
            key = mine[st]
            to = next(((t2, lane) for t2 in range(t + 1, n_ticks) for lane in (2, 1)
                       if (t2, st, lane) not in taken and trial_load[t2, st] + units(key) <= trial_load[t2].max()),
                      None)
            if to is None:
                break
            trial_load[t, st] -= units(key)
            trial_load[to[0], st] += units(key)
            trial[key] = _Placed(to[0], to[1], None)
            moves.append((key, st, to))
        else:
            trial = _ws_in_microbatch_order(trial, {key[2] for key, _, _ in moves})
            if all(n <= most for n, most in zip(_slot_peaks(s, trial), budget)):
                for key, st, (t2, lane) in moves:
                    taken.discard((t, st, placed[key].lane))
                    taken.add((t2, st, lane))
                placed, load, ws_at = trial, trial_load, ws_by_tick(trial)
    return placed


def _ws_in_microbatch_order(placed: dict[tuple[str, int, int], _Placed], chunks: set[int]
                            ) -> dict[tuple[str, int, int], _Placed]:
    """The Ws of each virtual stage in `chunks` given their places in microbatch order: fp8_delayed pushes a W's
    amaxes to its sites' histories as it runs, in the order one device's grad accumulation would. A W moved past
    a later microbatch's W of its chunk thus takes that one's place, which takes the next, and so on; the load of
    every tick stays what it was (one chunk's Ws cost alike), and every W still runs after its B (the Bs of a chunk
    run in microbatch order)."""
    placed = dict(placed)
    for j in chunks:
        mine = sorted(mb for kind, mb, jj in placed if kind == "W" and jj == j)
        spots = sorted((placed[("W", mb, j)] for mb in mine), key=lambda pl: (pl.tick, pl.lane))
        placed.update({("W", mb, j): spot for mb, spot in zip(mine, spots)})
    return placed


def _slot_peaks(s: Schedule, placed: dict[tuple[str, int, int], _Placed]) -> tuple[int, int]:
    """(message slots, stash slots) the program needs: the most messages, and the most stash entries, live at once
    on any stage (what _tables' interval colouring assigns)."""
    messages, stash = _lifetimes(s, placed)
    return _colour(messages, closed=False)[1], _colour(stash, closed=True)[1]


def _link(p: int, sender: int, receiver: int, tick: int, links: set) -> int | str:
    """The direction a message leaves on at this tick: 0 to itself, +1 or -1 to a neighbour (with two
    stages both neighbours are one: whichever link is free), or "taken" when its link is in use."""
    if receiver == sender:
        return 0
    for direction in (1, -1):
        if receiver == (sender + direction) % p and (tick, sender, direction) not in links:
            return direction
    if receiver not in ((sender + 1) % p, (sender - 1) % p):
        raise AssertionError(f"a message from stage {sender} to stage {receiver}, not a neighbour")
    return "taken"


Life = tuple[int, int, int]  # (stage, first tick, last tick) of a buffer


def _lifetimes(s: Schedule, placed: dict[tuple[str, int, int], _Placed]
               ) -> tuple[dict[tuple[str, int, int], Life], dict[tuple[int, int], Life]]:
    """When each buffer of the program lives, as (stage, first tick, last tick): every message (what, microbatch,
    virtual stage it is for) from the tick its sender runs (it arrives at that tick's end) to its last reader; every
    stash entry (microbatch, virtual stage) from its writer to its last reader, both included (F's lane runs before
    B's within a tick, so a slot B frees at tick t is free again at t + 1)."""
    p, n_virtual = s.n_stages, s.n_stages * s.virtual_stages
    sent: dict[tuple[str, int, int], tuple[str, int, int]] = {}
    used: dict[tuple[str, int, int], int] = {}
    for (kind, mb, j), pl in placed.items():
        if kind == "F" and j < n_virtual - 1:
            sent[("x", mb, j + 1)] = (kind, mb, j)
        if kind == "B" and j > 0:
            sent[("dy", mb, j - 1)] = (kind, mb, j)
        # F reads x; the last chunk's B runs that chunk whole from it (ops.py), the others' use the stash.
        if (kind == "F" or kind == "B" and j == n_virtual - 1) and j > 0:
            used[("x", mb, j)] = max(used.get(("x", mb, j), -1), pl.tick)
        if kind in ("B", "W") and j < n_virtual - 1:
            used[("dy", mb, j)] = max(used.get(("dy", mb, j), -1), pl.tick)
    assert sent.keys() == used.keys(), "every message is read, and every read message is sent"
    messages = {key: (stage_and_chunk(s.kind, p, key[2])[0], placed[sender].tick, used[key])
                for key, sender in sent.items()}

    # The stash holds the pullback of (microbatch, virtual stage j) before the last from its F; split, the last
    # chunk's B keeps its sites' inputs and output gradients there for its W.
    last_reader = "W" if s.split_backward else "B"

    def writer(j: int) -> str | None:
        return "F" if j < n_virtual - 1 else "B" if s.split_backward else None

    stash = {(mb, j): (stage_and_chunk(s.kind, p, j)[0], pl.tick, placed[(last_reader, mb, j)].tick)
             for (kind, mb, j), pl in placed.items() if kind == writer(j)}
    return messages, stash


def _colour(lives: dict[tuple, Life], closed: bool) -> tuple[dict[tuple, int], int]:
    """Interval colouring per stage, in the order the intervals start: key -> slot, and the slots the busiest
    stage needs. A (first, last] interval frees its slot for one that starts at `last`; a closed [first, last]
    one for one that starts after it."""
    slot, n_slots = {}, 0
    for stage in {life[0] for life in lives.values()}:
        free_at: list[int] = []  # per slot: the last tick it is taken
        for _, first, last, key in sorted((*life, key) for key, life in lives.items() if life[0] == stage):
            assert closed or last > first, f"{key} is read at tick {last}, not after it arrives at the end of {first}"
            idx = next((i for i, f in enumerate(free_at) if (f < first if closed else f <= first)), len(free_at))
            free_at[idx:idx + 1] = [last]
            slot[key] = idx
        n_slots = max(n_slots, len(free_at))
    return slot, n_slots


def _tables(s: Schedule, placed: dict[tuple[str, int, int], _Placed], lanes: int) -> TickTables:
    p, n_virtual = s.n_stages, s.n_stages * s.virtual_stages
    n_ticks = 1 + max(pl.tick for pl in placed.values())
    messages, stash_lives = _lifetimes(s, placed)
    slot, n_slots = _colour(messages, closed=False)
    stash, n_stash_slots = _colour(stash_lives, closed=True)
    trash = n_slots

    lane_shape, link_shape = (n_ticks, p, lanes), (n_ticks, p)
    kind, position, microbatch, chunk = (np.zeros(lane_shape, np.int32) for _ in range(4))
    x_slot, dy_slot, from_self = (np.full(lane_shape, trash, np.int32) for _ in range(3))
    stash_slot = np.zeros(lane_shape, np.int32)
    up_lane, down_lane = (np.full(link_shape, NO_LANE, np.int32) for _ in range(2))
    from_below, from_above = (np.full(link_shape, trash, np.int32) for _ in range(2))
    for (name, mb, j), pl in placed.items():
        st, ch = stage_and_chunk(s.kind, p, j)
        at = (pl.tick, st, pl.lane)
        kind[at], microbatch[at], chunk[at] = KIND_CODE[name], mb, ch
        position[at] = _position(j, n_virtual)
        x_slot[at] = slot.get(("x", mb, j), trash)
        dy_slot[at] = slot.get(("dy", mb, j), trash)
        stash_slot[at] = stash.get((mb, j), 0)
    for key in messages:
        sender_key = ("F", key[1], key[2] - 1) if key[0] == "x" else ("B", key[1], key[2] + 1)
        pl = placed[sender_key]
        sender = stage_and_chunk(s.kind, p, sender_key[2])[0]
        receiver = stage_and_chunk(s.kind, p, key[2])[0]
        if pl.link == 0:
            from_self[pl.tick, receiver, pl.lane] = slot[key]
        elif pl.link == 1:
            up_lane[pl.tick, sender], from_below[pl.tick, receiver] = pl.lane, slot[key]
        else:
            down_lane[pl.tick, sender], from_above[pl.tick, receiver] = pl.lane, slot[key]
    return TickTables(kind, position, microbatch, chunk, x_slot, dy_slot, from_self, up_lane, down_lane, from_below,
                      from_above, stash_slot, n_slots, n_stash_slots, s.split_backward)
