"""run.profile_steps writes a jax.profiler trace of its window; meshtrain.profile turns a trace into time
by category. The accounting is checked exactly on a hand-written GPU-shaped trace (two streams, a
collective half under a GEMM), and end to end on a real CPU trace of a tiny run."""
from __future__ import annotations

import gzip
import json

import pytest
import yaml

from helpers import run_cli
from meshtrain.config import ConfigError, build_config, validate
from meshtrain.profile.__main__ import main
from meshtrain.profile.table import profile_report
from meshtrain.profile.timeline import self_time_pieces
from meshtrain.profile.trace import PROGRAM_FILE, Kernel, classify, program_scopes

# ------------------------------------------------------------------------------------------- config


def profile_problems(value, *overrides: str) -> list[str]:
    file_values = {"run": {"profile_steps": value}} if not isinstance(value, str) else None
    cli = [f"run.profile_steps={value}"] if isinstance(value, str) else []
    try:
        validate(build_config(file_values, ["train.steps=20", *cli, *overrides]), 8)
    except ConfigError as e:
        return [p for p in e.problems if "profile_steps" in p]
    return []


@pytest.mark.parametrize("value", ["", "0:1", "10:13", "19:20"])
def test_profile_steps_accepts_a_window(value):
    assert profile_problems(value) == []


@pytest.mark.parametrize("value,fragment", [
    ("3:3", "0 <= START < END"), ("5:2", "0 <= START < END"), ("-1:2", "0 <= START < END"),
    ("abc", "START:END"), ("3", "START:END"), ("1:3:5", "START:END"), ("1.5:3", "START:END"),
    ("10:21", "past train.steps=20"),
    (613, "quote it in YAML"),  # what an unquoted 10:13 in a YAML file becomes (base 60)
])
def test_profile_steps_mistakes_are_one_line_naming_field_value_and_fix(value, fragment):
    problems = profile_problems(value)
    assert len(problems) == 1, problems
    assert f"run.profile_steps={str(value)!r}" in problems[0] and fragment in problems[0]


def test_unquoted_yaml_window_really_is_base_60():
    assert yaml.safe_load("profile_steps: 10:13") == {"profile_steps": 613}


# ---------------------------------------------------------------------------------------- classifier

CLASSIFIED = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_kernel__5x_cublas", {}, "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", {}, "gemm"),
    ("gemm_fusion_dot_12", {"hlo_op": "gemm_fusion_dot.12"}, "gemm"),
    ("dot.147", {}, "gemm"),
    ("ynn_fusion.3", {}, "gemm"),
    ("gmm_kernel", {}, "gemm"),  # the experts' grouped GEMMs, forward and d_lhs, then d_rhs
    ("tgmm_kernel", {}, "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_6_64x128x128_4x1x1_kernel0_0", {}, "attention"),
    ("flash_attention_bwd_dkdv", {}, "attention"),
    ("ncclDevKernel_AllGather_RING_LL", {}, "collective"),
    ("all-reduce.141", {}, "collective"),
    ("reduce-scatter.2", {}, "collective"),
    ("kernel", {"hlo_op": "collective-permute-start.3"}, "collective"),
    ("MemcpyH2D", {}, "memcpy"),
    ("loop_add_fusion", {"hlo_op": "loop_add_fusion.4"}, "elementwise"),
    ("input_reduce_fusion_3", {}, "elementwise"),
    ("rms_norm_fwd", {}, "elementwise"),
    ("wrapped_convert", {}, "elementwise"),
    ("loop_multiply_fusion", {"tf_op": "jit(step)/optimizer/adam/mul"}, "optimizer"),
    ("while.93", {}, "other"),
]


@pytest.mark.parametrize("name,args,category", CLASSIFIED, ids=[c[0][:30] for c in CLASSIFIED])
def test_classifier(name, args, category):
    assert classify(name, args) == category


