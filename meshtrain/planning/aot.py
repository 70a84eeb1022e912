"""The train step compiled ahead of time, without data or parameters: what XLA says it will cost.

The step is built exactly as `run` builds it (build_setup + make_train_step), then lowered against
abstract shapes (jax.eval_shape of init_state, Setup.abstract_batch) and compiled. Nothing is
allocated on a device, so an 8B model can be inspected on a laptop's simulated devices.

    memory      per device, from compiled.memory_analysis(): arguments (state + batch), outputs,
                temporaries, generated code; peak = arguments + outputs - aliased (donated) + temps
    flops       per step over all devices: XLA's cost analysis (per device) with each loop body
                counted as often as it runs (XLA counts it once; hlo.loop_dot_flops_uncounted)
    collectives the table of collectives.py
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import jax

from meshtrain.config import Config
from meshtrain.resolve import Execution
from meshtrain.metrics import flops_per_token
from meshtrain.planning import hlo
from meshtrain.planning.collectives import Collective, collectives
from meshtrain.step.state import Setup, abstract_params, build_setup, init_state
from meshtrain.step.train_step import make_train_step


@dataclass
class StepReport:
    cfg: Config
    mesh: dict[str, int]
    platform: str
    execution: Execution  # what the compiled step runs: the same decisions `run` makes
    params: int
    flops_per_step: float  # XLA, loop bodies counted per trip, summed over devices
    xla_flops_per_device_raw: float  # XLA's figure as given (each loop body once)
    formula_flops_per_step: float  # 6N + causal attention, per step
    memory: dict[str, int]
    alias_bytes: int
    collectives: list[Collective]
    hlo_pre: str = field(repr=False, default="")
    hlo_post: str = field(repr=False, default="")

    def to_json(self) -> dict:
        return {"mesh": self.mesh, "params": self.params, "flops_per_step": self.flops_per_step,
                "memory": self.memory, "collectives": [c.to_json() for c in self.collectives]}


def lower_step(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Setup, jax.stages.Lowered]:
    """The train step exactly as `run` builds it, lowered against shapes alone (nothing allocated)."""
    setup = build_setup(cfg, mesh)
    state = jax.eval_shape(lambda: init_state(setup))
    return setup, make_train_step(setup).lower(state, setup.abstract_batch())


def compile_step(cfg: Config, mesh: jax.sharding.Mesh, keep_text: bool = False) -> StepReport:
    """Lower and compile the train step of `cfg` (mesh degrees resolved) on `mesh`; run nothing."""
    setup, lowered = lower_step(cfg, mesh)
    # Nothing compiled here runs, and buffers, fusion and collectives are settled before code
    # generation, so the CPU compiler may skip LLVM's expensive optimizations (same figures, ~40% faster).
    fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    compiled = lowered.compile(compiler_options=fast) if mesh.devices.flat[0].platform == "cpu" else lowered.compile()
    post = compiled.as_text()
    module = hlo.parse(post)

    m = compiled.memory_analysis()
    arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    memory = {"argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
              "generated_code_bytes": int(m.generated_code_size_in_bytes),
              "peak_bytes": arg + out - alias + temp}

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    raw = float((cost or {}).get("flops", 0.0))
    n_dev = mesh.devices.size
    per_device = raw + hlo.loop_dot_flops_uncounted(module)

    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(setup)))
    tokens = cfg.train.global_batch * cfg.data.seq_len
    return StepReport(
        cfg=cfg, mesh=dict(mesh.shape), platform=mesh.devices.flat[0].platform, execution=setup.exe,
        params=int(n_params),
        flops_per_step=per_device * n_dev, xla_flops_per_device_raw=raw,
        formula_flops_per_step=flops_per_token(cfg.model, n_params, cfg.data.seq_len) * tokens,
        memory=memory, alias_bytes=alias, collectives=collectives(module, dict(mesh.shape)),
        hlo_pre=lowered.as_text(dialect="hlo") if keep_text else "", hlo_post=post if keep_text else "")


def dump(report: StepReport, directory: str | Path) -> Path:
    """Write the step's HLO before and after optimization and an index naming them."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "train_step.before_optimizations.hlo.txt").write_text(report.hlo_pre)
    (d / "train_step.after_optimizations.hlo.txt").write_text(report.hlo_post)
    index = d / "INDEX.txt"
    index.write_text(
        "meshtrain train step, compiled ahead of time by `python -m meshtrain.inspect`\n"
        f"mesh: {report.mesh}\n"
        "train_step.before_optimizations.hlo.txt  the step as lowered (before SPMD partitioning: no collectives "
        "yet; shardings as annotations)\n"
        "train_step.after_optimizations.hlo.txt   the step as compiled for one device (partitioned, fused, "
        "collectives inserted): the program that runs\n")
    return index
