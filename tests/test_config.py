"""Config errors: every mistake is one ConfigError line naming the field and the value, all reported at
once, and the CLI turns them into `config error:` lines with exit status 2 and no traceback."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshtrain.config import (
    PRESETS, Config, ConfigError, ModelConfig, build_config, load_config, padded_vocab, to_yaml, validate,
)

REPO = Path(__file__).resolve().parents[1]
N_DEVICES = 8


def problems_of(overrides: list[str], file_values: dict | None = None, n_devices: int = N_DEVICES) -> list[str]:
    """Every problem that loading (build_config) or validate() reports; [] for a good config.

    Any exception other than ConfigError propagates and fails the test: user input must never reach one.
    """
    try:
        validate(build_config(file_values, overrides), n_devices)
    except ConfigError as e:
        return e.problems
    return []


# (overrides, YAML mapping, fragments that one single problem line must all contain)
BAD = [
    # ---- mesh against the device count
    pytest.param(["mesh.fsdp=1", "mesh.dp=2", "mesh.tp=2"], None, ["mesh.dp=2", "mesh.tp=2", "4 devices", "8"],
                 id="mesh-product-not-device-count"),
    pytest.param(["mesh.tp=3"], None, ["mesh.fsdp=-1", "multiply to 3", "8 devices"],
                 id="mesh-free-degree-does-not-divide"),
    pytest.param(["mesh.dp=-1"], None, ["mesh.dp", "mesh.fsdp", "-1"], id="mesh-two-free-degrees"),
    pytest.param(["mesh.tp=0"], None, ["mesh.tp=0", ">= 1"], id="mesh-degree-zero"),
    pytest.param(["mesh.dp=-3"], None, ["mesh.dp=-3"], id="mesh-degree-negative"),
    # ---- model shape against tp / fsdp
    pytest.param(["model.n_heads=6", "model.n_kv_heads=2", "model.head_dim=16", "mesh.tp=4"], None,
                 ["model.n_heads=6", "mesh.tp=4"], id="heads-not-divisible-by-tp"),
    pytest.param(["model.n_heads=12", "model.n_kv_heads=6", "model.head_dim=16", "mesh.tp=4"], None,
                 ["model.n_kv_heads=6", "mesh.tp=4"], id="kv-heads-neither-below-nor-divisible-by-tp"),
    pytest.param(["model.n_heads=12", "model.n_kv_heads=3", "model.head_dim=16", "model.d_ff=96", "mesh.tp=4",
                  "mesh.fsdp=2", "model.attention=pallas"], None,
                 ["model.attention=pallas", "model.n_kv_heads=3", "mesh.tp=4", "multiple"],
                 id="pallas-kv-groups-straddle-tp-shards"),
    pytest.param(["model.n_kv_heads=3"], None, ["model.n_kv_heads=3", "model.n_heads=4"],
                 id="kv-heads-not-dividing-heads"),
    pytest.param(["model.d_model=100", "model.n_heads=5", "model.n_kv_heads=5"], None,
                 ["model.d_model=100", "mesh.fsdp=8"], id="d-model-not-divisible-by-fsdp"),
    pytest.param(["model.d_model=130"], None, ["model.d_model=130", "model.n_heads=4"],
                 id="d-model-not-divisible-by-heads"),
    pytest.param(["model.d_ff=350", "mesh.tp=4"], None, ["model.d_ff=350", "mesh.tp=4"],
                 id="d-ff-not-divisible-by-tp"),
    pytest.param(["model.head_dim=-4"], None, ["model.head_dim=-4"], id="head-dim-negative"),
    pytest.param(["model.n_layers=0"], None, ["model.n_layers=0", ">= 1"], id="layers-zero"),
    # ---- batch and sequence splits
    pytest.param(["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.global_batch=18", "train.grad_accum=3"], None,
                 ["train.global_batch=18", "2*2*1*3 = 12"], id="global-batch-not-divisible"),
    pytest.param(["model.preset=tiny_moe", "mesh.ep=4", "mesh.fsdp=2", "train.global_batch=12"], None,
                 ["train.global_batch=12", "mesh.ep", "1*2*4*1 = 8"], id="global-batch-not-divisible-by-ep"),
    pytest.param(["mesh.tp=2", "parallel.sequence_parallel=true", "data.seq_len=63"], None,
                 ["data.seq_len=63", "mesh.tp", "= 2"], id="seq-len-not-divisible-with-sequence-parallel"),
    pytest.param(["train.global_batch=0"], None, ["train.global_batch=0", ">= 1"], id="global-batch-zero"),
    # ---- parallelism not built yet
    # ---- pipeline (mesh.pp > 1)
    pytest.param(["mesh.pp=2"], None, ["mesh.pp=2 needs train.grad_accum=4", "it is 1", "add train.grad_accum=4"],
                 id="pp-fewer-microbatches"),
    pytest.param(["mesh.pp=2", "train.grad_accum=2", "model.n_layers=3"], None,
                 ["model.n_layers=3", "mesh.pp*pipeline.virtual_stages", "2*1 = 2"], id="pp-layers-not-divisible"),
    pytest.param(["mesh.pp=4", "mesh.fsdp=2", "train.grad_accum=6", "train.global_batch=24", "model.n_layers=8",
                  "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"], None,
                 ["train.grad_accum=6", "multiple of 4"], id="pp-interleaved-microbatches-not-multiple"),
    pytest.param(["mesh.pp=2", "train.grad_accum=4", "pipeline.schedule=dualpipe_v"], None,
                 ["pipeline.virtual_stages=1", "pipeline.virtual_stages=2"], id="pp-dualpipe-needs-two-chunks"),
    pytest.param(["mesh.pp=2", "train.grad_accum=2", "pipeline.virtual_stages=2"], None,
                 ["pipeline.virtual_stages=2", "pipeline.schedule=interleaved"], id="pp-chunks-need-interleaved"),
    pytest.param(["mesh.pp=2", "train.grad_accum=2", "model.scan_layers=false"], None,
                 ["mesh.pp=2 needs model.scan_layers=true", "add model.scan_layers=true"], id="pp-needs-scanned-layers"),
    # A config written for one GPU: both needs on one line, with the overrides that fix them.
    pytest.param(["mesh.pp=2", "model.scan_layers=false"], None,
                 ["mesh.pp=2 needs model.scan_layers=true", "add model.scan_layers=true train.grad_accum=4"],
                 id="pp-one-line-for-a-one-gpu-config"),
    pytest.param(["pipeline.schedule=gpipe"], None, ["pipeline.schedule='gpipe'", "1f1b"], id="pp-unknown-schedule"),
    pytest.param(["mesh.cp=2", "data.seq_len=62"], None, ["data.seq_len=62", "2*mesh.cp*mesh.sp = 4"],
                 id="seq-len-not-divisible-by-zigzag-chunks"),
    pytest.param(["mesh.sp=8"], None, ["model.n_heads=4", "mesh.tp*mesh.sp = 8"], id="heads-not-divisible-by-sp"),
    # ---- mixture of experts
    pytest.param(["mesh.ep=2"], None, ["mesh.ep=2", "moe.n_experts", "mesh.ep=1"], id="ep-without-experts"),
    pytest.param(["model.preset=tiny_moe", "mesh.ep=8", "moe.n_experts=12"], None,
                 ["moe.n_experts=12", "mesh.ep=8"], id="experts-not-divisible-by-ep"),
    pytest.param(["moe.n_experts=4", "moe.top_k=5"], None, ["moe.top_k=5", "moe.n_experts=4"], id="top-k-too-big"),
    pytest.param(["moe.n_experts=4", "moe.top_k=0"], None, ["moe.top_k=0"], id="top-k-zero"),
    pytest.param(["moe.n_experts=4", "moe.d_ff_expert=30", "mesh.tp=4", "mesh.fsdp=2"], None,
                 ["moe.d_ff_expert=30", "mesh.tp=4"], id="expert-ffn-not-divisible-by-tp"),
    pytest.param(["moe.n_experts=4", "moe.every=3"], None, ["moe.every=3", "model.n_layers=2"],
                 id="every-not-dividing-layers"),
    pytest.param(["moe.n_experts=4", "moe.capacity_factor=-1"], None, ["moe.capacity_factor=-1"],
                 id="capacity-negative"),
    pytest.param(["moe.n_experts=4", "moe.aux_loss_coef=-0.1"], None, ["moe.aux_loss_coef=-0.1"], id="aux-negative"),
    pytest.param(["moe.n_experts=4", "moe.n_shared=-1"], None, ["moe.n_shared=-1"], id="shared-negative"),
    pytest.param(["moe.n_experts=-2"], None, ["moe.n_experts=-2", ">= 0"], id="experts-negative"),
    pytest.param(["moe.router=topk"], None, ["moe.router='topk'", "softmax", "sigmoid"], id="bad-router"),
    pytest.param(["moe.dispatch=nccl"], None, ["moe.dispatch='nccl'", "allgather", "padded"], id="bad-dispatch"),
    pytest.param(["moe.grouped_matmul=cutlass"], None, ["moe.grouped_matmul='cutlass'", "ragged_dot", "pallas"],
                 id="bad-grouped-matmul"),
    # ---- training knobs
    pytest.param(["train.zero_stage=5"], None, ["train.zero_stage=5", "0, 1, 2 or 3"], id="zero-stage-5"),
    pytest.param(["train.remat=everything"], None, ["train.remat='everything'", "save_dots"], id="remat-unknown"),
    pytest.param(["train.remat=names:qkv,bogus"], None, ["train.remat=", "'bogus'", "mlp_hidden"],
                 id="remat-unknown-point"),
    pytest.param(["train.remat=none+names:moe_out"], None, ["train.remat='none+names:moe_out'", "'none'"],
                 id="remat-none-joined"),
    pytest.param(["train.remat=save_dots+names:moe_in,bogus"], None, ["'bogus'", "moe_hidden"],
                 id="remat-joined-unknown-point"),
    pytest.param(["train.steps=100", "train.schedule_steps=50"], None,
                 ["train.schedule_steps=50", "train.steps=100"],
                 id="schedule-shorter-than-steps"),
    pytest.param(["train.warmup_steps=-1"], None, ["train.warmup_steps=-1"], id="warmup-negative"),
    pytest.param(["train.lr=0"], None, ["train.lr=0"], id="lr-zero"),
    # ---- data
    pytest.param(["data.source=file", "data.path=/nonexistent/tokens.bin"], None,
                 ["data.path", "/nonexistent/tokens.bin", "no such file"], id="data-file-missing"),
    pytest.param(["data.source=file"], None, ["data.path", "empty", "prepare_data"], id="data-file-path-empty"),
    # ---- names and types (found while loading, before validate)
    pytest.param(["train.stpes=3"], None, ["train.stpes", "did you mean 'train.steps'"], id="unknown-key-typo"),
    pytest.param(["mesh.fdsp=2"], None, ["mesh.fdsp", "did you mean 'mesh.fsdp'"], id="unknown-key-typo-mesh"),
    pytest.param(["trian.steps=3"], None, ["trian.steps", "did you mean 'train.steps'"],
                 id="unknown-section-override"),
    pytest.param([], {"trian": {"steps": 3}}, ["'trian'", "did you mean 'train'"], id="unknown-section-yaml"),
    pytest.param([], {"train": {"stpes": 3}}, ["train.stpes", "did you mean 'train.steps'"], id="unknown-key-yaml"),
    pytest.param(["parallel.tp_overlapp=none"], None, ["parallel.tp_overlapp", "did you mean 'parallel.tp_overlap'"],
                 id="unknown-key-typo-parallel"),
    pytest.param(["model.cp_imp=ring"], None, ["model.cp_imp", "did you mean 'parallel.cp_impl'"],
                 id="unknown-key-typo-of-an-old-spelling"),
    pytest.param(["mesh.sequence_parallel=true", "parallel.sequence_parallel=true"], None,
                 ["mesh.sequence_parallel and parallel.sequence_parallel are both given", "keep only parallel."],
                 id="old-and-new-spelling"),
    pytest.param([], {"model": {"cp_layout": "contiguous"}, "parallel": {"cp_layout": "zigzag"}},
                 ["model.cp_layout and parallel.cp_layout are both given"], id="old-and-new-spelling-yaml"),
    pytest.param([], {"train": [1, 2]}, ["section 'train'", "mapping"], id="section-not-a-mapping"),
    pytest.param([], {7: {"steps": 3}}, ["'7'", "valid keys"], id="section-name-not-a-string"),
    pytest.param(["train.steps=abc"], None, ["train.steps='abc'", "integer"], id="bad-type-int"),
    pytest.param(["train.steps=2.5"], None, ["train.steps=2.5", "integer"], id="bad-type-fractional-int"),
    pytest.param(["train.lr=fast"], None, ["train.lr='fast'", "number"], id="bad-type-float"),
    pytest.param(["parallel.sequence_parallel=maybe"], None, ["parallel.sequence_parallel='maybe'", "true or false"],
                 id="bad-type-bool"),
    pytest.param(["precision.compute=fp8"], None, ["precision.compute='fp8'", "bfloat16"], id="bad-literal"),
    pytest.param(["model.attention=flash"], None, ["model.attention='flash'", "cudnn"], id="bad-literal-attention"),
    pytest.param(["model.embedding_grad=sorted"], None,
                 ["model.embedding_grad='sorted'", "scatter", "sorted_segment_sum", "onehot"],
                 id="bad-literal-embedding-grad"),
    pytest.param(["model.preset=gpt5"], None, ["model.preset='gpt5'", "unknown preset", "llama1b"],
                 id="unknown-preset"),
    pytest.param(["train.steps"], None, ["train.steps", "section.key=value"], id="override-without-equals"),
    pytest.param(["run.cpu_devices=0"], None, ["run.cpu_devices=0", ">= 1"], id="cpu-devices-zero"),
]


@pytest.mark.parametrize("overrides,file_values,fragments", BAD)
def test_config_error_names_field_and_value(overrides, file_values, fragments):
    problems = problems_of(overrides, file_values)
    assert problems, "expected a ConfigError"
    assert all("\n" not in p for p in problems), problems  # one line per problem
    assert any(all(f in p for f in fragments) for p in problems), (fragments, problems)


# Near misses of the rows above that are valid: they keep the checks from refusing good configs.
GOOD = [
    pytest.param([], dict(fsdp=8), id="defaults-fsdp-takes-all"),
    pytest.param(["mesh.fsdp=1", "mesh.dp=-1"], dict(dp=8, fsdp=1), id="dp-takes-the-rest"),
    pytest.param(["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.grad_accum=2"], dict(dp=2, fsdp=2, tp=2),
                 id="dp2-fsdp2-tp2-accum2"),
    pytest.param(["mesh.tp=4", "model.n_kv_heads=2"], dict(fsdp=2, tp=4), id="kv-heads-fewer-than-tp-replicate"),
    pytest.param(["mesh.tp=2", "data.seq_len=63"], dict(fsdp=4, tp=2), id="odd-seq-len-without-sequence-parallel"),
    pytest.param(["mesh.tp=2", "parallel.sequence_parallel=true", "data.seq_len=62"], dict(fsdp=4, tp=2),
                 id="even-seq-len-with-sequence-parallel"),
    pytest.param(["mesh.cp=2", "mesh.sp=2", "data.seq_len=72"], dict(fsdp=2, cp=2, sp=2),
                 id="cp-sp-seq-len-divisible-by-2cp-sp"),
    pytest.param(["model.d_model=130", "model.head_dim=32", "mesh.fsdp=2", "mesh.dp=4", "train.global_batch=8"],
                 dict(dp=4, fsdp=2), id="head-dim-explicit"),
    pytest.param(["train.remat=names:qkv,mlp_hidden"], dict(fsdp=8), id="remat-names"),
    pytest.param(["train.remat=save_dots_attn+names:moe_in,moe_hidden,moe_out"], dict(fsdp=8), id="remat-joined"),
    pytest.param(["mesh.pp=2", "train.grad_accum=2"], dict(pp=2, fsdp=4), id="pp2-1f1b"),
    pytest.param(["mesh.pp=2", "train.grad_accum=4", "model.n_layers=4", "pipeline.schedule=interleaved",
                  "pipeline.virtual_stages=2"], dict(pp=2, fsdp=4), id="pp2-interleaved-v2"),
    pytest.param(["model.preset=tiny_moe", "mesh.ep=8", "mesh.fsdp=1"], dict(ep=8), id="moe-ep8"),
    pytest.param(["model.preset=tiny_moe", "mesh.ep=2", "mesh.tp=2", "moe.every=2", "moe.n_shared=2"],
                 dict(fsdp=2, ep=2, tp=2), id="moe-ep2-fsdp-takes-the-rest"),
]


@pytest.mark.parametrize("overrides,expected", GOOD)
def test_valid_configs_resolve_the_mesh(overrides, expected):
    degrees = validate(build_config(None, overrides), N_DEVICES)
    assert degrees == {**dict(pp=1, dp=1, fsdp=1, ep=1, cp=1, sp=1, tp=1), **expected}


def test_validate_reports_every_problem_at_once():
    problems = problems_of(["mesh.fsdp=2", "mesh.tp=4", "model.d_ff=350", "train.global_batch=7",
                            "train.zero_stage=5", "train.schedule_steps=50", "train.remat=bogus"])
    fields = ["model.d_ff=350", "train.global_batch=7", "train.zero_stage=5", "train.schedule_steps=50",
              "train.remat='bogus'"]
    assert len(problems) == len(fields), problems
    for f in fields:
        assert sum(f in p for p in problems) == 1, (f, problems)


def test_loading_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        build_config({"trian": {}}, ["train.stpes=1", "train.lr=abc", "precision.compute=fp8", "model.preset=x"])
    assert len(e.value.problems) == 5, e.value.problems
    for f in ("'trian'", "train.stpes", "train.lr", "precision.compute", "model.preset"):
        assert sum(f in p for p in e.value.problems) == 1, (f, e.value.problems)


def test_build_mesh_refuses_wrong_device_count_with_config_error():
    import jax

    from meshtrain.mesh import build_mesh

    degrees = dict(pp=1, dp=2, fsdp=2, ep=1, cp=1, sp=1, tp=2)
    with pytest.raises(ConfigError, match=r"multiply to 8 but 4 devices"):
        build_mesh(degrees, jax.devices()[:4])
    assert build_mesh(degrees).devices.shape == (1, 2, 2, 1, 1, 1, 2)


# ------------------------------------------------------------------------------------- values and files


def test_precedence_defaults_preset_yaml_override():
    cfg = build_config({"model": {"preset": "llama1b", "n_layers": 2}, "train": {"steps": 9}},
                       ["model.d_model=256", "train.steps=11"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.train.steps) == (2, 256, 11)  # yaml, override, override
    assert (cfg.model.n_heads, cfg.model.vocab_size, cfg.model.d_ff) == (16, 32000, 5632)  # from the preset
    assert cfg.model.rope_theta == ModelConfig.rope_theta  # not in the preset: the default


@pytest.mark.parametrize("override,key,value", [
    ("train.lr=1e-3", ("train", "lr"), 1e-3),
    ("train.steps=1e3", ("train", "steps"), 1000),
    ("parallel.sequence_parallel=yes", ("parallel", "sequence_parallel"), True),
    ("model.tie_embeddings=0", ("model", "tie_embeddings"), False),
    ("run.dir=010", ("run", "dir"), "010"),  # YAML 1.1 would read an octal 8
    ("distributed.coordinator=10:30", ("distributed", "coordinator"), "10:30"),  # ... and base-60 630
    ("distributed.local_device_ids=0,1,2,3", ("distributed", "local_device_ids"), "0,1,2,3"),
    ("data.path=/data/tok ens.bin", ("data", "path"), "/data/tok ens.bin"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_override_values_take_the_field_type(override, key, value):
    got = getattr(getattr(build_config(None, [override]), key[0]), key[1])
    assert got == value and type(got) is type(value)


def test_yaml_file_round_trips(tmp_path):
    cfg = build_config(None, ["mesh.dp=2", "mesh.tp=2", "model.preset=small", "model.n_layers=3",
                              "train.lr=2.5e-4", "train.remat=names:qkv", "data.seq_len=96",
                              "precision.compute=float32", "run.dir=runs/x y", "checkpoint.async_save=false"])
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    back = load_config(path)
    assert back == cfg
    assert back != Config()  # the overrides did change something, so equality above means something
    assert yaml.safe_load(path.read_text())["model"]["n_layers"] == 3


OLD_SPELLINGS = [  # (old override, the parallel field it sets, its value)
    ("mesh.sequence_parallel=true", "sequence_parallel", True),
    ("mesh.fsdp_combine_mib=64", "fsdp_combine_mib", 64),
    ("model.tp_overlap=windowed_einsum", "tp_overlap", "windowed_einsum"),
    ("model.cp_impl=allgather", "cp_impl", "allgather"),
    ("model.cp_layout=contiguous", "cp_layout", "contiguous"),
]


@pytest.mark.parametrize("override,name,value", OLD_SPELLINGS, ids=lambda v: v if isinstance(v, str) else None)
def test_old_spelling_loads_into_the_parallel_section_with_one_note(override, name, value, capsys):
    old = override.split("=")[0]
    file_values = {old.split(".")[0]: {old.split(".")[1]: value}}  # the same key in the file, too: one note
    cfg = build_config(file_values, [override])
    assert getattr(cfg.parallel, name) == value and getattr(cfg.parallel, name) != getattr(Config().parallel, name)
    assert capsys.readouterr().err.splitlines() == [
        f"config: {old} is now parallel.{name} (the old spelling is accepted until the next release)"]
    assert build_config(None, [f"parallel.{name}={override.split('=')[1]}"]) == cfg  # the new spelling: same config
    assert capsys.readouterr().err == ""


def test_old_spelling_and_new_in_different_layers_override_as_usual():
    # A dumped config (inspect --diff, the planner) holds every new key; an old override still wins over it.
    base = build_config(None, ["model.cp_impl=allgather"]).to_dict()
    assert build_config(base, ["model.cp_impl=ring"]).parallel.cp_impl == "ring"
    assert build_config({"model": {"cp_impl": "allgather"}}, ["parallel.cp_impl=ring"]).parallel.cp_impl == "ring"


def test_yaml_file_with_old_keys_loads_and_prints_the_new_section(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text("mesh: {fsdp: 4, tp: 2, sequence_parallel: true, fsdp_combine_mib: 0}\n"
                    "model: {preset: tiny, tp_overlap: collective_matmul, cp_impl: allgather, cp_layout: contiguous}\n")
    cfg = load_config(path)
    assert dataclasses.astuple(cfg.parallel) == (True, 0, "collective_matmul", "allgather", "contiguous")
    assert validate(cfg, N_DEVICES) == dict(pp=1, dp=1, fsdp=4, ep=1, cp=1, sp=1, tp=2)
    assert len(capsys.readouterr().err.splitlines()) == 5  # one note per old key
    printed = yaml.safe_load(to_yaml(cfg))
    assert printed["parallel"]["tp_overlap"] == "collective_matmul" and "sequence_parallel" not in printed["mesh"]
    assert "cp_impl" not in printed["model"]


def test_yaml_file_with_overrides_and_errors(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("mesh: {dp: 2, tp: 2}\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["train.steps=8"])
    assert (cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.fsdp, cfg.train.steps) == (2, 2, -1, 8)
    path.write_text("train: {steps: [\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert len(e.value.problems) == 1 and "\n" not in e.value.problems[0] and "not valid YAML" in str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


# The device count a shipped config is written for, where that is not any count: 5 sequences a GPU over two GPUs.
WRITTEN_FOR = {"llama3_8b_2xh200.yaml": 2}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_load_and_validate(name):
    cfg = load_config(REPO / "configs" / name)
    n_devices = WRITTEN_FOR.get(name, N_DEVICES)
    degrees = validate(cfg, n_devices)
    assert math.prod(degrees.values()) == n_devices  # every axis, ep included (the MoE config's -1)


@pytest.mark.parametrize("vocab,tp,expected", [
    (256, 1, 256), (256, 2, 256), (256, 3, 258), (257, 2, 258), (257, 8, 264), (50257, 8, 50264), (32000, 8, 32000),
])
def test_padded_vocab_rounds_up_to_tp(vocab, tp, expected):
    assert padded_vocab(dataclasses.replace(ModelConfig(), vocab_size=vocab), tp) == expected


def test_presets_validate_on_their_own():
    for name in PRESETS:  # every preset must be a consistent shape before any mesh is chosen
        validate(build_config(None, [f"model.preset={name}", "mesh.fsdp=1", "mesh.dp=-1", "train.global_batch=8"]),
                 N_DEVICES)


# ---------------------------------------------------------------------------------------------- CLI


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "meshtrain.run", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("args,fields", [
    pytest.param(["train.stpes=3", "train.lr=abc", "precision.compute=fp8"],
                 ["train.stpes", "train.lr='abc'", "precision.compute='fp8'"], id="loading"),
    # After jax starts: the CPU default is dp=2 fsdp=2 tp=2, so tp=3 breaks the product, heads and ffn.
    pytest.param(["mesh.tp=3", "data.source=file", "data.path=/nonexistent.bin"],
                 ["mesh.tp=3 uses 12 devices", "model.n_heads=4", "model.d_ff=352", "data.path='/nonexistent.bin'"],
                 id="validate"),
])
def test_cli_config_error_exits_2_one_line_per_problem(args, fields):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith("config error: ") for ln in lines), lines
    assert len(lines) == len(fields), lines
    for f in fields:
        assert sum(f in ln for ln in lines) == 1, (f, lines)


def test_cli_bad_config_file_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {stpes: 3}\nmesh: {tp: [\n")
    r = run_cli("--config", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "not valid YAML" in r.stderr


def test_cli_help_lists_keys_with_defaults():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    assert re.search(r"train\.global_batch\s+int\s+default 16\b", r.stdout), r.stdout
    # run_cli runs on the CPU without --config: the CPU run's mesh applies, and help says so.
    assert re.search(r"mesh\.tp\s+int\s+default 2 \(this CPU-only machine's run without --config; 1 otherwise\)",
                     r.stdout)
    assert re.search(r"precision\.compute\s+float32\|bfloat16\|float16\s+default 'bfloat16'", r.stdout)
    assert re.search(r"parallel\.tp_overlap\s+none\|windowed_einsum\|collective_matmul\s+default 'none'", r.stdout)


def test_cli_print_config_reflects_overrides_and_round_trips(tmp_path):
    r = run_cli("--print-config", "train.steps=7", "model.preset=small")
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["train"]["steps"] == 7
    assert printed["model"]["n_heads"] == PRESETS["small"]["n_heads"]
    assert (printed["mesh"]["dp"], printed["mesh"]["fsdp"], printed["mesh"]["tp"]) == (2, 2, 2)  # CPU default
    path = tmp_path / "printed.yaml"
    path.write_text(r.stdout)
    again = run_cli("--config", str(path), "--print-config")
    assert again.returncode == 0 and again.stdout == r.stdout


def test_moe_under_pipeline_needs_whole_groups_per_chunk():
    """With moe.every > 1 a pipeline chunk runs whole groups of `every` blocks (the scan's unit)."""
    problems = problems_of(["model.preset=tiny_moe", "moe.every=2", "mesh.pp=2", "mesh.fsdp=4", "train.grad_accum=2"])
    assert any("moe.every=2: must divide the layers per pipeline chunk" in p and "= 1" in p for p in problems), problems
    assert not problems_of(["model.preset=tiny_moe", "mesh.pp=2", "mesh.fsdp=4", "train.grad_accum=2"])


def test_moe_presets_fill_the_moe_section():
    cfg = build_config(None, ["model.preset=olmoe_1b7b", "moe.top_k=4"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.vocab_size) == (16, 2048, 16, 50304)
    assert (cfg.moe.n_experts, cfg.moe.d_ff_expert, cfg.moe.top_k) == (64, 1024, 4)  # explicit key wins
    assert build_config(None, []).moe.n_experts == 0


def test_cli_mosaic_attention_kernel_where_it_cannot_run_is_a_config_error():
    """model.attention_kernel reaches the kernels; asking for Mosaic GPU on the CPU says why, in one line."""
    r = run_cli("model.attention=pallas", "model.attention_kernel=mosaic", "train.steps=1")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("config error: ")]
    assert len(lines) == 1 and "model.attention_kernel=mosaic: interpret mode" in lines[0], r.stderr
