"""Every `auto` is decided once (meshtrain/resolve.py), and every reader sees that one decision.

The model (and the pipeline stages built from it), the memory guard, the planner and the inspector each
reach an Execution through their own code path; for a pipeline, a context-parallel and an MoE config
they must all hold the same one. The guard and the planner must then make the same memory estimate,
whatever the pipeline schedule.
"""
from __future__ import annotations

import pytest

from helpers import tiny_config
from meshtrain.config import ConfigError, build_config, validate, with_mesh
from meshtrain.mesh import build_mesh
from meshtrain.planning import guard
from meshtrain.planning.aot import lower_step
from meshtrain.planning.layout import Layout
from meshtrain.planning.memory_pipeline import in_flight
from meshtrain.planning.search import as_given
from meshtrain.planning.timing import Rates
from meshtrain.resolve import resolve, resolve_for_mesh
from meshtrain.step.pipeline.schedules import KINDS, make_schedule
from meshtrain.step.pipeline.ticks import tick_tables
from meshtrain.step.state import build_setup

import jax

CASES = {
    "pipeline": ["mesh.pp=2", "mesh.dp=1", "mesh.fsdp=2", "mesh.tp=2", "train.grad_accum=4",
                 "pipeline.schedule=zb_h1"],
    "context": ["mesh.cp=2", "mesh.fsdp=2", "mesh.tp=2", "data.document_mask=true", "data.eos_id=7"],
    "moe": ["model.preset=tiny_moe", "model.d_model=64", "model.d_ff=128", "mesh.ep=2", "mesh.fsdp=2", "mesh.tp=2"],
}


def resolved(*overrides: str, n_devices: int = 8):
    cfg = tiny_config(*overrides)
    degrees = validate(cfg, n_devices)
    return with_mesh(cfg, degrees), build_mesh(degrees, jax.devices()[:n_devices])


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_guard_planner_and_inspector_see_one_execution(case):
    cfg, mesh = resolved(*CASES[case])
    exe = resolve_for_mesh(cfg, mesh)
    setup, _ = lower_step(cfg, mesh)  # the inspector's path, up to compiling (the pipeline's stages traced)
    assert setup.exe == exe and setup.model.exe == exe
    assert build_setup(cfg, mesh).model.exe == exe  # the run's path
    assert guard.run_estimate_on(cfg, "cpu")[0] == exe
    assert as_given(cfg, Rates.preset("cpu"), 8, backend="cpu")[1] == exe
    # and each case took the branch it is here for
    assert {"pipeline": exe.pipeline is not None, "context": exe.sequence_sharded,
            "moe": exe.moe_exchange == "allgather"}[case]


