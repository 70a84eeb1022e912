"""The one start-up every command shares, in this order:

  config      load(): the YAML file and the dotted overrides; on a CPU-only machine without --config,
              the embedded CPU run's defaults first (dp=2 fsdp=2 tp=2 over 8 simulated devices)
  devices     prepare(): simulate run.cpu_devices CPU devices (or a command's --devices) when no
              accelerator is found; jax's first import fixes the count, so nothing here imports jax
              at module level and every jax import is inside a function
  XLA flags   prepare(): xla_flags.apply_config, also before jax starts its backend
  distributed start(): jax.distributed when this is one process of many, before anything asks for
              the global device count
  validate    validated_mesh(): validate() against that count, with the token-file checks: every problem at once
  mesh        validated_mesh(): on every visible device, or on the first N (a command's --devices)
  decide      start(): every `auto` of the config for this mesh (meshtrain.resolve: the Execution)
  memory      start(): the memory guard, when the command asks for it, before any allocation

A config mistake is a ConfigError anywhere in these steps; `fail` prints it as one `config error:`
line per problem and returns 2, and `guarded` runs a command body with that and with Ctrl-C as 130.
The commands whose config comes out of a checkpoint (evaluate, generate, export) build it after jax
starts (meshtrain.inference); for them `prepare_devices` is the devices step alone.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from meshtrain import signals, xla_flags
from meshtrain.config import Config, ConfigError, build_config, cpu_default_overrides, load_config

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from meshtrain.resolve import Execution

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


# -- errors and the command body ------------------------------------------------------------------

def program(main: Callable[[], int], outside_loop: str = "interrupted: stopped without saving") -> None:
    """A command's process entry (`if __name__ == "__main__"`): SIGINT/SIGTERM taken before jax starts
    (meshtrain.signals: one line, exit 128+signal, at any moment; the loop saves and stops), then main."""
    signals.install(outside_loop)
    sys.exit(main())


def fail(e: ConfigError) -> int:
    for line in e.problems:
        print(f"config error: {line}", file=sys.stderr)
    return 2


def guarded(body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command body: a ConfigError as one line per problem (exit 2), Ctrl-C as one line (exit 130)."""
    try:
        return body()
    except ConfigError as e:
        return fail(e)
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr, flush=True)
        return 130


# -- before jax: config, devices, XLA flags ---------------------------------------------------------

def cpu_only(platforms: str) -> bool:
    """True when jax will find no accelerator, decided without importing jax (whose first import fixes
    the CPU device count)."""
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(m) for m in GPU_PLUGINS)


def on_cpu() -> bool:
    """`cpu_only` for this process's JAX_PLATFORMS."""
    return cpu_only(os.environ.get("JAX_PLATFORMS", ""))


def load(config_path: str | None, overrides: list[str], *, cpu_defaults: bool = True) -> Config:
    """The config file and the overrides. On a CPU-only machine without --config the embedded CPU run's
    defaults (cpu_default_overrides) come first, unless `cpu_defaults` is off (a command that takes its
    own device count starts from the plain defaults: fsdp takes the rest)."""
    defaults = cpu_default_overrides() if cpu_defaults and config_path is None and on_cpu() else []
    return load_config(config_path, defaults + list(overrides))


def simulate_cpu_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def prepare(cfg: Config, devices: int | None = None, *, flags: bool = True) -> None:
    """Before jax starts: `devices` (default run.cpu_devices) simulated CPU devices on a CPU-only
    machine, then the XLA flags and the GPU memory share the config needs (xla_flags.apply_config)
    unless `flags` is off."""
    if on_cpu():
        simulate_cpu_devices(devices or cfg.run.cpu_devices)
    if flags:
        xla_flags.apply_config(cfg)


def prepare_devices(overrides: list[str]) -> None:
    """The devices step for a command whose config is read from a checkpoint once jax runs: run.cpu_devices
    from the overrides (the default otherwise) simulated CPU devices on a CPU-only machine."""
    if on_cpu():
        mine = [o for o in overrides if o.partition("=")[0].strip() == "run.cpu_devices"]
        simulate_cpu_devices(build_config({}, mine).run.cpu_devices)


# -- after jax: distributed init, validate, mesh, memory guard -------------------------------------

@dataclass(frozen=True)
class Started:
    cfg: Config  # the mesh degrees resolved (what gets saved beside a checkpoint)
    mesh: Mesh
    exe: Execution  # what will run: every `auto` decided (the banner prints it)
    multi_process: bool  # jax.distributed was started: shut it down together at the end


def start(cfg: Config, devices: int | None = None, *, distributed: bool = True, data: bool = True,
          memory_guard: bool = False) -> Started:
    """The steps after `prepare`: distributed init, validate (+ token files when `data`), the mesh on
    the first `devices` devices (default: all), the Execution, and the memory guard when asked for."""
    from meshtrain.resolve import resolve_for_mesh

    multi_process = False
    if distributed:
        from meshtrain.mesh import initialize_distributed
        multi_process = initialize_distributed(cfg.distributed)
    cfg, mesh = validated_mesh(cfg, devices, data=data)
    exe = resolve_for_mesh(cfg, mesh)  # an explicit choice that cannot run here is a config error now
    if memory_guard:  # before any allocation: a config that cannot fit stops here, in one line
        from meshtrain.planning import guard
        guard.check(cfg, mesh.devices.size, mesh.devices.flat[0].platform, guard.device_limit(),
                    xla_flags.gpu_memory_fraction())
    return Started(cfg, mesh, exe, multi_process)


