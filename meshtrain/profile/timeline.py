"""Device time by category from a trace's kernels (meshtrain/profile/trace.py): the accounting.

Every instant of every device's timeline in the window (first kernel to last, over all devices) goes
to exactly one row, so the rows add up to the window:

    compute running     split evenly among the compute kernels running (GEMM, attention, ...)
    only transfers      collectives exposed / memcpy
    nothing             idle: between executions (the host did not feed the device: host gaps)
                        or within one (launch gaps, waits)

A collective running while a compute kernel runs on the same device (another stream) is hidden: it
costs no time in that table and is reported beside it, with the exposed rest. Times are per device
(the mean over devices). A kernel that contains others on its thread (a CPU while-loop thunk) keeps
only its self time.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from meshtrain.profile.trace import COMPUTE, PROGRAM_FILE, STEP_MARKER, TRANSFER, Kernel

def self_time_pieces(kernels: list[Kernel]) -> list[tuple[float, float, Kernel]]:
    """One thread's kernels as non-overlapping pieces: a kernel nested in another (a thunk inside a
    while loop) owns its interval; the outer one keeps the rest. A kernel that outlasts the one it
    starts in follows it (the earlier one is cut where it begins)."""
    pieces, stack, now = [], [], None  # stack: (end, kernel), innermost last

    def emit(until: float) -> None:
        if stack and until > now:
            pieces.append((now, until, stack[-1][1]))

    for k in sorted(kernels, key=lambda k: (k.start, -k.end)):
        while stack and stack[-1][0] <= k.start:
            emit(stack[-1][0])
            now = stack.pop()[0]
        # One that starts inside another but ends after it is not nested in it: on a GPU stream that is
        # the timestamp jitter of back-to-back kernels (they overlap by fractions of a microsecond), so
        # the earlier one ends where the later begins. (Clipping the later one to the earlier's end
        # would turn nearly all of it into idle time.)
        while stack and stack[-1][0] < k.end:
            emit(k.start)
            now = k.start
            stack.pop()
        emit(k.start)
        now = k.start
        stack.append((min(k.end, stack[-1][0]) if stack else k.end, k))  # clip a child to its parent
    while stack:
        emit(stack[-1][0])
        now = stack.pop()[0]
    return pieces


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for s, t in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], t))
        elif t > s:
            out.append((s, t))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def account_device(pieces: list[tuple[float, float, Kernel]]) -> tuple[dict[str, float], dict[str, float]]:
    """Sweep one device's pieces: (time per row, hidden time per transfer category), microseconds."""
    points = sorted([(s, 1, i) for i, (s, _, _) in enumerate(pieces)] +
                    [(t, 0, i) for i, (_, t, _) in enumerate(pieces)])  # at a tie, ends (0) go first
    rows, hidden = defaultdict(float), defaultdict(float)
    compute, transfer = {}, {}
    prev = None
    for t, is_start, i in points:
        if prev is not None and t > prev and (compute or transfer):
            dur = t - prev
            if compute:
                for k in compute.values():
                    rows[k.category] += dur / len(compute)
                for cat in {k.category for k in transfer.values()}:
                    hidden[cat] += dur
            else:
                for k in transfer.values():
                    rows[k.category] += dur / len(transfer)
        prev = t
        k = pieces[i][2]
        active = compute if k.category in COMPUTE else transfer
        if is_start:
            active[i] = k
        else:
            active.pop(i, None)
    return rows, hidden


