"""Device time by category from a `jax.profiler` trace: `python -m meshtrain.profile TRACE [--json] [--steps N]`.

TRACE is a `*.trace.json.gz` (Chrome trace format) or a directory holding some, e.g. `<run.dir>/profile`
of `run.profile_steps` (the newest is read). The report is table.py's; this module is the command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshtrain.profile.table import format_table, profile_report
from meshtrain.profile.trace import PROGRAM_FILE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshtrain.profile", description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a *.trace.json.gz, or a directory with some (the newest is read)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=None, help="steps in the trace (default: from its step markers)")
    p.add_argument("--program", metavar="HLO", default=None, help="the traced program's optimized HLO text "
                   f"(default: {PROGRAM_FILE} beside the trace), to find the optimizer's kernels")
    p.add_argument("--top", type=int, default=10, help="kernels listed by self time (default 10)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    try:
        program = Path(args.program).read_text() if args.program else None
        report = profile_report(args.trace, args.steps, top_kernels=args.top, program=program)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
