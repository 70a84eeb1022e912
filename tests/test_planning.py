"""Inspector and planner: collective tables on simulated devices, the memory estimate against XLA's
memory_analysis(), the playbook's arithmetic, and the memory guard of `run`.

One module-scoped fixture compiles every layout once (ten compilations); the collective and memory
tests read the same reports.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest
from helpers import cli_env

from meshtrain.config import ConfigError, build_config, load_config
from meshtrain.config.pipeline import validate_args
from meshtrain.launch import validated_mesh
from meshtrain.planning import collectives as col
from meshtrain.planning import guard, hlo
from meshtrain.planning.aot import compile_step
from meshtrain.planning.layout import Layout
from meshtrain.planning.memory import estimate, param_count
from meshtrain.planning.memory_layer import layer_activation_bytes
from meshtrain.planning.playbook import playbook_state_bytes

# Big enough that activations and state dominate the compiler's own scratch, small enough to compile
# fast (compile time hardly depends on the shapes). fp32: the CPU compiler runs bf16 matmuls in fp32.
SHAPE = ["model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=512",
         "model.vocab_size=512", "data.seq_len=128", "train.global_batch=16", "precision.compute=float32",
         "mesh.fsdp=1"]

# name -> overrides. Asymmetric meshes, every ZeRO stage, every remat policy, SP, grad_accum.
LAYOUTS = {
    "dp8": "mesh.dp=8 train.zero_stage=0",
    "fsdp8_z3": "mesh.fsdp=8 train.zero_stage=3",
    "dp2_tp4": "mesh.dp=2 mesh.tp=4",
    "fsdp2_tp4_sp": "mesh.fsdp=2 mesh.tp=4 parallel.sequence_parallel=true",
    "fsdp4_tp2_z1": "mesh.fsdp=4 mesh.tp=2 train.zero_stage=1",
    "fsdp2_tp4_z2": "mesh.fsdp=2 mesh.tp=4 train.zero_stage=2",
    "fsdp4_tp2_full_z3_sp": "mesh.fsdp=4 mesh.tp=2 train.remat=full train.zero_stage=3 parallel.sequence_parallel=true",
    "dp2_fsdp4_dots_z3": "mesh.dp=2 mesh.fsdp=4 train.remat=save_dots train.zero_stage=3",
    "fsdp4_tp2_attn_z2": "mesh.fsdp=4 mesh.tp=2 train.remat=save_attn train.zero_stage=2",
    "dp2_fsdp2_tp2_names_accum": "mesh.dp=2 mesh.fsdp=2 mesh.tp=2 train.remat=names:qkv,mlp_hidden train.grad_accum=2",
}


def layout_cfg(name: str):
    return build_config({}, SHAPE + LAYOUTS[name].split())


@pytest.fixture(scope="module")
def reports():
    out = {}
    for name in LAYOUTS:
        cfg, mesh = validated_mesh(layout_cfg(name), 8)
        out[name] = compile_step(cfg, mesh)
    return out


# ----------------------------------------------------------------------------------- collective tables

# (layout, (op, axes) that must appear, axes every collective must stay within). A new axis adds rows:
#   ("cp2...", [("collective-permute", "cp")], ...), ("sp2...", [("all-to-all", "sp")], ...),
#   ("pp2...", [("collective-permute", "pp")], ...), ("ep2...", [("all-to-all", "ep")], ...).
COLLECTIVE_CASES = [
    ("dp8", [("all-reduce", "dp")], {"dp"}),
    ("fsdp8_z3", [("all-gather", "fsdp"), ("reduce-scatter", "fsdp")], {"fsdp"}),
    ("dp2_tp4", [("all-reduce", "tp"), ("all-reduce", "dp")], {"dp", "tp"}),
    ("fsdp2_tp4_sp", [("all-gather", "tp"), ("reduce-scatter", "tp")], {"fsdp", "tp"}),
]


@pytest.mark.parametrize("name,expected,allowed", COLLECTIVE_CASES, ids=[c[0] for c in COLLECTIVE_CASES])
def test_collective_table(reports, name, expected, allowed):
    rows = reports[name].collectives
    found = {(r.op, r.axes) for r in rows}
    for want in expected:
        assert want in found, f"{name}: expected {want} in {sorted(found)}"
    for r in rows:
        assert set(r.axes.split(",")) <= allowed, f"{name}: {r} runs over an axis the layout does not use"
    if name.startswith("pp"):  # the executor's messages between stages are the pipeline's, not the optimizer's
        assert {r.phase for r in rows if r.op == "collective-permute"} == {"pipeline"}, rows
        assert r.count >= 1 and r.bytes > 0


# The axes written with shard_map bring their own collectives; each is compiled alone (small shape).
NEW_AXIS_CASES = [
    ("pp2_dp4", "mesh.pp=2 mesh.dp=4 train.grad_accum=2 model.attention=reference", ("collective-permute", "pp"),
     {"pp", "dp"}),
    ("cp2_dp4", "mesh.cp=2 mesh.dp=4", ("collective-permute", "cp"), {"cp", "dp"}),
    ("sp2_dp4", "mesh.sp=2 mesh.dp=4", ("all-to-all", "sp"), {"sp", "dp"}),
    # the experts' exchange (moe.dispatch=auto: tokens all-gathered over ep, partial outputs reduce-scattered)
    ("ep2_dp4", "moe.n_experts=4 moe.top_k=2 mesh.ep=2 mesh.dp=4", ("all-gather", "ep"), {"ep", "dp"}),
    ("tp4_sp_ring_dp2", "mesh.tp=4 mesh.dp=2 parallel.sequence_parallel=true parallel.tp_overlap=collective_matmul",
     ("collective-permute", "tp"), {"tp", "dp"}),
]


@pytest.mark.parametrize("name,overrides,expected,allowed", NEW_AXIS_CASES, ids=[c[0] for c in NEW_AXIS_CASES])
def test_new_axis_collectives(name, overrides, expected, allowed):
    cfg, mesh = validated_mesh(build_config({}, SHAPE[:-1] + ["model.d_model=64", "model.d_ff=128", "data.seq_len=32"]
                                     + overrides.split()), 8)
    rows = compile_step(cfg, mesh).collectives
    assert expected in {(r.op, r.axes) for r in rows}, f"{name}: {sorted((r.op, r.axes) for r in rows)}"
    for r in rows:
        assert set(r.axes.split(",")) <= allowed, f"{name}: {r} runs over an axis the layout does not use"
    if name.startswith("pp"):  # the executor's messages between stages are the pipeline's, not the optimizer's
        assert {r.phase for r in rows if r.op == "collective-permute"} == {"pipeline"}, rows


def test_gradient_collectives_sit_in_the_backward_and_repeat_per_layer(reports):
    dp = [r for r in reports["dp8"].collectives if r.op == "all-reduce" and r.axes == "dp"]
    assert {r.phase for r in dp} >= {"backward"}
    # ZeRO-3 gathers each layer's weights in the forward, inside the scanned stack: once per layer.
    ag = [r for r in reports["fsdp8_z3"].collectives if r.op == "all-gather" and r.phase == "forward"]
    assert ag and sum(r.count for r in ag) >= 2 * 2  # several weights x 2 layers


def test_replica_group_formats():
    mesh = dict(pp=1, dp=2, fsdp=2, ep=1, cp=1, sp=1, tp=2)  # flat id = dp*4 + fsdp*2 + tp
    assert col.axes_of(col.replica_groups("replica_groups={{0,2},{1,3},{4,6},{5,7}}", 8), mesh) == "fsdp"
    assert col.axes_of(col.replica_groups("replica_groups=[4,2]<=[8]", 8), mesh) == "tp"
    assert col.axes_of(col.replica_groups("replica_groups=[2,4]<=[2,4]T(1,0)", 8), mesh) == "dp,tp"
    assert col.replica_groups("replica_groups=[2,4]<=[2,4]T(1,0)", 8) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    text = "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}"
    # ids [2,2,2] -> transpose (1,0,2) -> [[0,1,4,5],[2,3,6,7]]; groups along axis_0 pair the columns.
    assert col.replica_groups(text, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert col.axes_of(col.replica_groups(text, 8), mesh) == "fsdp"
    assert col.axes_of(col.replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", 8), mesh) \
        == "dp,fsdp"
    # A sub-axis: the middle factor 2 of axis_1 (size 4 = 2 x 2 x 1), as the ZeRO-3 embedding gradient's
    # V-split all-to-all under sequence parallelism produces it.
    sub = col.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}", 8)
    assert sub == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert col.axes_of(sub, mesh) == "tp"
    pairs = col.replica_groups("source_target_pairs={{0,4},{4,0},{1,5},{5,1}}", 8)
    assert col.axes_of(pairs, mesh) == "dp"


def test_collective_permute_and_all_to_all_rows_from_hlo():
    """The rows the later axes will produce, read from hand-written HLO of the right form."""
    text = """HloModule m
