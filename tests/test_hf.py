"""Hugging Face Llama in and out, checked against transformers' own fp32 logits and tensors.

The fixtures (tests/fixtures/hf, made by scripts/make_hf_fixtures.py with torch and transformers) are
tiny random LlamaForCausalLM models: GQA with 2 kv heads (fewer than tp=4: replicated), tied
embeddings, Llama-3.1 RoPE scaling, head_dim != hidden/heads, vocab 61 (padded on tp), and one stored
as several safetensors files with an index. Tolerance 1e-4 on logits of magnitude ~3: both sides are
fp32 (meshtrain with full-precision matmuls), so only summation order differs (~1e-6 seen).
"""
import json
import os
import shutil
from pathlib import Path

import chex
import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import FIXTURES, hf_tensors_of, make_setup
from meshtrain.checkpoint import Checkpointer
from meshtrain.config import PRESETS, ConfigError, build_config
from meshtrain.export import export
from meshtrain.hf.config import model_values, read_config_json
from meshtrain.inference import forward_logits, load
from meshtrain.step.state import state_from_params

F32 = ["precision.compute=float32", "train.global_batch=8"]
MESHES = {"fsdp2_tp4": ["mesh.fsdp=2", "mesh.tp=4"], "one_device": ["mesh.fsdp=1"]}


def reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def load_on(name: str, mesh: str, *extra: str):
    if mesh == "one_device":
        import meshtrain.inference as inf
        cfg = build_config({}, [f"checkpoint.init_from=hf:{FIXTURES / name}", *F32, *MESHES[mesh], *extra])
        setup = make_setup(cfg, 1)
        from meshtrain.hf.weights import load_params
        from meshtrain.step.state import abstract_params
        params = load_params(FIXTURES / name, cfg.model, abstract_params(setup), setup.state_shardings.params)
        return inf.Loaded(setup.cfg, setup, params, None, FIXTURES / name)
    return load(f"hf:{FIXTURES / name}", [*F32, *MESHES[mesh], *extra])


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", ["llama31_tied", "llama_sharded"])
def test_logits_match_transformers(name, mesh):
    ref = reference(name)
    loaded = load_on(name, mesh)
    assert loaded.setup.model.vocab_padded == (64 if mesh == "fsdp2_tp4" else 61)
    logits = np.asarray(forward_logits(loaded.setup, loaded.params, ref["tokens"]))
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


def test_the_fixture_exercises_llama31_rope_scaling():
    """Without the scaling the logits move far beyond the tolerance: the comparison above can fail."""
    ref = reference("llama31_tied")
    loaded = load_on("llama31_tied", "fsdp2_tp4", "model.rope_scaling=none")
    logits = np.asarray(forward_logits(loaded.setup, loaded.params, ref["tokens"]))
    assert np.abs(logits - ref["logits"]).max() > 1e-2


def legacy_spelling(hf: dict) -> dict:
    """config.json as published Llama checkpoints have it: rope_theta beside rope_scaling (or null)."""
    out = {k: v for k, v in hf.items() if k != "rope_parameters"}
    rope = dict(hf["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    return out


@pytest.mark.parametrize("name", ["llama31_tied", "llama_sharded"])
def test_config_json_in_both_spellings(name):
    hf = read_config_json(FIXTURES / name)
    assert "rope_parameters" in hf  # what transformers 5 wrote
    values = model_values(hf, name)
    assert model_values(legacy_spelling(hf), name) == values
    if name == "llama31_tied":
        assert values["rope_scaling"] == "llama3" and values["rope_original_max_len"] == 64
        assert values["head_dim"] == 16 and values["tie_embeddings"] and values["n_kv_heads"] == 2


# The published config.json of Llama-3.1-8B (shape and RoPE fields, as released).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}


def test_presets_carry_the_published_llama_numerics():
    from_hf = model_values(LLAMA31_8B, "Llama-3.1-8B")
    preset = build_config({}, ["model.preset=llama3_1_8b"]).model
    assert {k: getattr(preset, k) for k in from_hf} == from_hf
    llama3 = build_config({}, ["model.preset=llama3_8b"]).model
    assert (llama3.norm_eps, llama3.rope_theta, llama3.rope_scaling) == (1e-5, 500000.0, "none")
    assert PRESETS["llama2_13b"]["norm_eps"] == 1e-5


def test_init_from_shape_comes_from_config_json(tmp_path):
    d = FIXTURES / "llama31_tied"
    cfg = build_config({}, [f"checkpoint.init_from=hf:{d}", "model.rope_theta=20000"])
    assert (cfg.model.d_model, cfg.model.head_dim, cfg.model.vocab_size) == (32, 16, 61)
    assert cfg.model.rope_theta == 20000  # numerics may be overridden (e.g. a longer context)
    with pytest.raises(ConfigError) as e:
        build_config({}, [f"checkpoint.init_from=hf:{d}", "model.d_model=64", "model.n_layers=2"])
    assert e.value.problems == [f"model.d_model=64: checkpoint.init_from=hf:{d} has d_model=32; drop model.d_model "
                                f"(the model's shape comes from its config.json)"]
    with pytest.raises(ConfigError, match="no config.json"):
        build_config({}, [f"checkpoint.init_from=hf:{tmp_path}"])


def test_unsupported_or_damaged_models_are_config_errors(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_sharded", d)
    hf = read_config_json(d)
    with pytest.raises(ConfigError, match="RoPE type 'yarn' is not supported"):
        model_values(dict(hf, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "x")
    with pytest.raises(ConfigError, match="attention_bias=true"):
        model_values(dict(hf, attention_bias=True), "x")
    # A shard lost: every missing tensor is named, before any device work.
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / "model-00003-of-00003.safetensors").unlink()
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not v.startswith("model-00003")}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError) as e:
        load(f"hf:{d}", F32 + ["mesh.fsdp=8"])
    assert any("tensor lm_head.weight is missing" in p for p in e.value.problems)


@pytest.mark.parametrize("name", ["llama31_tied", "llama_sharded"])
def test_export_gives_back_the_fixture_tensors(name, tmp_path):
    """Load on fsdp=2 x tp=4 (vocab padded to 64), save as a meshtrain checkpoint, export: every tensor
    equals the fixture's bit for bit, the padding is gone, and config.json reads back the same."""
    loaded = load_on(name, "fsdp2_tp4")
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1, async_save=False)
    cfg_dict = loaded.cfg.to_dict()
    ckpt.save(7, state_from_params(loaded.setup, loaded.params), cfg_dict)
    ckpt.wait()
    ckpt.close()
    out = tmp_path / "hf"
    step, files = export(str(tmp_path / "ckpt"), out, max_shard_bytes=40_000)
    assert step == 7 and "model.safetensors.index.json" in files  # several files past 40 kB
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    expected = hf_tensors_of(FIXTURES / name)
    assert sorted(exported) == sorted(expected)
    chex.assert_trees_all_equal(exported, expected)
    assert model_values(read_config_json(out), "export") == model_values(read_config_json(FIXTURES / name), "src")
    assert (out / "tokenizer.json").is_file()  # carried over from the model the run started from
    bf16 = export(str(tmp_path / "ckpt"), tmp_path / "bf16", dtype="bfloat16")[1]
    assert str(load_file(str(tmp_path / "bf16" / bf16[0]))["model.norm.weight"].dtype) == "bfloat16"


