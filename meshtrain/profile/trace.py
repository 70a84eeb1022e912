"""Reading a `jax.profiler` trace: its kernels, module executions and step markers, each kernel in a category.

Where the kernels are found:

  GPU/TPU  a process named /device:GPU:N holds one thread per stream; every event on a stream thread
           is a kernel or a copy. Lines the profiler derives (XLA Modules, XLA Ops, Steps, ...) are not
           kernels; XLA Modules, when present, gives the module executions.
  CPU      no device process: the XLA thunks run on host threads, tagged with args hlo_op and
           device_ordinal. Executions are the (device, run_id) groups.

Kernels are classified by RULES (first match, on the kernel name and its hlo_op): extend it there.
Where the traced program's HLO lies beside the trace (PROGRAM_FILE, written by `run.profile_steps`),
kernels under the step's `optimizer` scope count as optimizer. Standard library only.
"""
from __future__ import annotations

import gzip
import json
import re
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
    # custom calls, CPU dots, the experts' grouped GEMMs (pallas_kernels: gmm_kernel, tgmm_kernel). On the CPU,
    # XLA hands dots to YNNPACK/XNNPACK as ynn_/xnn_ fusions.
    ("gemm", r"gemm|cublas|matmul|xmma|nvjet|cutlass|wgmma|hgmma|s16816|h16816|(^|[^a-z])dot([^a-z]|$)|"
             r"(^|_)t?gmm_kernel|ynn_fusion|xnn_fusion|convolution"),
    ("elementwise", r"fusion|loop|input|convert|copy|transpose|broadcast|slice|concatenate|reduce|select|add|"
                    r"multiply|subtract|divide|exp|log|rsqrt|sqrt|tanh|negate|maximum|minimum|compare|iota|pad|"
                    r"reshape|bitcast|scatter|gather|triton|rms|norm|softmax|rope|sort|cumsum|rng"),
]
_COMPILED = [(c, re.compile(r)) for c, r in RULES]
OTHER = "other"

COMPUTE = ("gemm", "attention", "elementwise", "optimizer", OTHER)
TRANSFER = ("collective", "memcpy")
DEVICE_PROCESS = re.compile(r"/device:([A-Za-z]+):(\d+)")
DERIVED_LINE = re.compile(r"^(XLA Modules|XLA Ops|Async XLA Ops|XLA TraceMe|Steps|TensorFlow|Framework|"
                          r"Source code|Launch Stats|SparseCore)", re.I)
STEP_MARKER = "train_step"  # the host annotation meshtrain/profile/window.py puts around each traced step
PROGRAM_FILE = "step.hlo.txt"  # meshtrain/profile/window.py writes the traced step's optimized HLO beside the trace
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


def find_program(path: str | Path, trace: Path) -> Path | None:
    """PROGRAM_FILE in the directory given, or in a folder between it and the trace."""
    top = Path(path) if Path(path).is_dir() else trace.parent
    for folder in [trace.parent, *trace.parents]:
        if (folder / PROGRAM_FILE).is_file():
            return folder / PROGRAM_FILE
        if folder == top:
            return None
    return None
