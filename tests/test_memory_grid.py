"""The memory estimate against XLA's memory_analysis() peak on a generated grid of layouts.

The grid is built, not picked: every mesh family (each axis alone at 2, on 2 devices, and the playbook's
combinations at 2 x 2, on 4) is one row; expert-parallel families take one row per MoE routing and pipeline
families one row per schedule, cycled over the pipeline meshes. The knobs then cycle along the rows: remat
with period 4, fp8_delayed every third row (co-prime, so it meets every remat policy), and the ZeRO stage over
the rows whose mesh has an fsdp axis (the only ones it changes). test_grid_covers_every_level checks what that
buys; test_estimate_within_10_percent_of_xla compiles every row once (AOT, nothing runs; 2.5 to 3 minutes on
2 CPU cores) and holds the estimate to 10% of the compiled peak.
"""
from __future__ import annotations

import itertools

import pytest

from meshtrain.config import build_config
from meshtrain.launch import validated_mesh
from meshtrain.planning.aot import compile_step
from meshtrain.planning.layout import Layout
from meshtrain.planning.memory import attention_kind, estimate

# Four layers so that a pipeline of 2 stages can hold 2 chunks each (interleaved, dualpipe_v); a batch small
# enough that the state (16 B/param) is a third of the peak and activations the rest, so that dropping any
# term shows. fp32: the CPU compiler runs bf16 matmuls in fp32.
SHAPE = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=512",
         "model.vocab_size=512", "data.seq_len=128", "train.global_batch=8", "precision.compute=float32",
         "mesh.fsdp=1"]
MOE = ["moe.n_experts=4", "moe.top_k=2"]
TOLERANCE = 0.10
ARGUMENT_TOLERANCE = 0.001

# (name, devices, overrides): each axis alone, then the playbook's combinations.
MESHES = [
    ("dp2", 2, ["mesh.dp=2"]), ("fsdp2", 2, ["mesh.fsdp=2"]), ("tp2", 2, ["mesh.tp=2"]), ("cp2", 2, ["mesh.cp=2"]),
    ("sp2", 2, ["mesh.sp=2"]), ("ep2", 2, ["mesh.ep=2", *MOE]), ("pp2", 2, ["mesh.pp=2"]),
    ("fsdp2_tp2", 4, ["mesh.fsdp=2", "mesh.tp=2"]), ("pp2_tp2", 4, ["mesh.pp=2", "mesh.tp=2"]),
    ("pp2_fsdp2", 4, ["mesh.pp=2", "mesh.fsdp=2"]),
    ("cp2_tp2_sp", 4, ["mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true"]),
    ("ep2_fsdp2", 4, ["mesh.ep=2", "mesh.fsdp=2", *MOE]),
]
SCHEDULES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("dualpipe_v", 2)]  # (kind, chunks)
ROUTINGS = [("dropless", "moe.capacity_factor=0"), ("capacity", "moe.capacity_factor=1.25")]
REMATS = ["none", "full", "save_dots", "save_attn"]
ZERO_STAGES = [0, 1, 2, 3]
FP8_EVERY = 3  # co-prime with len(REMATS): every remat policy meets fp8_delayed


def families() -> list[tuple[str, int, list[str]]]:
    """The mesh rows, dense meshes first, then the expert meshes once per routing, then the pipeline meshes
    once per schedule (cycled): each group is consecutive, so the knobs' cycles reach every one of them."""
    dense = [m for m in MESHES if not m[0].startswith(("pp", "ep"))]
    experts = [(f"{name}_{r}", n, over + [o]) for name, n, over in MESHES if name.startswith("ep")
               for r, o in ROUTINGS]
    pipelines = [m for m in MESHES if m[0].startswith("pp")]
    staged = [(f"{name}_{kind}", n, over + ["train.grad_accum=4", f"pipeline.schedule={kind}",
                                            f"pipeline.virtual_stages={chunks}"])
              for (kind, chunks), (name, n, over) in zip(SCHEDULES, itertools.cycle(pipelines))]
    return dense + experts + staged