def test_nested_thunk_keeps_only_its_self_time():
    k = lambda name, s, t: Kernel("cpu:0", (1, 1), s, t, name, classify(name))  # noqa: E731
    loop, body_a, body_b = k("while.1", 0, 10), k("dot.1", 2, 4), k("add_fusion", 6, 9)
    pieces = [(s, t, kern.name) for s, t, kern in self_time_pieces([body_b, loop, body_a])]
    assert pieces == [(0, 2, "while.1"), (2, 4, "dot.1"), (4, 6, "while.1"), (6, 9, "add_fusion"),
                      (9, 10, "while.1")]



def test_back_to_back_kernels_that_overlap_by_jitter_follow_each_other():
    """GPU traces put a stream's next kernel a fraction of a microsecond before the last one ends; the
    later kernel is not nested in the earlier one (that reading turned most of a real 1B trace into
    idle time): each keeps its own span up to where the next begins."""
    k = lambda name, s, t: Kernel("gpu:0", (2, 14), s, t, name, classify(name))  # noqa: E731
    short, long_, after = k("wrapped_convert", 0.0, 10.0), k("nvjet_sm90_tst_256x128", 9.8, 330.0), \
        k("loop_add_fusion", 329.7, 400.0)
    pieces = [(s, t, kern.name) for s, t, kern in self_time_pieces([long_, after, short])]
    assert pieces == [(0.0, 9.8, "wrapped_convert"), (9.8, 329.7, "nvjet_sm90_tst_256x128"),
                      (329.7, 400.0, "loop_add_fusion")]


# ------------------------------------------------------------------ accounting on a synthetic trace


