"""Device time by category from a `jax.profiler` trace: `python -m meshtrain.profile_table TRACE [--json] [--steps N]`.

TRACE is a `*.trace.json.gz` (Chrome trace format) or a directory holding some, e.g. `<run.dir>/profile`
of `run.profile_steps` (the newest is read). Where the kernels are found:

  GPU/TPU  a process named /device:GPU:N holds one thread per stream; every event on a stream thread
           is a kernel or a copy. Lines the profiler derives (XLA Modules, XLA Ops, Steps, ...) are not
           kernels; XLA Modules, when present, gives the module executions.
  CPU      no device process: the XLA thunks run on host threads, tagged with args hlo_op and
           device_ordinal; a thunk that contains others on its thread (a while loop) keeps only its
           self time. Executions are the (device, run_id) groups.

Every instant of every device's timeline in the window (first kernel to last, over all devices) goes
to exactly one row, so the rows add up to the window:

    compute running     split evenly among the compute kernels running (GEMM, attention, ...)
    only transfers      collectives exposed / memcpy
    nothing             idle: between executions (the host did not feed the device: host gaps)
                        or within one (launch gaps, waits)

A collective running while a compute kernel runs on the same device (another stream) is hidden: it
costs no time in that table and is reported beside it, with the exposed rest. Times are per device
(the mean over devices). Kernels are classified by RULES (first match, on the kernel name and its
hlo_op): extend it there. Where the traced program's HLO lies beside the trace (PROGRAM_FILE, written by
`run.profile_steps`), kernels under the step's `optimizer` scope count as optimizer.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (category, regex over "kernel name | hlo_op | tf_op", lowercased). First match wins, so the specific
# rules come before the broad ones: collectives before anything that says "reduce", attention before
# GEMM (flash kernels are cutlass), optimizer before elementwise.
RULES: list[tuple[str, str]] = [
    ("collective", r"nccl|all-?reduce|all_reduce|all-?gather|all_gather|reduce-?scatter|reduce_scatter|all-?to-?all|"
                   r"all_to_all|collective-?permute|collective_permute|\b(send|recv)(-start|-done)?\b"),
    ("memcpy", r"memcpy|memset|\bh2d\b|\bd2h\b|\bd2d\b|htod|dtoh|dtod|copy-start|copy-done"),
    ("attention", r"fmha|flash|sdpa|attention|splash|mha_|_mha|cudnn.*softmax"),
    ("optimizer", r"adam|optax|optimizer|opt_update|multi_tensor"),
    # cuBLAS/cublasLt kernels (sm90_xmma_gemm_*, nvjet_*, cutlass_*), XLA's Triton GEMM fusions and
    # custom calls, CPU dots. On the CPU, XLA hands dots to YNNPACK/XNNPACK as ynn_/xnn_ fusions.
    ("gemm", r"gemm|cublas|matmul|xmma|nvjet|cutlass|wgmma|hgmma|s16816|h16816|(^|[^a-z])dot([^a-z]|$)|"
             r"ynn_fusion|xnn_fusion|convolution"),
    ("elementwise", r"fusion|loop|input|convert|copy|transpose|broadcast|slice|concatenate|reduce|select|add|"
                    r"multiply|subtract|divide|exp|log|rsqrt|sqrt|tanh|negate|maximum|minimum|compare|iota|pad|"
                    r"reshape|bitcast|scatter|gather|triton|rms|norm|softmax|rope|sort|cumsum|rng"),
]
_COMPILED = [(c, re.compile(r)) for c, r in RULES]
OTHER = "other"

COMPUTE = ("gemm", "attention", "elementwise", "optimizer", OTHER)
TRANSFER = ("collective", "memcpy")
LABELS = {"gemm": "GEMM", "attention": "attention", "elementwise": "norm/elementwise", "optimizer": "optimizer",
          OTHER: "other compute", "collective": "collectives exposed", "memcpy": "memcpy",
          "idle_between": "idle between executions (host gaps)", "idle_within": "idle within executions",
          "idle": "idle"}

DEVICE_PROCESS = re.compile(r"/device:([A-Za-z]+):(\d+)")
DERIVED_LINE = re.compile(r"^(XLA Modules|XLA Ops|Async XLA Ops|XLA TraceMe|Steps|TensorFlow|Framework|"
                          r"Source code|Launch Stats|SparseCore)", re.I)
STEP_MARKER = "train_step"  # the host annotation meshtrain/profiler.py puts around each traced step
PROGRAM_FILE = "step.hlo.txt"  # meshtrain/profiler.py writes the traced step's optimized HLO beside the trace
# train_step.py's jax.named_scope around the optimizer update. XLA keeps the scope in each instruction's
# op_name, but a GPU trace names kernels after their fusion (`loop_select_fusion_5`: the fused AdamW
# update is rooted in the non-finite guard's select), so the program file is what ties them together.
OPTIMIZER_SCOPE = "/optimizer/"
_HLO_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bmetadata=\{[^}]*?\bop_name="([^"]*)"')


def classify(name: str, args: dict[str, Any] | None = None, op_name: str = "") -> str:
    """RULES over the kernel's name and trace args; then a fusion or other kernel that the program file
    places under the optimizer's scope (`op_name`) counts as optimizer. Only the scope's exact name is
    read from op_name: module names in it (`...Attention/...`) would mislead the broad RULES."""
    args = args or {}
    text = " | ".join(str(x) for x in (name, args.get("hlo_op", ""), args.get("tf_op", "")) if x).lower()
    category = next((c for c, rx in _COMPILED if rx.search(text)), OTHER)
    if OPTIMIZER_SCOPE in op_name and category in ("elementwise", OTHER):
        return "optimizer"
    return category


def program_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> op_name (the jax name stack it was traced under) in an HLO module's text, under
    both spellings a trace uses: the HLO's (`loop_select_fusion.5`; CPU thunks) and the GPU kernel's
    (`loop_select_fusion_5`)."""
    scopes = {}
    for line in hlo_text.splitlines():
        if m := _HLO_INSTRUCTION.match(line):
            name, op_name = m.groups()
            scopes[name] = op_name
            scopes.setdefault(re.sub(r"[.\-]", "_", name), op_name)
    return scopes


