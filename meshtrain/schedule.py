"""Draw a pipeline schedule and print its bubble and memory.

    python -m meshtrain.schedule --schedule 1f1b --pp 4 --microbatches 8 [--virtual 2]
                                 [--units tick|cost] [--json] [--png FILE]

The text chart has a row per stage and, by default, a column per lockstep tick (one op per stage
and tick); `--units cost` draws a column per cost unit instead (F=1, B=2, or F=B=W=1 when the
backward is split), where the bubble is measured. The `executor:` line (and `executor_*` in --json)
says what the pipeline executor runs for it (step/pipeline/ticks.py: F and B in lanes of their own
where that pays): its ticks, its time in cost units and what each stage holds. Imports no jax.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from meshtrain.step.pipeline.schedules import KINDS, Op, Schedule, ScheduleError, make_schedule, validate_args
from meshtrain.step.pipeline.ticks import free_running_op_makespan, tick_tables

FLAGS = {"kind": "--schedule", "n_stages": "--pp", "n_microbatches": "--microbatches",
         "virtual_stages": "--virtual"}
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m meshtrain.schedule",
                description="Draw a pipeline-parallel schedule; print its bubble ratio and peak "
                            "activations.")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(KINDS)} (default 1f1b)")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--virtual", type=int, default=None,
                   help="model chunks per stage: interleaved takes any (default 1), dualpipe_v 2 (its default)")
    p.add_argument("--units", choices=("tick", "cost"), default="tick",
                   help="one column per lockstep tick (default) or per cost unit")
    p.add_argument("--json", action="store_true", help="print the summary and every op as JSON")
    p.add_argument("--png", metavar="FILE", help="also draw the chart into FILE (needs matplotlib)")
    return p.parse_args(argv)


def label(op: Op, virtual_stages: int) -> str:
    """F3, B3, W3; with several chunks per stage a letter names the chunk: F3a (chunk 0), F3b."""
    return f"{op.kind}{op.microbatch}" + (chr(ord("a") + op.chunk) if virtual_stages > 1 else "")


def _cells(s: Schedule, stage_ops: tuple[Op, ...], units: str, width: int) -> list[str]:
    n_cols = s.n_ticks if units == "tick" else int(s.makespan)
    cells = [".".ljust(width)] * n_cols
    for op in stage_ops:
        if units == "tick":
            cells[op.tick] = label(op, s.virtual_stages).ljust(width)
        else:
            first = int(op.start)
            cells[first] = label(op, s.virtual_stages).ljust(width)
            for col in range(first + 1, int(op.end)):  # a 2-unit B continues as "--"
                cells[col] = "-" * (width - 1) + " "
    return cells


def render_text(s: Schedule, units: str = "tick") -> str:
    width = 1 + max(len(label(op, s.virtual_stages)) for stage_ops in s.ops for op in stage_ops)
    n_cols = s.n_ticks if units == "tick" else int(s.makespan)
    column = "tick" if units == "tick" else "cost unit"
    head = f"{s.kind}: pp={s.n_stages}, microbatches={s.n_microbatches}"
    head += f", virtual stages={s.virtual_stages}" if s.virtual_stages > 1 else ""
    ruler = "".join(str(c).ljust(5 * width) for c in range(0, n_cols, 5))
    lines = [f"{head}; one column per {column} ({n_cols} {column}s)", f"{column:<9}| {ruler}".rstrip()]
    for stage, stage_ops in enumerate(s.ops):
        lines.append(f"stage {stage:<3}| " + "".join(_cells(s, stage_ops, units, width)).rstrip())
    if s.split_backward:
        legend = "Fi forward, Bi input-grad backward, Wi weight-grad backward of microbatch i"
    else:
        legend = "Fi forward, Bi backward of microbatch i"
    if s.kind == "dualpipe_v":
        legend += "; suffix: the stage's model chunk (a: virtual stage = stage, b: 2*pp-1-stage)"
    elif s.virtual_stages > 1:
        letters = ", ".join(f"{chr(ord('a') + c)} chunk {c}" for c in range(s.virtual_stages))
        legend += f"; suffix: the stage's model chunk ({letters}; virtual stage = chunk*pp + stage)"
    if units == "cost":
        legend += "; '--' continues a 2-unit op"
    costs = "F=1 B=1 W=1" if s.split_backward else "F=1 B=2"
    lines += [
        f"legend: {legend}; '.' idle",
        f"bubble ratio {s.bubble_ratio:.4f}  (idle / busy, cost units {costs}; makespan {s.makespan:g})",
        f"lockstep: {s.n_ticks} ticks, {s.lockstep_makespan:g} cost units (each tick lasts its slowest op)",
        "peak in flight per stage (activations held from F to B): " + " ".join(map(str, s.peak_in_flight)),
    ]
    program = tick_tables(s)
    lanes = {1: "one op per tick", 2: "2 lanes (F, then B) per tick"}.get(
        program.n_lanes, "3 lanes (F, B or a deferred W, then W) per tick")
    lines += [f"executor: {program.n_ticks} ticks of {lanes}, {program.makespan:g} cost units; peak in flight "
              "per stage " + " ".join(map(str, program.peak_in_flight)),
              f"executor in what its ops cost (the last chunk's F inside its B; split, the first chunk's backward "
              f"all in its W): {program.op_makespan:g} units, against {free_running_op_makespan(s):g} for stages "
              f"running freely"]
    if s.split_backward:
        held = " ".join(map(str, s.peak_in_flight_w))
        lines.append(f"peak held until W per stage (weight-grad inputs): {held}")
    return "\n".join(lines)


def to_json(s: Schedule) -> dict:
    program = tick_tables(s)
    return {
        "schedule": s.kind, "pp": s.n_stages, "microbatches": s.n_microbatches,
        "virtual_stages": s.virtual_stages, "ticks": s.n_ticks, "bubble_ratio": s.bubble_ratio,
        "peak_in_flight": s.peak_in_flight, "peak_in_flight_w": s.peak_in_flight_w,
        "split_backward": s.split_backward, "makespan": s.makespan, "lockstep_makespan": s.lockstep_makespan,
        # The program the pipeline executor runs (step/pipeline/ticks.py): its time in the same cost units,
        # its ticks and lanes, and what each stage holds in its order.
        "executor_makespan": program.makespan, "executor_ticks": program.n_ticks, "executor_lanes": program.n_lanes,
        "executor_peak_in_flight": program.peak_in_flight, "executor_op_makespan": program.op_makespan,
        # ... and the free-running schedule in those op costs, the fair reference for executor_op_makespan
        "op_makespan": free_running_op_makespan(s),
        "ops": [[{"op": op.kind, "microbatch": op.microbatch, "chunk": op.chunk, "start": op.start,
                  "end": op.end, "tick": op.tick} for op in stage_ops] for stage_ops in s.ops],
    }


def draw_png(s: Schedule, path: str, units: str = "tick") -> None:
    import matplotlib  # lazily: only --png needs it (main() turns ImportError into one line)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_cols = s.n_ticks if units == "tick" else s.makespan
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * n_cols + 1.5), 0.45 * s.n_stages + 1.3))
    for stage_ops in s.ops:
        for op in stage_ops:
            x, w = (op.tick, 1.0) if units == "tick" else (op.start, op.end - op.start)
            # later chunks of a stage are drawn paler, so the rounds of an interleaved schedule show
            alpha = 1.0 - 0.45 * op.chunk / max(s.virtual_stages - 1, 1)
            ax.broken_barh([(x, w)], (op.stage - 0.4, 0.8), facecolors=COLOURS[op.kind], alpha=alpha,
                           edgecolor="white", linewidth=0.6)
            ax.text(x + w / 2, op.stage, label(op, s.virtual_stages), ha="center", va="center",
                    fontsize=6.5, color="white")
    ax.set_yticks(range(s.n_stages), [f"stage {i}" for i in range(s.n_stages)])
    ax.set_ylim(s.n_stages - 0.5, -0.5)
    ax.set_xlim(0, n_cols)
    ax.set_xlabel("lockstep tick" if units == "tick" else "time (cost units)")
    v = f", v={s.virtual_stages}" if s.virtual_stages > 1 else ""
    ax.set_title(f"{s.kind}: pp={s.n_stages}, m={s.n_microbatches}{v}; bubble {s.bubble_ratio:.3f}, "
                 f"peak in flight {max(s.peak_in_flight)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.virtual is None:
        args.virtual = 2 if args.schedule == "dualpipe_v" else 1
    problems = validate_args(args.schedule, args.pp, args.microbatches, args.virtual, names=FLAGS)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        s = make_schedule(args.schedule, args.pp, args.microbatches, args.virtual)
    except ScheduleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(s)) if args.json else render_text(s, args.units))
    if args.png:
        try:
            draw_png(s, args.png, args.units)
        except ImportError:
            print("error: --png needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')",
                  file=sys.stderr)
            return 1
        except OSError as e:
            print(f"error: --png={args.png}: cannot write it ({e.strerror or e})", file=sys.stderr)
            return 2
        if not args.json:
            print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
