"""`python -m meshtrain.plan [--config F] [key=value ...] --devices N --device-memory GIB [--json]
[--verify K] [--gpu h100|h200] [--rate name=value ...]`

Searches layouts for the model and global batch of the config: the seven mesh axes x ZeRO stage
x remat policy x microbatch size x grad_accum x (with pp) the pipeline schedule and its virtual stages; a
layout over memory with the plain loss is tried with the fused one.
Each is estimated analytically (planning/memory.py, planning/timing.py); the fitting ones are ranked
by predicted step time and printed with their memory breakdown, then the fastest of every other family
(the axes a layout uses) that fits, and every family that has no fitting member, with the reason.
`given` is the estimate for the config exactly as given. `--verify K` compiles the top K through the
inspector and prints the estimate beside XLA's memory figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from meshtrain import launch
from meshtrain.config import ConfigError

GIB = 2.0**30
LABEL = 58  # the layout column: "pp4 fsdp4 cp2 tp2+SP interleaved/v5 Z3 save_attn mb4x32" fits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m meshtrain.plan", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--devices", type=int, required=True, help="devices to plan for")
    p.add_argument("--device-memory", type=float, required=True, metavar="GIB", help="memory per device, GiB")
    p.add_argument("--gpu", choices=("h100", "h200"), default="h100", help="rate defaults (default h100)")
    p.add_argument("--rate", action="append", default=[], metavar="name=value",
                   help="override a rate: peak_flops, matmul_efficiency, hbm_bw, nvlink_bw, ib_bw, "
                        "devices_per_node, overlap (bytes/s, FLOP/s)")
    p.add_argument("--top", type=int, default=8, help="candidates to print (default 8)")
    p.add_argument("--json", action="store_true", help="print {given, candidates, rejected} as JSON")
    p.add_argument("--verify", type=int, default=0, metavar="K", help="compile the top K and compare with XLA")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_intermixed_args(argv)


def rates_from(args):
    from meshtrain.planning.timing import Rates

    rates = Rates.preset(args.gpu)
    names = {f.name: f.type for f in dataclasses.fields(Rates)}
    for item in args.rate:
        k, _, v = item.partition("=")
        if k not in names:
            raise ConfigError(f"--rate {item!r}: unknown rate; one of {', '.join(names)}")
        try:
            rates = dataclasses.replace(rates, **{k: int(float(v)) if k == "devices_per_node" else float(v)})
        except ValueError:
            raise ConfigError(f"--rate {item!r}: {v!r} is not a number") from None
    return rates


def gib(x: float) -> str:
    return f"{x / GIB:7.2f}"


def print_table(title: str, cands) -> None:
    print(title)
    print(f"  {'#':>2}  {'layout':<{LABEL}}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'total':>8}"
          f"{'step s':>9}")
    for i, c in enumerate(cands, 1):
        m = c.memory
        print(f"  {i:>2}  {c.layout.label():<{LABEL}}{gib(m.params):>8}{gib(m.grads):>8}{gib(m.optimizer):>8}"
              f"{gib(m.activations):>8}{gib(m.total):>8}{c.time['total_s']:>9.3g}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch.guarded(lambda: command(args))


def command(args: argparse.Namespace) -> int:
    # The plain defaults (the search picks the layout); devices are simulated only to --verify, and no
    # XLA flags are set: each candidate compiles with its own layout in this one process.
    cfg = launch.load(args.config, args.overrides, cpu_defaults=False)
    rates = rates_from(args)
    launch.prepare(cfg, args.devices if args.verify else 1, flags=False)

    from meshtrain.config import resolve_mesh, with_mesh
    from meshtrain.planning.search import as_given, family, search

    degrees, problems = resolve_mesh(cfg.mesh, args.devices)
    if problems:
        raise ConfigError(problems)
    given_cfg = with_mesh(cfg, degrees)
    # The plan is for the GPUs whose rates it uses: every `auto` is decided as a GPU run would decide it.
    given, _ = as_given(given_cfg, rates, args.devices, backend="gpu")
    device_bytes = args.device_memory * GIB
    every, rejected = search(cfg, args.devices, device_bytes, rates, backend="gpu", top=None)
    cands = every[:args.top]
    # The fastest of each family the top does not show: how far behind a pipeline (or any other axis) comes.
    shown = {family(c.layout) for c in cands}
    runners_up = {}
    for c in every:
        runners_up.setdefault(family(c.layout), c)
    runners_up = [c for fam, c in runners_up.items() if fam not in shown]

    if args.json:
        print(json.dumps({"given": given.to_json(), "candidates": [c.to_json() for c in cands],
                          "other_families": [c.to_json() for c in runners_up], "rejected": rejected}, indent=1))
    else:
        m = cfg.model
        print(f"plan: {m.preset} ({m.n_layers} layers, d_model {m.d_model}), global batch {cfg.train.global_batch} x "
              f"{cfg.data.seq_len}, {cfg.precision.compute}, {args.devices} devices of {args.device_memory:g} GiB, "
              f"{args.gpu} rates (memory in GiB per device)")
        print_table("\nas given", [given])
        if given.memory.total > device_bytes:
            print(f"  does not fit: {gib(given.memory.total).strip()} GiB > {args.device_memory:g} GiB")
        print_table(f"\nbest layouts that fit (fastest first, {len(cands)} shown)", cands)
        if runners_up:
            more = f"; {len(runners_up) - args.top} more in --json" if len(runners_up) > args.top else ""
            print_table(f"\nthe fastest of each other family that fits ({min(len(runners_up), args.top)} shown{more})",
                        runners_up[:args.top])
        later = {f: w for f, w in rejected.items() if "not available in this version (would fit" in w}
        other = {f: w for f, w in rejected.items() if f not in later and "not available" not in w}
        if other:
            print("\nfamilies with no layout that fits")
            by_reason: dict[str, list[str]] = {}
            for fam, why in sorted(other.items()):
                by_reason.setdefault(why, []).append(fam)
            for why, fams in by_reason.items():
                print(f"  {fams[0] if len(fams) == 1 else f'{len(fams)} families ({fams[0]}, ...)':<22} {why}")
        if later:
            n_out = sum(1 for w in rejected.values() if "not available" in w) - len(later)
            print(f"\nfamilies that need axes still to come ({len(later)} would fit, {n_out} would not); the fastest:")
            for fam, why in sorted(later.items(), key=lambda kv: float(kv[1].rsplit(", ", 1)[1].split()[0]))[:4]:
                print(f"  {fam:<22} {why}")
    if args.verify:
        return verify(cands[:args.verify], cfg, args.devices)
    return 0


def verify(cands, cfg, n_devices: int) -> int:
    """Compile each candidate through the inspector; print the estimate beside XLA's peak."""
    from meshtrain.config import build_config
    from meshtrain.planning.aot import compile_step

    print("\nverify: estimate against XLA's memory_analysis (peak = arguments + outputs - aliased + temps)")
    for c in cands:
        try:
            ccfg, mesh = launch.validated_mesh(build_config(cfg.to_dict(), c.layout.overrides()), n_devices)
            xla = compile_step(ccfg, mesh).memory["peak_bytes"]
        except ConfigError as e:
            print(f"  {c.layout.label():<46} cannot compile here: {e.problems[0]}")
            continue
        print(f"  {c.layout.label():<46} estimate {gib(c.memory.total)} GiB   XLA {gib(xla)} GiB   "
              f"({(c.memory.total / xla - 1) * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
