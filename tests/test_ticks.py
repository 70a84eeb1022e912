"""The executor's program (step/pipeline/ticks.py), replayed without jax.

A symbolic replay of the tables moves labels instead of tensors: each lane's op must find in its
pool slots exactly the messages it reads (x of its chunk from the stage before, dy from the stage
after), delivered at an earlier tick and not overwritten since, and a B or W the pullback its F kept
in the stash, not overwritten since by another F; every op of the schedule runs once;
no link carries two messages. Then the program's time in cost units against the schedule's
free-running makespan: the point of the lanes.
"""
from __future__ import annotations

import json

import pytest

from meshtrain import schedule as cli
from meshtrain.step.pipeline.schedules import KINDS, make_schedule, stage_and_chunk
from meshtrain.step.pipeline.ticks import (FIRST, IDLE, KIND_CODE, LAST, MID, NO_LANE, W, _fill_with_ws, _place,
                                           _tables, free_running_op_makespan, tick_tables)

NAMES = {code: name for name, code in KIND_CODE.items()}
CASES = [(kind, p, m, 2 if kind in ("interleaved", "dualpipe_v") else 1)
         for kind in KINDS for p in (2, 4) for m in (8, 16)]


def replay(kind: str, p: int, m: int, v: int) -> None:
    """Run the tables on labels; raise AssertionError at the first op that would read the wrong thing."""
    s = make_schedule(kind, p, m, v)
    t = tick_tables(s)
    n_virtual = p * v
    pools = [[None] * (t.n_slots + 1) for _ in range(p)]
    stashes = [[None] * t.n_stash_slots for _ in range(p)]
    ran = set()
    for tick in range(t.n_ticks):
        outs = [[None] * t.n_lanes for _ in range(p)]
        for stage in range(p):
            for lane in range(t.n_lanes):
                code = int(t.kind[tick, stage, lane])
                if code == IDLE:
                    continue
                name, mb, chunk = NAMES[code], int(t.microbatch[tick, stage, lane]), int(t.chunk[tick, stage, lane])
                j = next(j for j in range(n_virtual) if stage_and_chunk(kind, p, j) == (stage, chunk))
                pos = int(t.position[tick, stage, lane])
                assert pos == (FIRST if j == 0 else LAST if j == n_virtual - 1 else MID)
                where = f"{name} mb{mb} j{j} at tick {tick}, stage {stage}, lane {lane}"
                last = j == n_virtual - 1
                if j > 0 and (name == "F" or name == "B" and last):  # the last chunk's B runs it from x
                    assert pools[stage][t.x_slot[tick, stage, lane]] == ("x", mb, j), where
                if name in ("B", "W") and not last:
                    assert stashes[stage][t.stash_slot[tick, stage, lane]] == (mb, j), where
                if name == "F" and not last:
                    stashes[stage][t.stash_slot[tick, stage, lane]] = (mb, j)
                if name in ("B", "W") and j < n_virtual - 1:
                    assert pools[stage][t.dy_slot[tick, stage, lane]] == ("dy", mb, j), where
                if name in ("B", "W"):  # the forward it differentiates ran (earlier, or earlier this tick)
                    assert ("F", mb, j) in ran, where
                if name == "W":
                    assert ("B", mb, j) in ran, where
                if name == "B" and j < n_virtual - 1:
                    assert ("B", mb, j + 1) in ran, where
                assert (name, mb, j) not in ran, f"{where} runs twice"
                ran.add((name, mb, j))
                if name == "F" and j < n_virtual - 1:
                    outs[stage][lane] = ("x", mb, j + 1)
                if name == "B" and j > 0:
                    outs[stage][lane] = ("dy", mb, j - 1)
        for stage in range(p):  # the end of the tick: links, then what each stage keeps of its own
            up, down = int(t.up_lane[tick, stage]), int(t.down_lane[tick, stage])
            sent = {lane for lane in range(t.n_lanes) if outs[stage][lane] is not None}
            links = {lane for lane in (up, down) if lane != NO_LANE}
            kept = {lane for lane in range(t.n_lanes) if t.from_self[tick, stage, lane] != t.trash}
            assert up == NO_LANE or up != down, f"one lane on both links at tick {tick}, stage {stage}"
            assert sent == links | kept, f"tick {tick}, stage {stage}: sent {sent}, routed {links | kept}"
            if up != NO_LANE:
                pools[(stage + 1) % p][t.from_below[tick, (stage + 1) % p]] = outs[stage][up]
            if down != NO_LANE:
                pools[(stage - 1) % p][t.from_above[tick, (stage - 1) % p]] = outs[stage][down]
            for lane in kept:
                pools[stage][t.from_self[tick, stage, lane]] = outs[stage][lane]
    every = {(k, mb, j) for k in (("F", "B", "W") if s.split_backward else ("F", "B"))
             for mb in range(m) for j in range(n_virtual)}
    assert ran == every


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_the_program_runs_every_op_once_on_what_it_reads(kind, p, m, v):
    replay(kind, p, m, v)