def test_the_decisions_on_a_gpu(monkeypatch):
    """What `auto` becomes on a GPU, decided without one (nothing reads the backend but resolve). Whether the
    Triton kernels' packages are installed is checked elsewhere (test_first_hour): here they count as there."""
    import meshtrain.resolve

    monkeypatch.setattr(meshtrain.resolve, "_triton_installed", lambda interpret, what: "triton")

    def on_gpu(*overrides, **degrees):
        cfg = tiny_config("precision.compute=bfloat16", *overrides)
        return resolve(cfg, {a: degrees.get(a, 1) for a in ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")}, "gpu")

    assert on_gpu().attention == "cudnn" and not on_gpu().interpret
    assert on_gpu("data.document_mask=true").attention == "pallas"
    assert on_gpu(cp=2).attention == "pallas"
    assert on_gpu(pp=2).attention == "cudnn"  # inside a stage too (called per shard there)
    assert on_gpu("precision.compute=float32").attention == "reference"
    assert on_gpu("model.attention=pallas", "model.attention_kernel=triton").attention_kernel == "triton"
    moe = on_gpu("model.preset=tiny_moe", ep=2)
    assert (moe.moe_exchange, moe.moe_gemm, moe.moe_fp32) == ("allgather", "pallas", False)
    assert on_gpu("parallel.tp_overlap=collective_matmul", tp=2).tp_ring
    assert not on_gpu("parallel.tp_overlap=collective_matmul").tp_ring  # tp = 1: nothing to overlap
    cpu = resolve(tiny_config("model.preset=tiny_moe", "precision.compute=bfloat16"),
                  dict(pp=1, dp=1, fsdp=1, ep=2, cp=1, sp=1, tp=1), "cpu")
    assert (cpu.moe_exchange, cpu.moe_gemm, cpu.moe_fp32, cpu.interpret) == ("allgather", "ragged_dot", True, True)


def test_an_explicit_choice_that_cannot_run_here_is_one_config_error():
    cfg = tiny_config("model.attention=pallas", "model.attention_kernel=mosaic")
    with pytest.raises(ConfigError, match=r"model.attention_kernel=mosaic: interpret mode"):
        resolve(cfg, dict(pp=1, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1), "cpu")


@pytest.mark.parametrize("schedule", KINDS)
def test_guard_and_planner_estimate_a_pipeline_alike(schedule):
    v = 2 if schedule in ("interleaved", "dualpipe_v") else 1
    cfg = build_config({}, ["model.preset=llama1b", "data.seq_len=2048", "mesh.pp=4", "mesh.fsdp=2", "mesh.dp=1",
                            "train.global_batch=16", "train.grad_accum=8", f"pipeline.schedule={schedule}",
                            f"pipeline.virtual_stages={v}", "precision.compute=bfloat16"])
    cfg = with_mesh(cfg, validate(cfg, 8))
    exe, guarded = guard.run_estimate_on(cfg, "gpu")
    planned, planned_exe = as_given(cfg, Rates.preset("h100"), 8, backend="gpu")
    assert planned_exe == exe
    assert planned.memory.total == guarded.total
    # the estimate holds the peak of microbatches in flight of the program the executor runs for the schedule
    peak = max(tick_tables(make_schedule(schedule, 4, 8, v)).peak_in_flight)
    assert guarded.detail["in_flight"] == in_flight(Layout.of(cfg)) == peak


def test_the_planner_decides_for_a_machine_with_the_kernel_packages(monkeypatch):
    """Planning for a GPU does not look for the Triton packages on the machine that plans; running does."""
    import meshtrain.resolve

    def absent(interpret, what):
        raise ConfigError(f"{what} needs the jax_triton package")

    monkeypatch.setattr(meshtrain.resolve, "_triton_installed", absent)
    cfg = tiny_config("precision.compute=bfloat16", "model.attention=pallas", "model.attention_kernel=triton")
    degrees = dict(pp=1, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1)
    with pytest.raises(ConfigError, match="jax_triton"):
        resolve(cfg, degrees, "gpu")
    assert resolve(cfg, degrees, "gpu", packages_here=False).attention_kernel == "triton"


@pytest.fixture
def triton_packages(monkeypatch) -> set[str]:
    """The set of the Triton packages importlib.util.find_spec reports installed, whatever this machine has:
    both at first; the test removes from it those it wants missing."""
    import importlib.util

    real, there = importlib.util.find_spec, {"triton", "jax_triton"}

    def find_spec(name, *args, **kwargs):
        root = name.split(".")[0]
        if root not in ("triton", "jax_triton"):
            return real(name, *args, **kwargs)
        return object() if root in there else None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return there


def test_the_fused_norm_needs_the_triton_packages_where_it_runs(triton_packages):
    """model.norm=pallas runs Triton kernels: jax-triton and triton on a GPU, triton for the CPU's interpreter.
    Without them it is one config error naming the field and the install line; the planner assumes them, and
    the default (the jnp norm) needs neither."""
    there = triton_packages
    cfg = tiny_config("precision.compute=bfloat16", "model.norm=pallas")
    degrees = dict(pp=1, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1)
    assert resolve(cfg, degrees, "gpu").norm == "pallas"
    there.remove("jax_triton")
    with pytest.raises(ConfigError) as err:
        resolve(cfg, degrees, "gpu")
    assert err.value.problems == ['model.norm=pallas needs the jax_triton package: pip install -e ".[triton]"']
    assert resolve(cfg, degrees, "cpu").norm == "pallas"  # the interpreter needs triton only
    assert resolve(cfg, degrees, "gpu", packages_here=False).norm == "pallas"
    there.clear()
    with pytest.raises(ConfigError) as err:
        resolve(cfg, degrees, "cpu")
    assert err.value.problems == ['model.norm=pallas needs the triton package: pip install -e ".[triton]"']
    assert resolve(tiny_config("precision.compute=bfloat16"), degrees, "gpu").norm == "reference"


def test_the_fp8_cast_kernel_needs_the_triton_packages_where_it_runs(triton_packages):
    """precision.fp8_cast=triton: the kernel on a GPU (jax-triton and triton), Triton's interpreter on a CPU (triton);
    without them one config error naming the field and the install line. XLA's casts need neither, and a config
    without a per-tensor fp8 recipe has no cast to decide."""
    there = triton_packages
    degrees = dict(pp=1, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1)
    cfg = tiny_config("precision.compute=bfloat16", "precision.matmul=fp8_delayed", "precision.fp8_cast=triton")
    assert resolve(cfg, degrees, "gpu").fp8_cast == "triton"
    assert resolve(cfg, degrees, "cpu").fp8_cast == "interpret"
    there.remove("jax_triton")
    with pytest.raises(ConfigError) as err:
        resolve(cfg, degrees, "gpu")
    assert err.value.problems == ['precision.fp8_cast=triton needs the jax_triton package: pip install -e ".[triton]"']
    assert resolve(tiny_config("precision.compute=bfloat16", "precision.matmul=fp8"), degrees, "gpu").fp8_cast == "xla"
    assert resolve(tiny_config("precision.fp8_cast=triton"), degrees, "gpu").fp8_cast == ""


def test_the_moe_gemm_kernel_needs_the_triton_packages_where_it_runs(triton_packages):
    """moe.grouped_matmul=pallas runs the gmm Triton kernels: jax-triton and triton on a GPU, triton for the CPU's
    interpreter. Without them an explicit choice is one config error naming the field and the install line, and
    auto on a GPU takes XLA's ragged_dot; the planner assumes them."""
    there = triton_packages
    degrees = dict(pp=1, dp=1, fsdp=1, ep=2, cp=1, sp=1, tp=1)
    auto = tiny_config("model.preset=tiny_moe", "precision.compute=bfloat16")
    explicit = tiny_config("model.preset=tiny_moe", "precision.compute=bfloat16", "moe.grouped_matmul=pallas")
    assert resolve(auto, degrees, "gpu").moe_gemm == resolve(explicit, degrees, "gpu").moe_gemm == "pallas"
    there.remove("jax_triton")
    with pytest.raises(ConfigError) as err:
        resolve(explicit, degrees, "gpu")
    assert err.value.problems == ['moe.grouped_matmul=pallas needs the jax_triton package: pip install -e ".[triton]"']
    assert resolve(auto, degrees, "gpu").moe_gemm == "ragged_dot"
    assert resolve(auto, degrees, "gpu", packages_here=False).moe_gemm == "pallas"
    assert resolve(explicit, degrees, "gpu", packages_here=False).moe_gemm == "pallas"
    assert resolve(explicit, degrees, "cpu").moe_gemm == "pallas"  # the interpreter needs triton only
    there.remove("triton")
    with pytest.raises(ConfigError) as err:
        resolve(explicit, degrees, "cpu")
    assert err.value.problems == ['moe.grouped_matmul=pallas needs the triton package: pip install -e ".[triton]"']
    assert resolve(auto, degrees, "cpu").moe_gemm == "ragged_dot"