def validated_mesh(cfg: Config, devices: int | None = None, *, data: bool = False) -> tuple[Config, Mesh]:
    """(config with the mesh resolved, Mesh) on the first `devices` visible devices (default: all of
    them, over every process). Validation problems and, when `data`, the token files' come together."""
    import jax

    from meshtrain.config import validate, with_mesh
    from meshtrain.mesh import build_mesh

    n = devices or jax.device_count()
    if n > jax.device_count():
        raise ConfigError(f"--devices {n}: only {jax.device_count()} devices are visible; on an accelerator "
                          f"machine the count is what it has (simulation is for CPU-only machines)")
    try:
        degrees = validate(cfg, n)
        problems = []
    except ConfigError as e:
        degrees, problems = None, e.problems
    if data:  # before any device work or banner
        from meshtrain.data import check_token_files, text_cache_dir
        from meshtrain.documents import check_text_sources
        problems += check_token_files(cfg.data, cfg.model.vocab_size)
        if not problems:  # reading text sources converts them: only once the config itself is sound
            problems += check_text_sources(cfg.data, cfg.model.vocab_size, text_cache_dir(cfg.data, cfg.run.dir))
    if problems:
        raise ConfigError(problems)
    return with_mesh(cfg, degrees), build_mesh(degrees, jax.devices()[:n] if devices else None)


def banner(cfg: Config, mesh: Mesh, exe: Execution) -> str:
    """What the run is about to train and how, printed by process 0; returns the lines printed (the trackers
    record them), empty on the other processes."""
    import jax

    from meshtrain.mesh import describe

    if jax.process_index() != 0:
        return ""
    lines = []
    if exe.vocab_padded != cfg.model.vocab_size:
        lines.append(f"meshtrain: model.vocab_size={cfg.model.vocab_size} padded to {exe.vocab_padded} so that "
                     f"mesh.tp={mesh.shape['tp']} divides it; the {exe.vocab_padded - cfg.model.vocab_size} extra "
                     f"logits are masked")
    model = cfg.checkpoint.init_from or cfg.model.preset
    lines.append(f"meshtrain: mesh {describe(mesh)}, model {model} "
                 f"({cfg.model.n_layers} layers, d_model {cfg.model.d_model}), {cfg.precision.compute} compute, "
                 f"matmul {matmul_recipe(cfg)}, ZeRO-{cfg.train.zero_stage}, remat {cfg.train.remat}, "
                 f"{exe.describe()}; data {data_source(cfg)}, lr {cfg.train.lr:g} "
                 f"({cfg.train.optimizer}, {cfg.train.lr_schedule} schedule)")
    if cfg.checkpoint.init_from and cfg.data.source == "synthetic":
        lines.append(f"meshtrain: note: {cfg.checkpoint.init_from} is fine-tuned on the built-in synthetic corpus "
                     f"(data.source=synthetic); set data.source=file data.path=TOKENS to train on your data")
    print("\n".join(lines), flush=True)
    return "\n".join(lines)


def data_source(cfg: Config) -> str:
    d = cfg.data
    if d.source == "synthetic":
        return "synthetic corpus (data.source=synthetic)"
    if d.source == "hf":
        held_out = f", eval {d.eval_path}" if d.eval_path else (f", last {d.eval_fraction:g} of each held out"
                                                               if d.eval_fraction else "")
        return f"{d.mixture or d.path} (text, tokenizer {d.tokenizer}, eos {d.eos_id}{held_out})"
    held_out = f", eval {d.eval_path}" if d.eval_path else (f", last {d.eval_fraction:g} held out" if d.eval_fraction
                                                           else "")
    return f"{d.path} ({d.dtype}{held_out})"


def matmul_recipe(cfg: Config) -> str:
    from meshtrain.config import fp8_exclude_patterns

    p = cfg.precision
    if p.matmul == "bf16":
        return "plain"
    kept = fp8_exclude_patterns(p)
    return p.matmul + (f" (plain: {', '.join(kept)})" if kept else "")


# -- argument helpers shared by the checkpoint commands (evaluate, generate) ----------------------

CHECKPOINT_HELP = ("a meshtrain run directory or its checkpoints/ directory (the latest step, or --step), or "
                   "hf:DIR for a Hugging Face Llama, OLMoE or Mixtral directory")


def checkpoint_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m meshtrain.{prog}", description=description)
    p.add_argument("--checkpoint", required=True, metavar="DIR|hf:DIR", help=CHECKPOINT_HELP)
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    return p


def with_overrides(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides over the checkpoint's own (e.g. mesh.tp=2 data.eval_path=F)")
    return p

