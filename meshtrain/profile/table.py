"""Device time by category from a `jax.profiler` trace, as a report (a dict) and as a printed table.

trace.py reads the kernels and sorts them into categories; timeline.py gives every instant of the window
to one row; this module finds the trace (and the program beside it) and lays out the table. The command
is `python -m meshtrain.profile` (__main__.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtrain.profile.timeline import summarize
from meshtrain.profile.trace import (OTHER, PROGRAM_FILE, find_program, find_trace, load_events, program_scopes,
                                     read_trace)

LABELS = {"gemm": "GEMM", "attention": "attention", "elementwise": "norm/elementwise", "optimizer": "optimizer",
          OTHER: "other compute", "collective": "collectives exposed", "memcpy": "memcpy",
          "idle_between": "idle between executions (host gaps)", "idle_within": "idle within executions",
          "idle": "idle"}


def format_table(report: dict[str, Any]) -> str:
    cats = report["categories"]
    n = len(report["devices"])
    dev = report["devices"][0] if n == 1 else f"{n} devices ({report['devices'][0]} ...), times per device"
    lines = [f"trace: {report.get('trace', '?')}",
             f"device: {dev}; window {report['wall_ms']:.2f} ms over {report['steps']} steps "
             f"({report['steps_from']}) = {report['wall_ms'] / report['steps']:.2f} ms/step",
             f"program: {report.get('program') or f'none (no {PROGRAM_FILE}: optimizer kernels count as elementwise)'}",
             "",
             f"{'category':<38}{'ms':>10}{'% wall':>9}{'ms/step':>10}{'kernels':>9}"]
    total = 0.0
    for c, r in cats.items():
        total += r["ms"]
        k = "" if r["kernels"] is None else f"{r['kernels']:>9}"
        lines.append(f"{LABELS[c]:<38}{r['ms']:>10.2f}{r['pct']:>8.1f}%{r['ms_per_step']:>10.2f}{k}")
    lines.append(f"{'sum (= window)':<38}{total:>10.2f}{100 * total / report['wall_ms']:>8.1f}%")
    h = report["collectives_hidden"]
    lines.append(f"{'collectives hidden (under compute)':<38}{h['ms']:>10.2f}{h['pct']:>8.1f}%"
                 f"{h['ms_per_step']:>10.2f}{h['kernels']:>9}   not in the sum")
    if report["host"]:
        hs = report["host"]
        lines.append(f"host: {hs['markers']} step markers, dispatch every {hs['dispatch_period_ms']:.2f} ms "
                     f"(median), each dispatch {hs['dispatch_ms']:.2f} ms")
    if n > 1:  # the averages above hide an uneven split: under pp each device is a stage
        lines += ["", "per device, ms/step (under pp: one pipeline stage each)",
                  f"{'device':<10}{'compute':>10}{'collectives exposed':>21}{'memcpy':>9}{'idle':>9}"]
        for d, r in report["by_device"].items():
            lines.append(f"{d:<10}{r['compute']:>10.2f}{r['collective']:>21.2f}{r['memcpy']:>9.2f}{r['idle']:>9.2f}")
    lines += ["", "top kernels by self time (per device)",
              f"{'ms':>10}{'count':>7}{'mean us':>10}  {'category':<12} name"]
    for t in report["top_kernels"]:
        name = t["name"] if len(t["name"]) <= 90 else t["name"][:87] + "..."
        lines.append(f"{t['ms']:>10.2f}{t['count']:>7}{t['mean_us']:>10.1f}  {t['category']:<12} {name}")
    gaps = report.get("idle_gaps")
    if gaps:
        lines += ["", f"idle gaps on {report['devices'][0]} by length",
                  f"{'length':>16}{'gaps':>8}{'ms':>10}"]
        lines += [f"{b['range']:>16}{b['count']:>8}{b['ms']:>10.2f}" for b in gaps["bins"]]
        lines += ["longest idle gaps", f"{'us':>10}{'at ms':>10}  kernel before -> kernel after"]
        for g in gaps["longest"]:
            lines.append(f"{g['us']:>10.1f}{g['at_ms']:>10.2f}  {g['prev'][:60]} -> {g['next'][:60]}")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def profile_report(path: str | Path, steps: int | None = None, top_kernels: int = 10,
                   program: str | None = None) -> dict[str, Any]:
    """The report of the newest trace under `path`. `program` (the traced step's optimized HLO text)
    names the fused optimizer kernels; by default it is read from PROGRAM_FILE beside the trace."""
    trace = find_trace(path)
    source = "given" if program is not None else None
    if program is None and (found := find_program(path, trace)):
        program, source = found.read_text(), str(found)
    scopes = program_scopes(program) if program else None
    report = summarize(*read_trace(load_events(trace), scopes), steps=steps, top_kernels=top_kernels,
                       scoped=scopes is not None)
    return dict(trace=str(trace), program=source, **report)