def write_trace(path, kernels: list[tuple[int, str, float, float]], modules: list[tuple[float, float]],
                markers: list[tuple[int, float, float]]) -> None:
    """Chrome trace as jax writes it: /host:CPU with the step markers, /device:GPU:0 with stream
    threads (tid 1, 2, ...) and an XLA Modules line (tid 99). Times in microseconds."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 2, "tid": 99, "name": "thread_name", "args": {"name": "XLA Modules"}}]
    for tid in sorted({k[0] for k in kernels}):
        ev.append({"ph": "M", "pid": 2, "tid": tid, "name": "thread_name", "args": {"name": f"Stream #{tid}(Compute)"}})
    ev += [{"ph": "X", "pid": 2, "tid": tid, "ts": s, "dur": t - s, "name": name, "args": {"hlo_module": "jit_step"}}
           for tid, name, s, t in kernels]
    ev += [{"ph": "X", "pid": 2, "tid": 99, "ts": s, "dur": t - s, "name": "jit_step(1)"} for s, t in modules]
    ev += [{"ph": "X", "pid": 1, "tid": 7, "ts": s, "dur": t - s, "name": "train_step", "args": {"step_num": str(n)}}
           for n, s, t in markers]
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": ev}, f)


def test_collective_half_under_a_gemm_is_half_exposed(tmp_path):
    # Step 1 (module 0-30 us): all-reduce [0, 10) on stream 2 under a GEMM [5, 15) on stream 1, a loop
    # fusion [20, 30). Step 2 (module 40-50): a copy then a GEMM. Idle: 15-20 within, 30-40 between.
    write_trace(tmp_path / "vm.trace.json.gz",
                [(2, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 10), (1, "sm90_xmma_gemm_bf16", 5, 15),
                 (1, "loop_add_fusion", 20, 30), (3, "MemcpyD2D", 40, 42), (1, "nvjet_tst_64x8", 42, 50)],
                modules=[(0, 30), (40, 50)], markers=[(10, -5, -1), (11, 35, 38)])
    r = profile_report(tmp_path)
    c = {k: v["ms"] * 1e3 for k, v in r["categories"].items()}  # back to microseconds
    assert r["devices"] == ["gpu:0"] and r["wall_ms"] * 1e3 == pytest.approx(50)
    assert (r["steps"], r["steps_from"]) == (2, "train_step markers")
    assert c == pytest.approx(dict(gemm=18, attention=0, elementwise=10, optimizer=0, other=0, collective=5,
                                   memcpy=2, idle_between=10, idle_within=5))
    assert r["collectives_hidden"]["ms"] * 1e3 == pytest.approx(5)
    assert sum(c.values()) == pytest.approx(50)
    assert r["categories"]["gemm"]["ms_per_step"] * 1e3 == pytest.approx(9)
    assert r["categories"]["gemm"]["kernels"] == 2 and r["categories"]["collective"]["kernels"] == 1
    top = {t["name"]: t["ms"] * 1e3 for t in r["top_kernels"]}  # self time: the hidden collective in full
    assert top == pytest.approx({"sm90_xmma_gemm_bf16": 10, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 10,
                                 "loop_add_fusion": 10, "nvjet_tst_64x8": 8, "MemcpyD2D": 2})
    # The idle gaps: 15-20 (5 us, launch-sized) and 30-40 (10 us), longest first with their neighbours.
    gaps = r["idle_gaps"]
    assert [b["count"] for b in gaps["bins"]] == [1, 1, 0, 0]
    assert [b["ms"] * 1e3 for b in gaps["bins"]] == pytest.approx([5, 10, 0, 0])
    assert [(g["us"], g["at_ms"] * 1e3, g["prev"], g["next"]) for g in gaps["longest"]] == [
        (10, 30, "loop_add_fusion", "MemcpyD2D"), (5, 15, "sm90_xmma_gemm_bf16", "loop_add_fusion")]


def test_two_devices_get_a_row_each(tmp_path, capsys):
    """Under pp each device is a stage and the averages hide an uneven split: gpu:0 computes 30 us and
    waits 10 in a send/recv, gpu:1 computes 10 us, copies 5 and idles the rest of the 40 us window."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for pid, gpu, kernels in ((2, 0, [("nvjet_sm90_tst_128x128", 0, 30), ("ncclDevKernel_SendRecv", 30, 40)]),
                              (3, 1, [("loop_add_fusion", 0, 10), ("MemcpyD2D", 10, 15)])):
        ev += [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"/device:GPU:{gpu}"}},
               {"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "Stream #1(Compute)"}}]
        ev += [{"ph": "X", "pid": pid, "tid": 1, "ts": s, "dur": t - s, "name": name,
                "args": {"hlo_module": "jit_step"}} for name, s, t in kernels]
    with gzip.open(tmp_path / "vm.trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": ev}, f)
    r = profile_report(tmp_path, steps=1)
    us = {d: {k: v * 1e3 for k, v in row.items()} for d, row in r["by_device"].items()}
    assert us == {"gpu:0": pytest.approx(dict(compute=30, collective=10, memcpy=0, idle=0)),
                  "gpu:1": pytest.approx(dict(compute=10, collective=0, memcpy=5, idle=25))}
    assert main([str(tmp_path), "--steps", "1"]) == 0
    table = capsys.readouterr().out
    assert "gpu:1" in table.split("per device, ms/step")[1]


PROGRAM = """HloModule jit_step, entry_computation_layout={...}

%fused_select.5 (param_0: f32[4096]) -> f32[4096] {
  ROOT %select.3 = f32[4096]{0} select(%p, %a, %b), metadata={op_name="jit(step)/optimizer/jit(_where)/select_n"}
}

ENTRY %main.9 (p0: f32[4096]) -> f32[4096] {
  %loop_select_fusion.5 = f32[4096]{0} fusion(%p0), kind=kLoop, calls=%fused_select.5, metadata={op_name="jit(step)/optimizer/jit(_where)/select_n" stack_frame_id=3}, backend_config={}
  %loop_add_fusion = f32[4096]{0} fusion(%p0), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/Decoder/CausalSelfAttention/add"}
  ROOT %all-reduce.2 = f32[4096]{0} all-reduce(%x), metadata={op_name="jit(step)/optimizer/psum"}
}
"""