def grid() -> dict[str, tuple[int, list[str]]]:
    """name -> (devices, overrides) for every row, the knobs cycled along the rows."""
    zero = itertools.cycle(ZERO_STAGES)
    out = {}
    for i, (name, n, over) in enumerate(families()):
        remat = REMATS[i % len(REMATS)]
        knobs, label = [f"train.remat={remat}"], f"{name}_{remat}"
        if any(o.startswith("mesh.fsdp=") for o in over):
            stage = next(zero)
            knobs, label = knobs + [f"train.zero_stage={stage}"], f"{label}_z{stage}"
        if i % FP8_EVERY == FP8_EVERY - 1:
            knobs, label = knobs + ["precision.matmul=fp8_delayed"], f"{label}_fp8"
        out[label] = (n, over + knobs)
    return out


GRID = grid()


def test_grid_covers_every_level():
    """What the cycling buys: every mesh family, schedule, routing, remat policy and ZeRO stage; fp8_delayed with
    every remat policy; and still few enough rows to compile in CI."""
    rows = [" ".join(over) for _, over in GRID.values()]
    has = lambda *parts: any(all(p in r for p in parts) for r in rows)  # noqa: E731
    assert all(has(*over) for _, _, over in MESHES)
    assert all(has(f"pipeline.schedule={kind}") for kind, _ in SCHEDULES)
    assert all(has(o) for _, o in ROUTINGS)
    assert all(has(f"train.zero_stage={z}") for z in ZERO_STAGES)
    assert all(has(f"train.remat={r}", "precision.matmul=fp8_delayed") for r in REMATS)
    assert all(has(f"train.remat={r}", "mesh.pp=2") and has(f"train.remat={r}", "mesh.ep=2") for r in REMATS)
    assert len(GRID) <= 20


@pytest.fixture(scope="module")
def reports():
    """name -> (config, StepReport): every row compiled once, ahead of time (nothing runs)."""
    out = {}
    for name, (n, over) in GRID.items():
        cfg, mesh = validated_mesh(build_config({}, SHAPE + over), n)
        out[name] = (cfg, compile_step(cfg, mesh))
    return out


def test_estimate_within_10_percent_of_xla(reports):
    """The estimate's total against memory_analysis()'s peak (arguments + outputs - aliased + temporaries), and
    its resident state (params, optimizer state, batch) against the arguments, which it counts exactly."""
    rows, bad = [], []
    for name, (cfg, report) in reports.items():
        est = estimate(cfg, Layout.of(cfg), attention_kind(report.execution), backend="cpu")
        peak, args = report.memory["peak_bytes"], report.memory["argument_bytes"]
        err, arg_err = est.total / peak - 1, est.detail["arguments"] / args - 1
        terms = "  ".join(f"{k} {v / 2**20:6.2f}" for k, v in est.to_json().items() if k != "total")
        line = (f"{name:34s} estimate {est.total / 2**20:7.2f} MiB  XLA {peak / 2**20:7.2f} MiB  {err:+6.1%}"
                f"  (arguments {arg_err:+.2%})   {terms}")
        rows.append(line)
        # The arguments hold a few scalars and index tables more (the step counter, cp's permutation, fp8 histories).
        if abs(err) > TOLERANCE or abs(arg_err) > ARGUMENT_TOLERANCE:
            bad.append(line)
    assert not bad, ("estimate vs memory_analysis() off by more than 10% (or the state by more than 0.1% of the "
                     "arguments):\n" + "\n".join(bad) + "\n\nall layouts:\n" + "\n".join(rows))


@pytest.mark.parametrize("n, over", [
    (2, ["mesh.pp=2", "pipeline.schedule=1f1b", "train.remat=save_dots"]),
    (4, ["mesh.pp=2", "mesh.fsdp=2", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "train.remat=none"]),
], ids=["pp2_1f1b_save_dots", "pp2_fsdp2_interleaved_none"])
def test_pipeline_fp8_estimate_within_10_percent_of_xla(n, over):
    """Under `fp8` (current scaling) the stages quantize their chunks' weights once a step (ops.chunk_weights), where
    the grid's fp8_delayed rows quantize per op: the estimate counts each its own way."""
    cfg, mesh = validated_mesh(build_config({}, SHAPE + over + ["train.grad_accum=4", "precision.matmul=fp8"]), n)
    report = compile_step(cfg, mesh)
    est = estimate(cfg, Layout.of(cfg), attention_kind(report.execution), backend="cpu")
    assert abs(est.total / report.memory["peak_bytes"] - 1) <= TOLERANCE, (est.total, report.memory["peak_bytes"])
