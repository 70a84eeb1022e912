"""`python -m meshtrain.run [--config PATH] [section.key=value ...]`

Reads top to bottom as the data flow: load config -> (simulate CPU devices) -> distributed init ->
validate -> mesh -> restore or init state -> loop. A config mistake exits with status 2 and one
line per problem, before any device work and without a traceback.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from meshtrain import xla_flags
from meshtrain.config import (ConfigError, cpu_default_overrides, help_text, load_config, padded_vocab, to_yaml,
                              validate, with_mesh)

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def parse_args(argv: list[str] | None, on_cpu: bool = False) -> argparse.Namespace:
    # The defaults shown are the ones that will apply here: a CPU-only machine without --config gets
    # the embedded CPU run's (cpu_default_overrides).
    machine = cpu_default_overrides() if on_cpu else []
    p = argparse.ArgumentParser(
        prog="python -m meshtrain.run", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Llama-style model with meshtrain. With no arguments: a tiny model on the synthetic "
                    "corpus over every visible device (8 simulated devices, dp=2 fsdp=2 tp=2, on a CPU).",
        epilog="config keys (section.key=value overrides; YAML files use the same sections):\n"
               + help_text(machine, "this CPU-only machine's run without --config")
               + ("\n\nWith --config, the file's values apply over the plain defaults instead." if machine else ""))
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_intermixed_args(argv)  # options may follow overrides


def cpu_only(platforms: str) -> bool:
    """True when jax will find no accelerator, decided without importing jax (whose first import fixes
    the CPU device count)."""
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(m) for m in GPU_PLUGINS)


def simulate_cpu_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def fail(e: ConfigError) -> int:
    for line in e.problems:
        print(f"config error: {line}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    on_cpu = cpu_only(os.environ.get("JAX_PLATFORMS", ""))
    args = parse_args(argv, on_cpu)
    try:
        # The embedded default is sized for the machine: dp=2 fsdp=2 tp=2 over 8 simulated CPU devices.
        defaults = cpu_default_overrides() if on_cpu and args.config is None else []
        cfg = load_config(args.config, defaults + args.overrides)
    except ConfigError as e:
        return fail(e)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if on_cpu:
        simulate_cpu_devices(cfg.run.cpu_devices)
    xla_flags.apply_config(cfg)  # before jax starts its backend
    try:
        return train_from(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the loop took over the signal (start-up, loading, compiling)
        print("\ninterrupted before training started (or by a second Ctrl-C): stopped without saving",
              file=sys.stderr, flush=True)
        return 130


def train_from(cfg) -> int:
    import jax  # noqa: E402  (after the device-count flag)

    from meshtrain.data import check_token_files
    from meshtrain.mesh import build_mesh, describe, initialize_distributed
    from meshtrain.model.attention import resolve as resolve_attention
    from meshtrain.trainer import NonFiniteError, train

    try:
        multi_process = initialize_distributed(cfg.distributed)
        try:
            degrees = validate(cfg, jax.device_count())
            problems = []
        except ConfigError as e:
            degrees, problems = None, e.problems
        problems += check_token_files(cfg.data, cfg.model.vocab_size)  # before any device work or banner
        if problems:
            raise ConfigError(problems)
        cfg = with_mesh(cfg, degrees)
        mesh = build_mesh(degrees)
        if cfg.run.memory_guard:  # before any allocation: a config that cannot fit stops here, in one line
            from meshtrain.planning import guard
            guard.check(cfg, mesh.devices.size, mesh.devices.flat[0].platform, guard.device_limit(),
                        xla_flags.gpu_memory_fraction())
    except ConfigError as e:
        return fail(e)
    if jax.process_index() == 0:
        attn = resolve_attention(cfg.model.attention, jax.numpy.dtype(cfg.precision.compute), cfg.data.document_mask,
                                 pipelined=degrees["pp"] > 1, sequence_sharded=degrees["cp"] * degrees["sp"] > 1)
        padded = padded_vocab(cfg.model, degrees["tp"])
        if padded != cfg.model.vocab_size:
            print(f"meshtrain: model.vocab_size={cfg.model.vocab_size} padded to {padded} so that mesh.tp="
                  f"{degrees['tp']} divides it; the {padded - cfg.model.vocab_size} extra logits are masked", flush=True)
        model = cfg.checkpoint.init_from or cfg.model.preset
        print(f"meshtrain: mesh {describe(mesh)}, model {model} "
              f"({cfg.model.n_layers} layers, d_model {cfg.model.d_model}), {cfg.precision.compute} compute, "
              f"ZeRO-{cfg.train.zero_stage}, remat {cfg.train.remat}, attention {attn}", flush=True)
    try:
        result = train(cfg, mesh)
    except ConfigError as e:
        return fail(e)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if result.stopped_by_signal:  # trainer.train said what happened and whether it can be resumed
        return 0 if result.saved_on_stop else 128 + result.stopped_by_signal
    if jax.process_index() == 0 and result.records:
        first, last = result.records[0], result.records[-1]
        print(f"done: step {result.final_step}, loss {first['loss']:.4f} (step {first['step']}) -> "
              f"{last['loss']:.4f} (step {last['step']}); metrics in {cfg.run.dir}/metrics.jsonl", flush=True)
    if multi_process:  # leave together: a process that exits first makes the others log connection errors
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