def summarize(kernels: list[Kernel], executions: dict[str, list[tuple[float, float]]], markers: list[dict],
              steps: int | None = None, top_kernels: int = 10, scoped: bool = False) -> dict[str, Any]:
    """The report of a trace's kernels; `scoped`: they were classified with the traced program's scopes."""
    if not kernels:
        raise ValueError("the trace holds no device kernels or XLA ops: was any step run while it was recording?")
    by_thread = defaultdict(list)
    for k in kernels:
        by_thread[k.thread].append(k)
    per_device = defaultdict(list)
    for ks in by_thread.values():
        for piece in self_time_pieces(ks):
            per_device[piece[2].device].append(piece)
    devices = sorted({k.device for k in kernels}, key=lambda d: (d.split(":")[0], int(d.split(":")[1])))
    t0, t1 = min(k.start for k in kernels), max(k.end for k in kernels)
    wall = t1 - t0
    rows, hidden = defaultdict(float), defaultdict(float)
    split_idle = all(d in executions for d in devices)
    idle_of, rows_of = {}, {}
    for d in devices:
        r, h = account_device(per_device[d])
        rows_of[d] = r
        for c, v in r.items():
            rows[c] += v
        for c, v in h.items():
            hidden[c] += v
        busy = _union([(s, t) for s, t, _ in per_device[d]])
        idle = idle_of[d] = _gaps(busy, t0, t1)
        if split_idle:
            within = _overlap(idle, _union(executions[d]))
            rows["idle_within"] += within
            rows["idle_between"] += sum(t - s for s, t in idle) - within
        else:
            rows["idle"] += sum(t - s for s, t in idle)

    gap_report = idle_gaps(per_device[devices[0]], idle_of[devices[0]], t0)
    n_dev = len(devices)
    step_nums = {int(m["args"]["step_num"]) for m in markers}
    if steps:
        n_steps, steps_from = steps, "--steps"
    elif step_nums:
        n_steps, steps_from = len(step_nums), f"{STEP_MARKER} markers"
    elif split_idle:
        n_steps, steps_from = len(executions[devices[0]]), "module executions"
    else:
        n_steps, steps_from = 1, "unknown: pass --steps"

    counts, self_us = defaultdict(int), defaultdict(float)
    for k in kernels:
        counts[k.category] += 1
    for d in devices:
        for s, t, k in per_device[d]:
            self_us[(k.category, k.name)] += t - s
    calls = defaultdict(int)
    for k in kernels:
        calls[(k.category, k.name)] += 1

    def row(us: float, n: int | None) -> dict[str, Any]:
        ms = us / n_dev / 1e3
        return dict(ms=ms, pct=100 * ms / (wall / 1e3) if wall else 0.0, ms_per_step=ms / n_steps,
                    kernels=None if n is None else round(n / n_dev))

    def device_row(d: str) -> dict[str, float]:  # ms per step: under pp a device is a stage
        per_step = lambda us: us / n_steps / 1e3  # noqa: E731
        r = rows_of[d]
        return dict(compute=per_step(sum(r.get(c, 0.0) for c in COMPUTE)),
                    **{c: per_step(r.get(c, 0.0)) for c in TRANSFER},
                    idle=per_step(sum(t - s for s, t in idle_of[d])))

    order = [*COMPUTE, *TRANSFER] + (["idle_between", "idle_within"] if split_idle else ["idle"])
    categories = {c: row(rows.get(c, 0.0), counts.get(c, 0) if c in counts or c in COMPUTE + TRANSFER else None)
                  for c in order}
    notes = []
    if not counts.get("optimizer"):
        notes.append("optimizer: no kernel is named as one in this trace; its update is counted in "
                     "norm/elementwise" + ("" if scoped else f" (no {PROGRAM_FILE} beside the trace to tell)"))
    top = sorted(self_us.items(), key=lambda kv: -kv[1])[:top_kernels]
    host = {}
    if len(markers) > 1:
        starts = sorted(float(m["ts"]) for m in markers)
        host = dict(markers=len(markers), dispatch_period_ms=statistics.median(
            b - a for a, b in zip(starts, starts[1:])) / 1e3,
            dispatch_ms=statistics.median(float(m.get("dur", 0)) for m in markers) / 1e3)
    return dict(devices=devices, wall_ms=wall / 1e3, steps=n_steps, steps_from=steps_from, categories=categories,
                collectives_hidden=row(hidden.get("collective", 0.0), counts.get("collective", 0)),
                memcpy_hidden_ms=hidden.get("memcpy", 0.0) / n_dev / 1e3, host=host,
                top_kernels=[dict(name=name, category=cat, ms=us / n_dev / 1e3, count=round(calls[(cat, name)] / n_dev),
                                  mean_us=us / calls[(cat, name)]) for (cat, name), us in top],
                idle_gaps=gap_report, notes=notes, by_device={d: device_row(d) for d in devices})


GAP_BINS_US = (10.0, 100.0, 1000.0)  # launch-sized, host-sized, stall-sized gaps


def idle_gaps(pieces: list[tuple[float, float, Kernel]], idle: list[tuple[float, float]], t0: float,
              top: int = 8) -> dict[str, Any]:
    """Where one device's idle time (`idle`, its gaps in the window from t0) lies: the gaps binned by
    length, and the longest with the kernels on either side. Many short gaps point at launch overhead
    (small kernels, the host feeding them one by one); a few long ones at a synchronization or a
    host-side wait."""
    ordered = sorted(pieces, key=lambda p: p[0])
    gaps = [(s, t) for s, t in idle if t > s]
    edges = (0.0, *GAP_BINS_US, float("inf"))
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [t - s for s, t in gaps if lo <= t - s < hi]
        label = f"{lo:g}-{hi:g} us" if hi != float("inf") else f">= {lo:g} us"
        bins.append(dict(range=label, count=len(inside), ms=sum(inside) / 1e3))
    longest = []
    for s, t in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        prev = next((k.name for _, b, k in reversed(ordered) if b <= s + 1e-3), "(window start)")
        nxt = next((k.name for a, _, k in ordered if a >= t - 1e-3), "(window end)")
        longest.append(dict(us=t - s, at_ms=(s - t0) / 1e3, prev=prev, next=nxt))
    return dict(bins=bins, longest=longest)


def _gaps(busy: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    out, at = [], t0
    for s, t in busy:
        if s > at:
            out.append((at, s))
        at = max(at, t)
    if t1 > at:
        out.append((at, t1))
    return out