def test_program_scopes_read_every_instruction_under_both_spellings():
    scopes = program_scopes(PROGRAM)
    update = "jit(step)/optimizer/jit(_where)/select_n"
    assert scopes["loop_select_fusion.5"] == scopes["loop_select_fusion_5"] == update
    assert scopes["all_reduce_2"] == "jit(step)/optimizer/psum"
    assert scopes["loop_add_fusion"] == "jit(step)/Decoder/CausalSelfAttention/add"


def test_program_file_moves_the_fused_update_to_optimizer(tmp_path, capsys):
    """Only kernels the broad rules call elementwise (or other) move: a collective in the optimizer's scope
    stays a collective, and a module name in op_name (...Attention...) changes nothing."""
    kernels = [(1, "loop_select_fusion_5", 0, 10), (1, "loop_add_fusion", 10, 14),
               (2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 14, 16)]
    write_trace(tmp_path / "vm.trace.json.gz", kernels, modules=[(0, 16)], markers=[])
    before = profile_report(tmp_path)
    assert before["program"] is None and any(PROGRAM_FILE in n for n in before["notes"])
    assert before["categories"]["optimizer"]["ms"] == 0
    (tmp_path / PROGRAM_FILE).write_text(PROGRAM)
    c = {k: v["ms"] * 1e3 for k, v in profile_report(tmp_path)["categories"].items()}
    assert (c["optimizer"], c["elementwise"], c["collective"], c["attention"]) == pytest.approx((10, 4, 2, 0))
    (tmp_path / PROGRAM_FILE).rename(tmp_path / "elsewhere.hlo")  # a program from --xla_dump_to, say
    assert main([str(tmp_path), "--json", "--program", str(tmp_path / "elsewhere.hlo")]) == 0
    assert json.loads(capsys.readouterr().out)["categories"]["optimizer"]["ms"] * 1e3 == pytest.approx(10)
    assert classify("loop_select_fusion_5", {}, "jit(step)/optimizer/jit(_where)/select_n") == "optimizer"
    assert classify("loop_select_fusion_5", {}, "jit(step)/Decoder/select_n") == "elementwise"


def test_table_and_json_entry_point(tmp_path, capsys):
    write_trace(tmp_path / "vm.trace.json.gz", [(1, "sm90_xmma_gemm_bf16", 0, 10)], modules=[(0, 10)], markers=[])
    assert main([str(tmp_path), "--steps", "2"]) == 0
    table = capsys.readouterr().out
    assert "over 2 steps (--steps)" in table and "GEMM" in table and "collectives hidden" in table
    assert main([str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["categories"]["gemm"]["pct"] == pytest.approx(100)
    assert main([str(tmp_path / "nowhere")]) == 2


# ------------------------------------------------------------------------------ a real trace, end to end


def test_tiny_run_writes_a_trace_that_the_table_reads(tmp_path):
    proc = run_cli("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.steps=3", "run.profile_steps=1:3",
                   f"run.dir={tmp_path}")
    assert f"profiled steps 1:3 into {tmp_path / 'profile'}" in proc.stdout
    traces = list((tmp_path / "profile").rglob("*.trace.json.gz"))
    assert len(traces) == 1
    r = profile_report(tmp_path / "profile")
    assert (r["steps"], r["steps_from"]) == (2, "train_step markers")
    assert len(r["devices"]) == 8
    c = {k: v["ms"] for k, v in r["categories"].items()}
    assert r["program"] == str(tmp_path / "profile" / PROGRAM_FILE)  # written by the run, read by the table
    for category in ("gemm", "elementwise", "collective", "optimizer"):  # dots, fusions, reductions, AdamW
        assert c[category] > 0, (category, c)
    busy = sum(v for k, v in c.items() if not k.startswith("idle"))
    assert 0 < busy <= r["wall_ms"] * (1 + 1e-9)
    assert sum(c.values()) == pytest.approx(r["wall_ms"], rel=1e-6)
    assert all(t["ms"] > 0 for t in r["top_kernels"])