@pytest.mark.parametrize("kind", ["1f1b", "interleaved", "zb_h1"])
@pytest.mark.parametrize("m", [8, 16])
def test_the_program_costs_the_schedules_makespan(kind, m):
    """pp=4: the executor's time in cost units within 10% of the free-running makespan: equal for 1F1B and
    interleaved, one unit more for zb_h1 (28 against 27, 52 against 51)."""
    v = 2 if kind == "interleaved" else 1
    s = make_schedule(kind, 4, m, v)
    program = tick_tables(s)
    assert program.makespan <= 1.1 * s.makespan
    assert program.makespan == s.makespan + (1 if kind == "zb_h1" else 0)
    if kind != "zb_h1":  # where F and B differ in cost, one op per tick costs more: the lanes pay
        assert s.lockstep_makespan > 1.15 * s.makespan


@pytest.mark.parametrize("kind,v", [("zb_h1", 1), ("dualpipe_v", 2)])
@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_split_schedules_in_three_lanes_cost_at_most_1f1bs(kind, v, p, m):
    """In what the ops cost (executor_op_units), the three-lane program of a split schedule costs less than one op
    per tick and less than 1F1B's (dualpipe_v's in chunks of 1/v the stage: against v times 1F1B's units): the
    last chunk's W waits behind later ops where ZB-H1 defers it, and Ws move into ticks with room for them
    (_fill_with_ws), so the cool-down's ticks no longer wait for them (1F1B 27 -> zb_h1 25 at pp=2, 33 -> 28 and
    57 -> 52 at pp=4). In the schedule's units (F = B = W = 1) neither costs less than the free-running makespan."""
    s = make_schedule(kind, p, m, v)
    three, one = tick_tables(s), tick_tables(s, lanes=1)
    one_f_one_b = v * tick_tables(make_schedule("1f1b", p, m)).op_makespan
    assert three.n_lanes == 3 and three.op_makespan < one.op_makespan
    assert three.op_makespan < one_f_one_b
    assert three.makespan >= s.makespan


@pytest.mark.parametrize("kind,v", [("zb_h1", 1), ("dualpipe_v", 2)])
@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_ws_fill_ticks_with_room_and_take_no_more_slots(kind, v, p, m):
    """The program with its Ws moved (_fill_with_ws) against the same program without the move: fewer units, no
    more message or stash slots, every W still after its B (the replay above checks what each reads), and each
    chunk's Ws in microbatch order (fp8_delayed's histories take their amaxes in that order)."""
    s = make_schedule(kind, p, m, v)
    placed = _place(s, 3)
    filled, unfilled = tick_tables(s), _tables(s, placed, 3)
    assert filled.op_makespan < unfilled.op_makespan
    assert (filled.n_slots, filled.n_stash_slots) == (unfilled.n_slots, unfilled.n_stash_slots)
    moved = int(((filled.kind == W) & (unfilled.kind != W)).sum())
    assert moved > 0
    filled_placed = _fill_with_ws(s, placed)
    for (kind_, mb, j), pl in filled_placed.items():
        if kind_ == "W":
            assert pl.tick >= placed[("B", mb, j)].tick and pl.lane in (1, 2)
            if mb:
                before = filled_placed[("W", mb - 1, j)]
                assert (before.tick, before.lane) < (pl.tick, pl.lane)


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved", 2), ("zb_h1", 1)])
@pytest.mark.parametrize("m", [8, 16])
def test_in_what_its_ops_cost_the_program_against_free_running_stages(kind, v, m):
    """pp=4, in executor_op_units (the last chunk's F inside its B, the first chunk's split backward all W): the
    lockstep program against the same ops run by free-running stages. 1F1B and interleaved lose nothing; zb_h1
    loses one unit: its first ticks are paced by the last stage's F+B (2 units) while stage 0 runs one F, and of
    the 3 units that costs, moving Ws into the cool-down's ticks wins back 2 (28 against 27 at m=8, 52 against
    51 at m=16)."""
    s = make_schedule(kind, 4, m, v)
    program, free = tick_tables(s).op_makespan, free_running_op_makespan(s)
    assert program == free + (1 if kind == "zb_h1" else 0)