%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %cp = f32[4,8]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}, metadata={op_name="jit(step)/jvp(Decoder)/ring"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %cp)
}
%cond (p.1: (s32[], f32[4,8])) -> pred[] {
  %p.1 = (s32[], f32[4,8]) parameter(0)
  ROOT %c = pred[] constant(true)
}
ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[4,8]) tuple(%z, %a)
  %w = (s32[], f32[4,8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4,8]{1,0} get-tuple-element(%w), index=1
  ROOT %a2a = f32[4,8]{1,0} all-to-all(%y), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, metadata={op_name="jit(step)/transpose(jvp(Decoder))/a2a"}
}
"""
    mesh = dict(pp=1, dp=1, fsdp=1, ep=1, cp=2, sp=2, tp=1)  # flat id = cp*2 + sp
    rows = {(r.op, r.axes, r.phase): (r.count, r.bytes) for r in col.collectives(hlo.parse(text), mesh)}
    assert rows[("collective-permute", "sp", "forward")] == (3, 3 * 128)  # runs once per trip
    assert rows[("all-to-all", "cp", "backward")] == (1, 128)


# --------------------------------------------------------------------------------- memory estimate


def test_memory_estimate_within_15_percent_of_xla(reports):
    errors = {}
    for name, r in reports.items():
        est = estimate(r.cfg, Layout.of(r.cfg), "reference", backend="cpu").total
        errors[name] = est / r.memory["peak_bytes"] - 1
    bad = {k: f"{v:+.1%}" for k, v in errors.items() if abs(v) > 0.15}
    assert not bad, f"estimate vs memory_analysis() off by more than 15%: {bad} (all: {errors})"


def test_flops_per_step_against_formula(reports):
    r = reports["fsdp4_tp2_z1"]
    # XLA's count (loop bodies per trip) includes the masked half of the causal attention and the
    # replicated norms, so it sits a little above 6N + causal attention, never far.
    assert 0.95 < r.flops_per_step / r.formula_flops_per_step < 1.3
    assert r.flops_per_step > 1.5 * r.xla_flops_per_device_raw * 8 / 2  # the loop correction matters


def test_param_count_matches_the_model():
    from meshtrain.metrics import count_params
    for preset, expected in (("tiny", None), ("llama3_8b", 8_030_261_248)):
        cfg = build_config({}, [f"model.preset={preset}", "mesh.fsdp=1"])
        assert expected is None or param_count(cfg) == expected
    cfg, mesh = validated_mesh(layout_cfg("dp8"), 8)
    from meshtrain.step.state import build_setup, init_state
    setup = build_setup(cfg, mesh)
    assert param_count(cfg) == count_params(jax.eval_shape(lambda: init_state(setup)).params)


POLICIES = ("none", "full", "save_dots", "save_attn", "names:attn_out,mlp_out", "save_dots+names:attn_in,mlp_in")
MOE_DROPLESS, MOE_CAPACITY = "moe.n_experts=4 moe.top_k=2", "moe.n_experts=4 moe.top_k=2 moe.capacity_factor=1.25"


@pytest.mark.parametrize("remat,compute,extra", [(r, "float32", "") for r in POLICIES] +
                         [("none", "bfloat16", ""), ("save_dots", "bfloat16", "")] +
                         [(r, "float32", e) for r in ("none", "save_dots") for e in (MOE_DROPLESS, MOE_CAPACITY)] +
                         [("none", c, f"precision.matmul={r}") for c in ("float32", "bfloat16")
                          for r in ("fp8", "fp8_delayed")])
def test_layer_residuals_match_what_autodiff_keeps(remat, compute, extra):
    """The per-layer table (RESIDUALS, EXPERT_RESIDUALS for an MoE FFN, fp8_input_bytes for fp8 sites) against jax's
    own list of what the block's backward keeps."""
    import flax.linen as nn
    from jax._src.ad_checkpoint import saved_residuals

    from meshtrain.data import Batch
    from meshtrain.step.loss import loss_sum_fn
    from meshtrain.step.state import build_setup

    # 3 sequences, 2 layers: a stacked residual [L, b, ...] cannot be mistaken for an unstacked one.
    cfg = build_config({}, SHAPE + ["train.global_batch=3", f"train.remat={remat}", f"precision.compute={compute}",
                                    *extra.split()])
    cfg, mesh = validated_mesh(cfg, 1)
    setup = build_setup(cfg, mesh)
    z = jnp.zeros((3, 128), jnp.int32)
    variables = jax.eval_shape(lambda: setup.model.init(jax.random.key(0), z, z, z))
    model_state = nn.unbox({k: v for k, v in variables.items() if k != "params"})  # fp8_delayed's amax histories
    res = saved_residuals(lambda p: loss_sum_fn(setup.model)(p, Batch(z, z, z, z), model_state)[0],
                          variables["params"])
    L = cfg.model.n_layers
    # The stack's residuals are the scan's outputs with a leading [L] axis.
    stacked = sum(a.size * a.dtype.itemsize for a, src in res
                  if "scan" in src and a.shape[:1] == (L,) and a.ndim >= 3 and "argument" not in src)
    per_layer = layer_activation_bytes(cfg, Layout.of(cfg), "reference")
    assert per_layer == pytest.approx(stacked / L, rel=0.06), (remat, compute, extra)


