"""`python -m meshtrain.run [--config PATH] [section.key=value ...]`

Reads top to bottom as the data flow, the start-up being meshtrain/launch.py's: load config ->
(simulate CPU devices) -> XLA flags -> distributed init -> validate -> mesh -> memory guard ->
banner -> restore or init state -> loop. A config mistake exits with status 2 and one line per
problem, before any device work and without a traceback.
"""
from __future__ import annotations

import argparse
import logging
import sys

from meshtrain import launch
from meshtrain.config import cpu_default_overrides, help_text, to_yaml

INTERRUPTED = "interrupted before training started (or by a second Ctrl-C): stopped without saving"


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, launch.on_cpu())
    # Ctrl-C before the loop took over the signal (start-up, loading, compiling): one line, 130.
    return launch.guarded(lambda: command(args), interrupted=INTERRUPTED)


def command(args: argparse.Namespace) -> int:
    # The embedded default is sized for the machine: dp=2 fsdp=2 tp=2 over 8 simulated CPU devices.
    cfg = launch.load(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    launch.prepare(cfg)  # CPU devices and XLA flags, before jax starts its backend
    return train_from(cfg)


def quiet_checkpoint_logs() -> None:
    """Orbax reports a failed write as ERROR logs with tracebacks from its writer threads, and its asyncio
    tasks as 'Task exception was never retrieved'; the same failure reaches the user as one
    `checkpoint error:` line (meshtrain.checkpoint.CheckpointError), so those go unprinted. So does the
    'Event loop is closed' that a writer thread of a failed save may raise while the process exits."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    default = sys.unraisablehook

    def hook(u):
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            default(u)
    sys.unraisablehook = hook


def train_from(cfg) -> int:
    import jax  # noqa: E402  (after the device-count flag)

    from meshtrain.checkpoint import CheckpointError
    from meshtrain.trainer import NonFiniteError, train

    quiet_checkpoint_logs()
    started = launch.start(cfg, memory_guard=cfg.run.memory_guard)
    cfg, mesh = started.cfg, started.mesh
    banner = launch.banner(cfg, mesh, started.exe)
    try:
        result = train(cfg, mesh, banner)  # a ConfigError here too is one line per problem and 2 (launch.guarded)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except CheckpointError as e:  # a failed save, or no saved step that reads back intact
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 4
    if result.stopped_by_signal:  # trainer.train said what happened and whether it can be resumed
        return 0 if result.saved_on_stop else 128 + result.stopped_by_signal
    if jax.process_index() == 0 and result.records:
        first, last = result.records[0], result.records[-1]
        print(f"done: step {result.final_step}, loss {first['loss']:.4f} (step {first['step']}) -> "
              f"{last['loss']:.4f} (step {last['step']}); metrics in {cfg.run.dir}/metrics.jsonl; "
              f"{saved_where(cfg, result.final_step)}", flush=True)
    if started.multi_process:  # leave together: a process that exits first makes the others log connection errors
        jax.distributed.shutdown()
    return 0


def saved_where(cfg, step: int) -> str:
    """Where the run's checkpoint is, or that there is none and how to get one (the commands that read a
    run -- evaluate, generate, export -- need one)."""
    from meshtrain.checkpoint import Checkpointer

    if Checkpointer.exists(cfg.checkpoint_dir):
        return f"checkpoint of step {step} in {cfg.checkpoint_dir} (evaluate, generate and export read it)"
    return ("NO checkpoint saved (checkpoint.every=0, checkpoint.final=false): evaluate, generate and export "
            "need one; set checkpoint.final=true")


if __name__ == "__main__":
    launch.program(main, "interrupted before training started: stopped without saving")