def test_lanes_pair_f_and_b_and_hold_what_the_order_needs():
    """1F1B at p=4: in the steady state every stage runs one F and one B per tick, so stage s holds
    up to 2(p-s)-1 microbatches (the price of starting forwards early), not p-s."""
    t = tick_tables(make_schedule("1f1b", 4, 16))
    assert t.n_lanes == 2
    both = (t.kind[:, :, 0] == KIND_CODE["F"]) & (t.kind[:, :, 1] == KIND_CODE["B"])
    assert both.all(axis=1).sum() == 16 - 2 * (4 - 1)  # the steady state: every stage runs an F and a B
    assert t.peak_in_flight == [7, 5, 3, 1]
    assert tick_tables(make_schedule("1f1b", 4, 16), lanes=1).peak_in_flight == [4, 3, 2, 1]
    assert tick_tables(make_schedule("afab", 4, 8)).n_lanes == 1  # all F, then all B: nothing to pair


def test_cli_reports_the_executors_makespan(capsys):
    assert cli.main(["--schedule", "zb_h1", "--pp", "4", "--microbatches", "16", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["makespan"] == 51 and got["executor_makespan"] == 52  # three lanes, Ws deferred: 1F1B's is 57
    assert got["executor_lanes"] == 3 and got["executor_peak_in_flight"] == [7, 5, 3, 1]
    assert cli.main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    assert "executor: 14 ticks of 2 lanes (F, then B) per tick, 33 cost units" in capsys.readouterr().out


def test_the_programs_time_in_what_its_ops_cost(capsys):
    """executor_op_units: the last chunk's F runs inside its B (3 units; split, 2, and its W 1); split, a middle
    chunk's B and W cost 1 each but the first chunk's backward is all W (2), so at pp=2 zb_h1 and dualpipe_v take
    longer than their makespans say, 1F1B does not. One op per tick, before the split W (W pulled back through the
    chunk again: 2) and the last chunk's W, these predicted the measured pp=2 steps on two H100s
    (docs/PERFORMANCE.md, 2026-11-27): zb_h1 / 1f1b 34/27 = 1.26 (measured 1.29), dualpipe_v (half-size chunks)
    43/27 = 1.59 (measured 1.58)."""
    def program(kind, v=1, p=2):
        return tick_tables(make_schedule(kind, p, 8, v))

    def one_op_per_tick(kind, v=1, p=2):
        return tick_tables(make_schedule(kind, p, 8, v), lanes=1)

    assert program("1f1b").op_makespan == program("1f1b").makespan == 27
    assert one_op_per_tick("zb_h1").makespan == 25 and one_op_per_tick("zb_h1").op_makespan == 27
    assert program("interleaved", 2).op_makespan == 51  # in half-size chunks: 25.5 of 1F1B's units
    assert one_op_per_tick("dualpipe_v", 2).op_makespan == 65
    assert one_op_per_tick("zb_h1", p=4).op_makespan == 41  # the middle stages' W: 56 when it pulled back again
    assert program("zb_h1").op_makespan == 25 and program("dualpipe_v", 2).op_makespan == 50  # three lanes
    assert cli.main(["--schedule", "zb_h1", "--pp", "2", "--microbatches", "8"]) == 0
    assert "the first chunk's backward all in its W): 25 units" in capsys.readouterr().out