def test_playbook_zero_arithmetic():
    """The ZeRO paper's figure the playbook reproduces: Ψ = 7.5B, N_d = 64, K = 12 (mixed precision)."""
    gb = lambda d: sum(d.values()) / 1e9  # noqa: E731
    assert gb(playbook_state_bytes(7.5e9, 0, 64)) == pytest.approx(120, abs=0.05)
    assert gb(playbook_state_bytes(7.5e9, 1, 64)) == pytest.approx(31.4, abs=0.05)
    assert gb(playbook_state_bytes(7.5e9, 2, 64)) == pytest.approx(16.6, abs=0.05)
    assert gb(playbook_state_bytes(7.5e9, 3, 64)) == pytest.approx(1.9, abs=0.05)
    # meshtrain keeps 4 + 4 + 8 = 16 B/param (fp32 master, fp32 grads, Adam): the planner's state for
    # Llama 3 8B over fsdp=64 is the same arithmetic with those bytes, stage by stage.
    for stage in (0, 1, 2, 3):
        cfg = build_config({}, ["model.preset=llama3_8b", "mesh.fsdp=64", f"train.zero_stage={stage}"])
        n = param_count(cfg)
        want = playbook_state_bytes(n, stage, 64, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
        m = estimate(cfg, Layout.of(cfg))
        layer = 4 * n_layer_params(cfg) if stage == 3 else 0  # ZeRO-3's one gathered layer
        assert m.params - layer == pytest.approx(want["params"], rel=1e-3)
        assert m.grads == pytest.approx(want["grads"], rel=1e-3)
        assert m.optimizer == pytest.approx(want["optimizer"], rel=1e-3)
    assert 16 * 8.03e9 / 1e9 == pytest.approx(128.5, abs=0.1)  # the playbook's "8B needs 128 GB before activations"


def n_layer_params(cfg) -> float:
    m = cfg.model
    return m.d_model * (2 * m.n_heads + 2 * m.n_kv_heads) * m.kv_dim + 3 * m.d_model * m.d_ff + 2 * m.d_model


def test_playbook_activation_formula():
    """Korthikanti et al.: per layer sbh(34 + 5as/h); tp+SP divides all of it by t; full recomputation
    keeps 2sbh; the meshtrain block follows the same scaling in tp (with SP) and remat."""
    from meshtrain.planning.playbook import gpt_layer_activation_bytes as f
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B
    assert f(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert f(s, b, h, a, t=8, sequence_parallel=True) == pytest.approx(f(s, b, h, a) / 8)
    assert f(s, b, h, a, recompute="full") == 2 * s * b * h
    cfg = build_config({}, ["model.preset=llama3_8b", "data.seq_len=4096", "train.global_batch=8",
                            "mesh.fsdp=1", "mesh.dp=1"])
    none = layer_activation_bytes(cfg, Layout(dict(Layout.of(cfg).degrees, tp=1), remat="none", micro_batch=1),
                                  "reference")
    tp8 = layer_activation_bytes(cfg, Layout(dict(Layout.of(cfg).degrees, tp=8), remat="none", micro_batch=1,
                                             sequence_parallel=True), "reference")
    assert 7 < none / tp8 < 8.5  # everything but the replicated matmul inputs divides by t


# ---------------------------------------------------------------------------------------- the guard


def test_guard_names_consumers_and_cheapest_fix():
    cfg = build_config({}, SHAPE + ["mesh.dp=2", "mesh.fsdp=4", "train.zero_stage=1"])
    est = estimate(cfg, Layout.of(cfg)).total
    with pytest.raises(ConfigError) as e:
        guard.check(cfg, 8, "gpu", device_bytes=est * 0.8)
    msg = e.value.problems[0]
    assert "activations" in msg and "cheapest change that fits: " in msg and "run.memory_guard=false" in msg
    guard.check(cfg, 8, "gpu", device_bytes=est * 1.01)  # fits: no error


def test_guard_lists_equal_parts_in_one_order():
    """Equal parts print in the estimate's order, the same in every process (README's memory-guard line): they came
    from a set, whose order changed with each process's string hashing."""
    from meshtrain.planning.memory import Memory
    assert [k for k, _ in Memory(4.0, 4.0, 4.0, 1.0).biggest()] == ["params", "grads", "optimizer", "activations"]
    assert [k for k, _ in Memory(1.0, 2.0, 4.0, 2.0).biggest()] == ["optimizer", "grads", "activations", "params"]


def test_guard_first_suggests_a_larger_allocator_share_when_the_gpu_has_room():
    cfg = build_config({}, SHAPE + ["mesh.dp=2", "mesh.fsdp=4", "train.zero_stage=1"])
    est = guard.run_estimate_on(cfg, "gpu")[1].total  # what the guard estimates on a GPU (its Execution decides)
    with pytest.raises(ConfigError) as e:  # 0.75 of the GPU is 0.9x the estimate: 0.95 of it is 1.14x
        guard.check(cfg, 8, "gpu", device_bytes=est * 0.9, memory_fraction=0.75)
    msg = e.value.problems[0]
    assert "cheapest change that fits: run.gpu_memory_fraction=0.95 (" in msg and ", or train." in msg, msg
    with pytest.raises(ConfigError) as e:  # the allocator already takes 95%: only the config can change
        guard.check(cfg, 8, "gpu", device_bytes=est * 0.9, memory_fraction=0.95)
    assert "gpu_memory_fraction" not in e.value.problems[0]
    with pytest.raises(ConfigError) as e:  # even 95% of this GPU is too small
        guard.check(cfg, 8, "gpu", device_bytes=est * 0.5, memory_fraction=0.75)
    assert "gpu_memory_fraction" not in e.value.problems[0]


def test_llama3_8b_on_this_cpu_stops_with_one_line():
    # The guard runs before init_state: the 8B parameters are never drawn (the process would need
    # ~128 GiB). A generous timeout: if it ever allocated, it would be killed, not slow.
    proc = subprocess.run([sys.executable, "-m", "meshtrain.run", "model.preset=llama3_8b", "run.progress=false"],
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: memory: the estimate is"), proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------- the CLIs


def test_inspect_json_dump_and_diff(reports, tmp_path, capsys):
    from meshtrain import inspect as inspect_cli
    assert inspect_cli.main(["--devices", "8", "--json", "--dump", str(tmp_path), *SHAPE, "mesh.fsdp=8",
                             "train.zero_stage=3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"mesh", "params", "flops_per_step", "memory", "collectives"}
    assert set(out["memory"]) == {"argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes", "peak_bytes"}
    assert all(set(c) == {"op", "axes", "count", "bytes", "phase"} for c in out["collectives"])
    assert out["memory"] == reports["fsdp8_z3"].memory  # the same step as the fixture compiled
    index = (tmp_path / "INDEX.txt").read_text()
    assert "train_step.after_optimizations.hlo.txt" in index
    assert "all-gather" in (tmp_path / "train_step.after_optimizations.hlo.txt").read_text()
    inspect_cli.print_diff(reports["fsdp4_tp2_z1"], reports["fsdp8_z3"], "a", "b")
    diff = capsys.readouterr().out
    assert "reduce-scatter" in diff and "ZeRO-1" in diff and "ZeRO-3" in diff


def test_plan_json(capsys):
    from meshtrain import plan
    assert plan.main(["--devices", "8", "--device-memory", "80", "--json", "model.preset=llama3_8b",
                      "data.seq_len=4096", "train.global_batch=32", "precision.compute=bfloat16",
                      "mesh.dp=8", "mesh.fsdp=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"given", "candidates"} <= set(out)
    keys = {"params", "grads", "optimizer", "activations", "total"}
    assert set(out["given"]["memory_bytes"]) == keys and out["given"]["memory_bytes"]["total"] > 80 * 2**30
    assert out["candidates"] and all(c["memory_bytes"]["total"] <= 80 * 2**30 for c in out["candidates"])
    assert all(set(c["memory_bytes"]) == keys and c["step_time_s"] > 0 for c in out["candidates"])
    times = [c["step_time_s"] for c in out["candidates"]]
    assert times == sorted(times)
    assert "dp" in out["rejected"] and "over memory" in out["rejected"]["dp"]


def test_plan_searches_pipelines_with_a_microbatch_per_stage():
    """Every pipeline layout the planner proposes runs its schedule: at least one microbatch per stage."""
    from meshtrain.planning.search import search
    from meshtrain.planning.timing import Rates

    cfg = build_config({}, ["model.preset=llama1b", "data.seq_len=2048", "train.global_batch=16",
                            "precision.compute=bfloat16"])
    fits, refused = search(cfg, 4, 80 * 2**30, Rates.preset("h100"), top=10_000)
    piped = [c.layout for c in fits if c.layout.degrees["pp"] > 1]
    assert {lay.degrees["pp"] for lay in piped} == {2, 4}, refused
    assert all(lay.grad_accum >= lay.degrees["pp"] for lay in piped)
    # The schedules and their virtual stages are searched too, each one that runs these arguments.
    assert {(lay.schedule, lay.virtual_stages) for lay in piped} >= {("1f1b", 1), ("interleaved", 2),
                                                                      ("interleaved", 4), ("zb_h1", 1),
                                                                      ("dualpipe_v", 2)}
    assert not any(validate_args(lay.schedule, lay.degrees["pp"], lay.grad_accum, lay.virtual_stages) or
                   cfg.model.n_layers % (lay.degrees["pp"] * lay.virtual_stages) for lay in piped)


def test_plan_takes_the_fused_loss_only_where_the_plain_one_does_not_fit():
    """Llama-3-8B at 6 sequences a GPU on two H200s fits only with the fused loss, which the plan then proposes first
    (what configs/llama3_8b_2xh200.yaml runs: 128.6 GiB measured); a layout that fits with the plain loss keeps it."""
    from meshtrain.planning.search import search
    from meshtrain.planning.timing import Rates

    cfg = load_config("configs/llama3_8b_2xh200.yaml", ["model.loss=reference"])
    fits, _ = search(cfg, 2, 133.4 * 2**30, Rates.preset("h200"), top=None)
    best = fits[0].layout
    assert (best.loss, best.degrees["fsdp"], best.zero_stage, best.remat, best.grad_accum) == (
        "fused", 2, 3, "save_dots_attn", 1), best.label()
    assert "model.loss=fused" in best.overrides()
    plain = [c for c in fits if c.layout.loss == "reference"]
    assert plain and all(c.memory.total <= 133.4 * 2**30 for c in plain)
    for c in fits:  # the fused loss appears only where the same layout with the plain loss is over memory
        g = c.layout.degrees
        if c.layout.loss == "fused" and g["pp"] == g["cp"] == g["sp"] == 1:  # cuDNN attention: "flash"
            alone = estimate(cfg, replace(c.layout, loss="reference"), "flash", backend="gpu").total
            assert alone > 133.4 * 2**30, c.layout.label()


def test_pipeline_options_are_the_schedules_that_run():
    from meshtrain.planning.search import pipeline_options

    cfg = build_config({}, ["model.preset=llama3_70b"])  # 80 layers
    opts = pipeline_options(cfg, 4, 64)
    assert {("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("interleaved", 5), ("zb_h1", 1),
            ("dualpipe_v", 2)} <= set(opts)
    assert ("interleaved", 3) not in opts and ("interleaved", 8) not in opts  # 80 layers over 12 or 32 chunks
    assert ("interleaved", 2) not in pipeline_options(cfg, 4, 6)  # 6 microbatches in groups of 4
    assert ("dualpipe_v", 2) not in pipeline_options(cfg, 4, 6)  # needs two per stage


def test_pipeline_time_is_the_executor_program_with_the_head():
    """The bubble is timed on the program the executor runs, its ops priced in chunk forwards and the last
    chunk's backward carrying the head: without a head it is the executor's op makespan over the ideal, the head
    lengthens it, and the ratio of two schedules comes out as measured on 2x H200 (llama1b, seq 2048, pp=2,
    8 microbatches, docs/PERFORMANCE.md 2026-11-28 evening: zb_h1 with its Ws moved 179.9 ms against 1f1b 186.1;
    the model says 0.928, 4% more gain than measured)."""
    from meshtrain.planning.memory_pipeline import program
    from meshtrain.planning.timing import _span, pipeline_span

    t = program("zb_h1", 4, 8, 1)
    assert _span("zb_h1", 4, 8, 1, 0.0) == pytest.approx(t.op_makespan / (8 * 3))
    assert _span("1f1b", 2, 8, 1, 0.0) == pytest.approx(1.125)  # the formula's 1 + (p-1)/m, run as is
    assert _span("1f1b", 2, 8, 1, 0.5) > _span("1f1b", 2, 8, 1, 0.0)
    cfg = build_config({}, ["model.preset=llama1b", "data.seq_len=2048", "train.global_batch=8"])
    lay = Layout(dict(pp=2, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1), grad_accum=8, micro_batch=1)
    # zb_h1 against 1F1B, measured on 2x H200 (docs/PERFORMANCE.md, 2026-11-28 evening, call 5)
    ratio = pipeline_span(cfg, replace(lay, schedule="zb_h1")) / pipeline_span(cfg, lay)
    assert ratio == pytest.approx(179.9 / 186.1, rel=0.05)


def test_pipeline_ticks_cost_what_interleaved_measured_against_1f1b():
    """Interleaved's smaller bubble is spent on twice 1F1B's ticks (Rates.tick_s): its step against 1F1B's as
    measured on 2x H100 (llama1b seq 2048 pp=2, docs/PERFORMANCE.md 2026-11-27), within 1%. The split schedules
    (not fitted) against what two H200s measured with their Ws moved into ticks with room (2026-11-28 evening,
    call 5), within 1%: their smaller bubble less the traffic of what B keeps for W (memory_passes_bytes)."""
    from meshtrain.planning.timing import Rates, step_time

    for device, kind, m, measured in (("h100", "interleaved", 8, 207.0 / 209.4),
                                      ("h100", "interleaved", 16, 382.1 / 376.7),
                                      ("h200", "zb_h1", 8, 179.9 / 186.1), ("h200", "dualpipe_v", 8, 188.4 / 186.1)):
        cfg = build_config({}, ["model.preset=llama1b", "data.seq_len=2048", f"train.global_batch={m}",
                                "precision.compute=bfloat16"])
        lay = Layout(dict(pp=2, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1), grad_accum=m, micro_batch=1)
        chunked = replace(lay, schedule=kind, virtual_stages=1 if kind == "zb_h1" else 2)
        rates = Rates.preset(device)
        ratio = step_time(cfg, chunked, rates, 2)["total_s"] / step_time(cfg, lay, rates, 2)["total_s"]
        assert ratio == pytest.approx(measured, rel=0.01), kind


def test_interleaved_moves_no_blocks():
    """The state keeps interleaved's and dualpipe_v's chunks on the stages that run them: a step sends the stages'
    messages only, as 1F1B's does."""
    from meshtrain.planning.timing import comm_bytes

    lay = Layout(dict(pp=2, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1), grad_accum=8, micro_batch=8)
    cfg = build_config({}, ["model.preset=llama1b", "data.seq_len=2048", "train.global_batch=8"])
    for kind in ("interleaved", "dualpipe_v"):
        assert comm_bytes(cfg, replace(lay, schedule=kind, virtual_stages=2))["pp"] == comm_bytes(cfg, lay)["pp"] > 0


def test_plan_lists_pipelines_for_llama3_70b_on_64_gpus(capsys):
    """The job NVIDIA runs as TP4 PP4 CP2 VP5: the plan's list holds pipeline layouts (with virtual stages), each
    fitting the 80 GiB it was given."""
    from meshtrain import plan
    assert plan.main(["--devices", "64", "--device-memory", "80", "--json", "model.preset=llama3_70b",
                      "data.seq_len=8192", "train.global_batch=128"]) == 0
    out = json.loads(capsys.readouterr().out)
    piped = [c for c in out["candidates"] + out["other_families"] if c["layout"]["pp"] > 1]
    assert piped and all(c["memory_bytes"]["total"] <= 80 * 2**30 for c in piped)
    assert any("pipeline.virtual_stages=5" in c["overrides"] for c in piped)
