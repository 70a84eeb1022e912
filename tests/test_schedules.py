"""Pipeline schedules: validity, bubble and memory formulas, the checker's teeth, and the CLI.

Pure Python and fast: no jax work is done here (conftest imports jax, the code under test does not).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from meshtrain import schedule as cli
from meshtrain.step.pipeline.schedules import (KINDS, Schedule, ScheduleError, check_schedule, make_schedule,
                                          validate_args)

CASES = [(kind, p, m, v) for kind in KINDS if kind != "dualpipe_v" for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)
         for v in ((1, 2) if kind == "interleaved" else (1,))]
CASES += [("dualpipe_v", p, m, 2) for p in (2, 4, 8) for m in (2 * p, 4 * p, 8 * p)]  # needs m >= 2p


def case_id(case):
    kind, p, m, v = case
    return f"{kind}-p{p}-m{m}-v{v}"


@pytest.fixture(scope="module")
def schedules():
    return {case: make_schedule(*case) for case in CASES}


def replace_op(s: Schedule, at_stage: int, index: int, **changes) -> Schedule:
    ops = [list(stage_ops) for stage_ops in s.ops]
    ops[at_stage][index] = dataclasses.replace(ops[at_stage][index], **changes)
    return dataclasses.replace(s, ops=tuple(map(tuple, ops)))


def with_stage_ops(s: Schedule, stage: int, stage_ops: list) -> Schedule:
    ops = list(s.ops)
    ops[stage] = tuple(stage_ops)
    return dataclasses.replace(s, ops=tuple(ops))


# --------------------------------------------------------------------------- validity and formulas


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_schedule_is_valid_and_complete(schedules, case):
    kind, p, m, v = case
    s = schedules[case]
    check_schedule(s)
    per_op = 3 if kind in ("zb_h1", "dualpipe_v") else 2
    assert [len(stage_ops) for stage_ops in s.ops] == [per_op * m * v] * p
    grid = s.grid()
    assert len(grid) == s.n_ticks and all(len(row) == p for row in grid)
    placed = [op for row in grid for op in row if op is not None]
    assert sorted(placed, key=lambda o: (o.stage, o.tick)) == [op for stage_ops in s.ops for op in stage_ops]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bubble_ratio_matches_the_closed_form(schedules, case):
    kind, p, m, v = case
    expected = {"afab": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m),
                "zb_h1": (p - 1) / (3 * m), "dualpipe_v": (p - 1) / (6 * m)}[kind]
    assert schedules[case].bubble_ratio == pytest.approx(expected, rel=0, abs=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ticks_are_the_lockstep_minimum(schedules, case):
    # The lower bound: stage p-1 cannot start before tick p-1 and runs its ops one per tick;
    # without W its last op is a B whose gradient needs p-1 more ticks to reach stage 0.
    kind, p, m, v = case
    expected = {"afab": 2 * (m + p - 1), "1f1b": 2 * (m + p - 1), "interleaved": 2 * (m * v + p - 1),
                "zb_h1": 3 * m + p - 1, "dualpipe_v": 6 * m + p - 1}[kind]
    assert schedules[case].n_ticks == expected


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_peak_in_flight(schedules, case):
    kind, p, m, v = case
    s = schedules[case]
    if kind == "afab":
        assert s.peak_in_flight == [m] * p
    elif kind == "dualpipe_v":  # 2p+1 half-stage chunks on every stage: p + 1/2 microbatches
        assert s.peak_in_flight == s.peak_in_flight_w == [2 * p + 1] * p
        return
    else:  # 1F1B and its variants: stage s holds p - s microbatches (v·p - s chunks interleaved)
        assert s.peak_in_flight == [v * p - stage for stage in range(p)]
    if kind == "zb_h1":  # weight-grad inputs wait up to p microbatches on every stage, 1F1B's peak
        assert s.peak_in_flight_w == [p] * p
    else:
        assert s.peak_in_flight_w == s.peak_in_flight


def test_dualpipe_v_layout_is_a_v(schedules):
    s = schedules[("dualpipe_v", 4, 8, 2)]
    holds = [sorted({s.virtual_stage(op) for op in stage_ops}) for stage_ops in s.ops]
    assert holds == [[0, 7], [1, 6], [2, 5], [3, 4]]  # stage 0 holds the first and the last layers
    # The turn of the V stays on stage p-1: its chunk-1 F reads its own chunk-0 F.
    f0a, f0b = (next(op for op in s.ops[3] if op.kind == "F" and op.microbatch == 0 and op.chunk == c)
                for c in (0, 1))
    assert f0b.tick == f0a.tick + 1


def test_interleaved_with_one_chunk_is_1f1b():
    assert make_schedule("interleaved", 4, 12, 1).ops == make_schedule("1f1b", 4, 12).ops


def test_clocks_agree_when_every_op_costs_one(schedules):
    s = schedules[("zb_h1", 4, 8, 1)]
    assert all(op.start == op.tick for stage_ops in s.ops for op in stage_ops)
    assert s.lockstep_makespan == s.makespan == s.n_ticks
    # With B = 2 the tick executor pays for the slowest op of each tick.
    s = schedules[("1f1b", 4, 8, 1)]
    assert s.makespan < s.lockstep_makespan <= 2 * s.n_ticks


def test_schedules_do_not_import_jax():
    code = ("import sys, meshtrain.step.pipeline.schedules, meshtrain.schedule; "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# --------------------------------------------------------------------------- the checker rejects


@pytest.fixture(scope="module")
def base(schedules) -> Schedule:
    return schedules[("1f1b", 4, 8, 1)]


def test_checker_rejects_swapped_ops(base):
    # Stage 1 runs F1 in F0's slot: F1 of stage 0 has not finished by then.
    first, second = base.ops[1][0], base.ops[1][1]
    broken = replace_op(replace_op(base, 1, 0, microbatch=second.microbatch), 1, 1, microbatch=first.microbatch)
    with pytest.raises(ScheduleError, match=r"F of microbatch 1, chunk 0 on stage 1 .* reads the output of F "
                                            r"of microbatch 1, chunk 0 on stage 0"):
        check_schedule(broken)
    # The same two ops listed out of time order.
    ops = list(base.ops[1])
    ops[0], ops[1] = ops[1], ops[0]
    with pytest.raises(ScheduleError, match="overlaps or precedes the stage's previous op"):
        check_schedule(with_stage_ops(base, 1, ops))


def test_checker_rejects_a_dropped_op(base):
    ops = [op for op in base.ops[2] if not (op.kind == "B" and op.microbatch == 3)]
    with pytest.raises(ScheduleError, match=r"B of microbatch 3 on virtual stage 2 \(stage 2, chunk 0\) never"):
        check_schedule(with_stage_ops(base, 2, ops))


def test_checker_rejects_a_duplicated_op(base):
    ops = list(base.ops[0])
    with pytest.raises(ScheduleError, match="overlaps or precedes"):  # in place: two ops at once
        check_schedule(with_stage_ops(base, 0, ops[:3] + [ops[2]] + ops[3:]))
    late = dataclasses.replace(ops[0], start=base.makespan, end=base.makespan + 1, tick=base.n_ticks)
    with pytest.raises(ScheduleError, match=r"F of microbatch 0, chunk 0 on stage 0 .* runs twice"):
        check_schedule(with_stage_ops(base, 0, ops + [late]))


def test_checker_needs_a_strictly_earlier_tick(base):
    # Stage 1's F0 in the same tick as stage 0's F0: fine in cost time, not in lockstep.
    with pytest.raises(ScheduleError, match="F of microbatch 0, chunk 0 on stage 1 .* not ready"):
        check_schedule(replace_op(base, 1, 0, tick=0))
    # And the cost clock on its own: starting before the input ends.
    with pytest.raises(ScheduleError, match="F of microbatch 0, chunk 0 on stage 1 .* not ready"):
        check_schedule(replace_op(base, 1, 0, start=0.5, end=1.5))


def test_checker_rejects_wrong_durations_stages_and_w(base, schedules):
    with pytest.raises(ScheduleError, match="must last 2 unit"):
        check_schedule(replace_op(base, 3, 1, end=base.ops[3][1].start + 1))
    with pytest.raises(ScheduleError, match="is listed under stage 3"):
        check_schedule(replace_op(base, 3, 0, stage=2))
    with pytest.raises(ScheduleError, match="no such op"):  # a W in a schedule without split backward
        check_schedule(replace_op(base, 3, 1, kind="W"))
    zb = schedules[("zb_h1", 4, 8, 1)]
    w_index = next(i for i, op in enumerate(zb.ops[0]) if op.kind == "W")
    b = zb.ops[0][w_index - 1]  # stage 0 runs B(i) then W(i): swap them, so W comes first
    assert (b.kind, b.microbatch) == ("B", zb.ops[0][w_index].microbatch)
    broken = replace_op(replace_op(zb, 0, w_index - 1, kind="W"), 0, w_index, kind="B")
    with pytest.raises(ScheduleError, match=f"W of microbatch {b.microbatch}, chunk 0 on stage 0 .* reads "
                                            f"the output of B of microbatch {b.microbatch}"):
        check_schedule(broken)


def test_make_schedule_rejects_bad_arguments():
    with pytest.raises(ScheduleError, match=r"n_microbatches=6: .* use a multiple of 4 \(4 or 8\)"):
        make_schedule("interleaved", 4, 6, 2)
    assert issubclass(ScheduleError, ValueError)
    assert validate_args("1f1b", 4, 8) == []
    assert validate_args("1f1b", 4, 8, 2, names={"virtual_stages": "pipeline.virtual_stages"}) == [
        "pipeline.virtual_stages=2: only the interleaved and dualpipe_v schedules run several chunks per "
        "stage; use kind=interleaved or pipeline.virtual_stages=1"]
    assert len(validate_args("gpipe", 0, 8)) == 2
    assert validate_args("dualpipe_v", 4, 6, 1) == [
        "n_microbatches=6: dualpipe_v needs two microbatches per stage (n_stages=4) to fill both arms of "
        "its V; use at least 8",
        "virtual_stages=1: dualpipe_v holds two chunks per stage (the arms of its V); use virtual_stages=2"]


# --------------------------------------------------------------------------- the CLI


def run_cli(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zb_h1", 1), ("interleaved", 2), ("dualpipe_v", 2)])
def test_cli_text_chart_is_the_grid(capsys, kind, v):
    flags = ["--virtual", str(v)] if kind != "dualpipe_v" else []  # dualpipe_v defaults to its 2
    rc, out, _ = run_cli(["--schedule", kind, "--pp", "4", "--microbatches", "8"] + flags, capsys)
    s = make_schedule(kind, 4, 8, v)
    assert rc == 0
    rows = {line.split("|")[0].strip(): line.split("|")[1].split() for line in out.splitlines() if "|" in line}
    for stage in range(4):
        expected = [cli.label(op, v) if op else "." for op in (row[stage] for row in s.grid())]
        assert rows[f"stage {stage}"] + ["."] * (s.n_ticks - len(rows[f"stage {stage}"])) == expected
    assert f"bubble ratio {s.bubble_ratio:.4f}" in out
    peaks = " ".join(map(str, s.peak_in_flight))
    assert f"peak in flight per stage (activations held from F to B): {peaks}" in out


def test_cli_cost_unit_chart(capsys):
    rc, out, _ = run_cli(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--units", "cost"], capsys)
    s = make_schedule("1f1b", 4, 8)
    assert rc == 0
    for stage, stage_ops in enumerate(s.ops):
        row = next(line for line in out.splitlines() if line.startswith(f"stage {stage} "))
        cells = row.split("|")[1].split()
        cells += ["."] * (int(s.makespan) - len(cells))
        expected = ["."] * int(s.makespan)
        for op in stage_ops:  # a B fills two columns: its label, then "--"
            expected[int(op.start):int(op.end)] = [cli.label(op, 1)] + ["--"] * int(op.end - op.start - 1)
        assert cells == expected


def test_cli_json(capsys):
    rc, out, _ = run_cli(["--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--virtual", "2",
                          "--json"], capsys)
    assert rc == 0
    got = json.loads(out)
    s = make_schedule("interleaved", 4, 8, 2)
    assert {k: got[k] for k in ("schedule", "pp", "microbatches", "virtual_stages", "ticks", "bubble_ratio",
                                "peak_in_flight")} == {
        "schedule": "interleaved", "pp": 4, "microbatches": 8, "virtual_stages": 2, "ticks": s.n_ticks,
        "bubble_ratio": s.bubble_ratio, "peak_in_flight": s.peak_in_flight}
    assert got["ops"][1][0] == {"op": "F", "microbatch": 0, "chunk": 0, "start": 1.0, "end": 2.0, "tick": 1}


@pytest.mark.parametrize("argv,flag", [
    (["--schedule", "gpipe"], "--schedule='gpipe'"),
    (["--pp", "4", "--microbatches", "2"], "--microbatches=2"),
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "6", "--virtual", "2"], "--microbatches=6"),
    (["--schedule", "1f1b", "--virtual", "2"], "--virtual=2"),
    (["--schedule", "dualpipe_v", "--pp", "4", "--microbatches", "6"], "--microbatches=6"),
    (["--pp", "0"], "--pp=0"),
    (["--pp", "four"], "--pp"),
    (["--units", "seconds"], "--units"),
])
def test_cli_bad_arguments_exit_2_with_one_line(capsys, argv, flag):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and flag in err


def test_cli_module_exits_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "meshtrain.schedule", "--schedule", "interleaved", "--pp", "4",
                        "--microbatches", "6", "--virtual", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_cli_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    rc, out, _ = run_cli(["--schedule", "zb_h1", "--png", str(path)], capsys)
    assert rc == 0 and f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_cli_png_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    rc, _, err = run_cli(["--png", str(tmp_path / "x.png")], capsys)
    assert rc == 1 and "pip install matplotlib" in err and err.count("\n") == 1