@dataclass
class Kernel:
    device: str
    thread: tuple
    start: float  # microseconds, as in the trace
    end: float
    name: str
    category: str


# ------------------------------------------------------------------------------------------- reading


def find_trace(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime) if p.is_dir() else []
    if not found:
        raise FileNotFoundError(f"{path}: no *.trace.json.gz in it (take one with run.profile_steps=START:END)")
    return found[-1]


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def read_trace(events: list[dict], scopes: dict[str, str] | None = None
               ) -> tuple[list[Kernel], dict[str, list[tuple[float, float]]], list[dict]]:
    """(kernels, module executions per device, host step markers) of a trace's events; `scopes`
    (program_scopes of the traced program) lets `classify` see each kernel's op_name."""
    scopes = scopes or {}

    def category(e: dict) -> str:
        name, args = e.get("name", ""), e.get("args") or {}
        return classify(name, args, scopes.get(args.get("hlo_op", "")) or scopes.get(name, ""))

    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    markers = [e for e in complete if e.get("name") == STEP_MARKER and "step_num" in e.get("args", {})]
    device_pids = {pid: f"{m.group(1).lower()}:{m.group(2)}" for pid, name in process.items()
                   if (m := DEVICE_PROCESS.search(name or ""))}
    kernels, executions = [], defaultdict(list)
    on_device = [e for e in complete if e.get("pid") in device_pids]
    if on_device:
        with_streams = {e["pid"] for e in on_device if not DERIVED_LINE.match(thread.get((e["pid"], e.get("tid")), ""))}
        for e in on_device:
            key = (e["pid"], e.get("tid"))
            line = thread.get(key, "")
            span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
            if line.startswith("XLA Modules"):
                executions[device_pids[e["pid"]]].append(span)
            # A device without stream lines (a TPU) has its kernels on the XLA Ops line only.
            elif not DERIVED_LINE.match(line) or (line.startswith("XLA Ops") and e["pid"] not in with_streams):
                kernels.append(Kernel(device_pids[e["pid"]], key, *span, e.get("name", ""), category(e)))
    else:  # CPU: XLA thunks on host threads
        runs = defaultdict(lambda: [float("inf"), float("-inf")])
        for e in complete:
            args = e.get("args", {})
            if "hlo_op" not in args or "device_ordinal" not in args:
                continue
            device = f"cpu:{args['device_ordinal']}"
            s, t = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
            kernels.append(Kernel(device, (e.get("pid"), e.get("tid")), s, t, e.get("name", ""), category(e)))
            if "run_id" in args:
                r = runs[(device, args["run_id"])]
                r[0], r[1] = min(r[0], s), max(r[1], t)
        for (device, _), (s, t) in runs.items():
            executions[device].append((s, t))
    return kernels, dict(executions), markers


# ---------------------------------------------------------------------------------------- accounting


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
    idle_of = {}
    for d in devices:
        r, h = account_device(per_device[d])
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
                idle_gaps=gap_report, notes=notes)


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


# ------------------------------------------------------------------------------------------- output


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


def find_program(path: str | Path, trace: Path) -> Path | None:
    """PROGRAM_FILE in the directory given, or in a folder between it and the trace."""
    top = Path(path) if Path(path).is_dir() else trace.parent
    for folder in [trace.parent, *trace.parents]:
        if (folder / PROGRAM_FILE).is_file():
            return folder / PROGRAM_FILE
        if folder == top:
            return None
    return None


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshtrain.profile_table", description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a *.trace.json.gz, or a directory with some (the newest is read)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=None, help="steps in the trace (default: from its step markers)")
    p.add_argument("--program", metavar="HLO", default=None, help="the traced program's optimized HLO text "
                   f"(default: {PROGRAM_FILE} beside the trace), to find the optimizer's kernels")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    try:
        program = Path(args.program).read_text() if args.program else None
        report = profile_report(args.trace, args.steps, program=program)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
