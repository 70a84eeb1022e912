"""`python -m meshtrain.inspect [--config F] [key=value ...] [--devices N] [--dump DIR] [--json]
[--diff key=value ...]`

Builds the train step exactly as `run` does, compiles it ahead of time without running a step or
allocating a parameter, and prints what XLA will do: the mesh, parameters, FLOPs per step (XLA's
count beside 6N + attention), per-device memory (memory_analysis) and the collective table (op,
mesh axes, phase, count and bytes per device per step). `--diff` compiles a second config (the
first plus more overrides, e.g. `--diff train.zero_stage=3`) and prints both side by side.
"""
from __future__ import annotations

import argparse
import json
import sys

from meshtrain import launch
from meshtrain.config import build_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m meshtrain.inspect", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--devices", type=int, help="simulate N devices on a CPU-only machine (default run.cpu_devices)")
    p.add_argument("--dump", metavar="DIR", help="write the step's HLO before/after optimization and an INDEX.txt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--diff", nargs="+", metavar="key=value", help="compare with these extra overrides")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_intermixed_args(argv)


def human(n: float, unit: str = "B") -> str:
    if unit == "B":
        for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(n) >= s:
                return f"{n / s:.2f} {u}"
        return f"{int(n)} B"
    return f"{n:.3g}"


def summary_lines(r) -> list[tuple[str, str]]:
    m = r.memory
    used = " x ".join(f"{a}={n}" for a, n in r.mesh.items() if n > 1) or "one device"
    ratio = r.flops_per_step / r.formula_flops_per_step if r.formula_flops_per_step else float("nan")
    c = r.cfg
    return [
        ("mesh", f"{used} ({_n(r.mesh)} {r.platform} devices)"),
        ("model", f"{c.model.preset}: {c.model.n_layers} layers, d_model {c.model.d_model}, "
                  f"ZeRO-{c.train.zero_stage}, remat {c.train.remat}, {c.precision.compute}"),
        ("batch", f"{c.train.global_batch} x {c.data.seq_len} tokens, grad_accum {c.train.grad_accum}"
                  + (", sequence_parallel" if c.parallel.sequence_parallel else "")),
        ("execution", r.execution.describe()),
        ("parameters", f"{r.params:,}"),
        ("FLOPs/step", f"{r.flops_per_step:.4g} XLA   {r.formula_flops_per_step:.4g} 6N+attention   "
                       f"(x{ratio:.2f}; recomputation and replicated work count in XLA's" +
                       ("; so does every op a pipeline tick could run, not the one it runs)" if r.execution.pipeline
                        else ")")),
        ("arguments", human(m["argument_bytes"])), ("outputs", human(m["output_bytes"]) +
                                                    f" ({human(r.alias_bytes)} aliased to donated arguments)"),
        ("temporaries", human(m["temp_bytes"])), ("generated code", human(m["generated_code_bytes"])),
        ("peak/device", human(m["peak_bytes"]) + "  (arguments + outputs - aliased + temporaries)"),
    ]


def _n(mesh: dict[str, int]) -> int:
    import math
    return math.prod(mesh.values())


def collective_rows(r) -> dict[tuple[str, str, str], tuple[int, int]]:
    return {(c.op, c.axes or "-", c.phase): (c.count, c.bytes) for c in r.collectives}


def print_report(r) -> None:
    for k, v in summary_lines(r):
        print(f"{k:<15} {v}")
    print("\ncollectives (count and bytes per device per step; bytes = buffer size as nccl-tests count it)")
    print(f"  {'op':<19}{'axes':<14}{'phase':<11}{'count':>7}{'bytes':>13}")
    for (op, axes, phase), (count, nbytes) in collective_rows(r).items():
        print(f"  {op:<19}{axes:<14}{phase:<11}{count:>7}{human(nbytes):>13}")
    if not r.collectives:
        print("  (none: one device)")


def print_diff(a, b, label_a: str, label_b: str) -> None:
    la, lb = dict(summary_lines(a)), dict(summary_lines(b))
    w = max(34, max(len(v) for v in la.values() if len(v) < 60))
    print(f"{'':<15} {label_a:<{w}}  {label_b}")
    for k in la:
        if k == "FLOPs/step":
            va, vb = f"{a.flops_per_step:.4g} XLA", f"{b.flops_per_step:.4g} XLA"
        elif k == "peak/device":
            va, vb = human(a.memory["peak_bytes"]), human(b.memory["peak_bytes"])
        else:
            va, vb = la[k], lb[k]
        print(f"{k:<15} {va[:w]:<{w}}  {vb}")
    ra, rb = collective_rows(a), collective_rows(b)
    print(f"\n  {'op':<19}{'axes':<14}{'phase':<11}{'count':>7}{'bytes':>12}   {'count':>7}{'bytes':>12}")
    for key in sorted(set(ra) | set(rb), key=lambda k: (k[0], k[1], k[2])):
        ca, ba = ra.get(key, (0, 0))
        cb, bb = rb.get(key, (0, 0))
        fa = f"{ca:>7}{human(ba):>12}" if ca else f"{'-':>7}{'-':>12}"
        fb = f"{cb:>7}{human(bb):>12}" if cb else f"{'-':>7}{'-':>12}"
        print(f"  {key[0]:<19}{key[1]:<14}{key[2]:<11}{fa}   {fb}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch.guarded(lambda: command(args))


def command(args: argparse.Namespace) -> int:
    # run's config (its CPU default unless --devices asks for a count), on the devices asked for. No
    # XLA flags: --diff compiles a second config in this process, which the first's flags would not fit.
    cfg = launch.load(args.config, args.overrides, cpu_defaults=not args.devices)
    cfg_b = build_config(cfg.to_dict(), args.diff) if args.diff else None
    launch.prepare(cfg, args.devices, flags=False)

    from meshtrain.planning.aot import compile_step, dump

    cfg, mesh = launch.validated_mesh(cfg, args.devices)
    report = compile_step(cfg, mesh, keep_text=bool(args.dump))
    other = None
    if cfg_b is not None:
        cfg_b, mesh_b = launch.validated_mesh(cfg_b, args.devices)
        other = compile_step(cfg_b, mesh_b)
    if args.dump:
        index = dump(report, args.dump)
        print(f"meshtrain: HLO written to {args.dump} (see {index.name})", file=sys.stderr)
    if args.json:
        out = report.to_json() if other is None else {"a": report.to_json(), "b": other.to_json()}
        print(json.dumps(out, indent=1))
    elif other is None:
        print_report(report)
    else:
        print_diff(report, other, "as given", " ".join(args.diff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