def read_all(d: Path) -> None:
    """What load_params reads, without the devices: the config, the index, every tensor."""
    from meshtrain.hf.weights import SafetensorsDir, check_tensors
    cfg = build_config({}, [f"checkpoint.init_from=hf:{d}"])
    src = SafetensorsDir(d)
    try:
        check_tensors(src, cfg.model)
        for name in sorted(src.names()):
            src.get(name)
    finally:
        src.close()


def test_hf_import_input_that_cannot_hurt(tmp_path):
    """Paths confined to the model directory, regular files only; every malformed input one config error."""
    from safetensors.numpy import load_file, save_file
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "llama_sharded", base)
    read_all(base)  # the intact fixture reads
    index_name = "model.safetensors.index.json"
    index = json.loads((base / index_name).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    tensor = next(k for k, v in index["weight_map"].items() if v == first and k.endswith("q_proj.weight"))

    def case(name, change):
        d = tmp_path / name
        shutil.copytree(base, d)
        change(d)
        with pytest.raises(ConfigError) as e:
            read_all(d)
        assert all("\n" not in p for p in e.value.problems)
        return " ".join(e.value.problems)

    def remap(target):
        def change(d):
            idx = json.loads((d / index_name).read_text())
            idx["weight_map"][tensor] = target(d)
            (d / index_name).write_text(json.dumps(idx))
        return change

    (tmp_path / "outside.safetensors").write_bytes((base / first).read_bytes())
    assert "outside the model directory" in case("dotdot", remap(lambda d: "../outside.safetensors"))
    assert "outside the model directory" in case("absolute", remap(lambda d: str(tmp_path / "outside.safetensors")))
    assert "not a regular file" in case("pipe", lambda d: (os.mkfifo(d / "pipe.safetensors"),
                                                         remap(lambda _: "pipe.safetensors")(d)))
    assert "is not a safetensors index" in case("bad_index", lambda d: (d / index_name).write_text("{\"weight_"))
    assert "not an object" in case("config_list", lambda d: (d / "config.json").write_text("[1, 2]"))

    def layers(value):
        def change(d):
            hf = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(dict(hf, num_hidden_layers=value)))
        return change
    assert "num_hidden_layers=2.7 in config.json must be a positive whole number" in case("layers", layers(2.7))

    def cut(d):
        (d / first).write_bytes((d / first).read_bytes()[:-1000])
    assert "cannot be read" in case("truncated", cut) or "not a readable safetensors" in case("truncated2", cut)
    assert "not a readable safetensors file" in case("bad_header", lambda d: (d / first).write_bytes(b"\xff" * 64))

    def rewrite(fn):
        def change(d):
            tensors = load_file(str(d / first))
            tensors[tensor] = fn(tensors[tensor])
            save_file(tensors, str(d / first))
        return change
    assert f"tensor {tensor} is int32" in case("int32", rewrite(lambda x: x.astype(np.int32)))
    assert f"tensor {tensor} is bool" in case("bool", rewrite(lambda x: x > 0))
    nan = rewrite(lambda x: np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x).astype(x.dtype))
    assert f"tensor {tensor} holds NaN" in case("nan", nan)
