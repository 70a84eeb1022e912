"""Hugging Face OLMoE and Mixtral in and out, checked against transformers' own fp32 logits and tensors.

The fixtures (tests/fixtures/hf/olmoe, mixtral; scripts/make_hf_fixtures.py) are tiny random models with 4
experts, top-2, 2 kv heads, vocab 61 (padded to 62 on tp=2): OLMoE normalizes the whole q and k
projections before RoPE and weights the top-2 by their softmax probabilities as they are; Mixtral
renormalizes them (and has head_dim 16 != hidden/heads). Every token's 2nd and 3rd router probabilities
differ by >= 1e-3 in them, so summation order cannot flip an expert choice. Tolerance 1e-4 on logits of
magnitude ~3: both sides fp32 (meshtrain with full-precision matmuls), only summation order differs.
"""
import dataclasses
import functools
import json
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import FIXTURES, hf_tensors_of, make_setup
from meshtrain.checkpoint import Checkpointer
from meshtrain.config import ConfigError, MoEConfig, build_config
from meshtrain.export import export
from meshtrain.hf.config import architecture, config_json, model_values, moe_values, read_config_json
from meshtrain.hf.weights import hf_tensors, load_params, save_tensors
from meshtrain.inference import forward_logits
from meshtrain.model.moe import route
from meshtrain.step.state import Setup, abstract_params, state_from_params

NAMES = ["olmoe", "mixtral"]
F32 = ["precision.compute=float32", "train.global_batch=8", "data.seq_len=12"]
MESHES = {"one_device": (1, ["mesh.fsdp=1"]), "ep2_tp2": (4, ["mesh.fsdp=1", "mesh.ep=2", "mesh.tp=2"])}


@functools.cache  # each fixture is set up and loaded once per mesh (the export and generation tests reuse it)
def load_on(name: str, mesh: str, *extra: str) -> tuple[Setup, dict]:
    n_devices, overrides = MESHES[mesh]
    cfg = build_config({}, [f"checkpoint.init_from=hf:{FIXTURES / name}", *F32, *overrides, *extra])
    setup = make_setup(cfg, n_devices)
    params = load_params(FIXTURES / name, cfg.model, abstract_params(setup), setup.state_shardings.params, moe=cfg.moe)
    return setup, params


def logits_of(setup: Setup, params: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    ref = np.load(FIXTURES / name / "reference.npz")
    return np.asarray(forward_logits(setup, params, ref["tokens"])), ref["logits"]


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, mesh):
    setup, params = load_on(name, mesh)
    assert (setup.cfg.moe.n_experts, setup.cfg.moe.top_k, setup.cfg.moe.every) == (4, 2, 1)
    assert setup.cfg.model.qk_norm == ("all_heads" if name == "olmoe" else "none")
    if mesh == "ep2_tp2":  # each device holds its 2 experts' halves, read straight into place
        w_gate = params["layers"]["moe"]["w_gate"]  # [L, X, D, F]
        assert w_gate.sharding.shard_shape(w_gate.shape) == (2, 2, 32, 16)
        assert setup.model.vocab_padded == 62
    got, want = logits_of(setup, params, name)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_mixtral_fixture_needs_renormalized_top_k_weights():
    """With the top-2 probabilities as they are (OLMoE's weighting) the logits move far beyond the tolerance:
    the comparison above fails for a Mixtral that does not renormalize."""
    setup, params = load_on("mixtral", "one_device", "moe.top_k_weights=scores")
    got, want = logits_of(setup, params, "mixtral")
    assert np.abs(got - want).max() > 1e-2


def test_export_gives_back_the_fixture_tensors(tmp_path):
    """Load OLMoE on ep=2 x tp=2, save as a meshtrain checkpoint, export: every tensor (one per expert, the Hub's
    names) equals the fixture's bit for bit, and config.json reads back to the same model and moe fields."""
    setup, params = load_on("olmoe", "ep2_tp2")
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1, async_save=False)
    ckpt.save(3, state_from_params(setup, params), setup.cfg.to_dict())
    ckpt.wait()
    ckpt.close()
    out = tmp_path / "hf"
    step, files = export(str(tmp_path / "ckpt"), out)
    assert step == 3 and "model.safetensors" in files and "tokenizer.json" in files
    assert_same_model(out, "olmoe")


def test_mixtral_tensors_and_config_round_trip(tmp_path):
    """What export writes for a Mixtral loaded on ep=2 x tp=2 (hf_tensors, config_json: the export's own
    steps, without the checkpoint in between) is the fixture, bit for bit."""
    setup, params = load_on("mixtral", "ep2_tp2")
    m, moe = setup.cfg.model, setup.cfg.moe
    save_tensors(hf_tensors(jax.device_get(params), m, moe=moe), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_json(m, moe)))
    assert_same_model(tmp_path, "mixtral")


def assert_same_model(out: Path, name: str) -> None:
    exported, expected = load_file(str(out / "model.safetensors")), hf_tensors_of(FIXTURES / name)
    assert sorted(exported) == sorted(expected)
    chex.assert_trees_all_equal(exported, expected)
    written, source = read_config_json(out), read_config_json(FIXTURES / name)
    assert written["architectures"] == source["architectures"] and written["model_type"] == name
    for values in (model_values, moe_values):
        assert values(written, "export") == values(source, "fixture")


def test_greedy_generation_on_ep2_tp2_picks_transformers_next_token():
    """One prompt on a mesh whose batch splits over ep: its rows are padded for ep too, and the first greedy
    token is the argmax of transformers' logits at the prompt's last position."""
    from meshtrain.generation import generate
    setup, params = load_on("mixtral", "ep2_tp2")
    ref = np.load(FIXTURES / "mixtral" / "reference.npz")
    top2 = np.sort(ref["logits"][0, -1])[-2:]
    assert top2[1] - top2[0] > 1e-3  # a clear winner
    assert generate(setup, params, [ref["tokens"][0].tolist()], max_new_tokens=1) == [
        [int(np.argmax(ref["logits"][0, -1]))]]


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_top_k_weights_as_scores_or_normalized(router):
    """scores: the router's softmax probabilities or sigmoid scores of the chosen experts as they are;
    normalized: those divided by their sum; auto: softmax's scores and sigmoid's normalized weights, bit for bit."""
    rng = np.random.default_rng(0)  # numpy draws: jax.random's first call compiles for seconds on a busy CPU
    x_btd, w_dx = rng.normal(size=(2, 5, 8)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)

    def all_kinds(x_btd, w_dx):
        out = {kind: route(x_btd, w_dx, MoEConfig(n_experts=4, top_k=2, router=router, top_k_weights=kind))
               for kind in ("auto", "scores", "normalized")}
        logits_btx = out["scores"][0]
        return out, jax.nn.softmax(logits_btx) if router == "softmax" else jax.nn.sigmoid(logits_btx)

    weights, values_btx = jax.jit(all_kinds)(x_btd, w_dx)
    experts_btk = weights["scores"][2]
    chosen_btk = np.take_along_axis(np.asarray(values_btx), np.asarray(experts_btk), axis=-1)
    np.testing.assert_array_equal(weights["scores"][3], chosen_btk)
    np.testing.assert_allclose(weights["normalized"][3], chosen_btk / chosen_btk.sum(-1, keepdims=True), rtol=1e-6)
    auto_is = "scores" if router == "softmax" else "normalized"
    np.testing.assert_array_equal(weights["auto"][3], weights[auto_is][3])
    assert np.abs(np.asarray(weights["scores"][3]) - np.asarray(weights["normalized"][3])).max() > 1e-2


def test_unsupported_architectures_and_features_are_config_errors(tmp_path):
    olmoe, mixtral = read_config_json(FIXTURES / "olmoe"), read_config_json(FIXTURES / "mixtral")
    with pytest.raises(ConfigError, match=r"model_type 'qwen2_moe' is not supported; meshtrain reads llama "
                                          r"\(LlamaForCausalLM\), olmoe \(OlmoeForCausalLM\), mixtral"):
        model_values(dict(mixtral, model_type="qwen2_moe"), "x")
    with pytest.raises(ConfigError, match="clip_qkv=8.0: meshtrain does not clip"):
        model_values(dict(olmoe, clip_qkv=8.0), "x")
    with pytest.raises(ConfigError, match="config.json lacks num_local_experts"):
        moe_values({k: v for k, v in mixtral.items() if k != "num_local_experts"}, "x")

    # A sliding window: refused where it is shorter than the sequence, and changes nothing otherwise.
    d = tmp_path / "windowed"
    d.mkdir()
    for f in (FIXTURES / "mixtral").iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(dict(mixtral, sliding_window=8)))
    with pytest.raises(ConfigError) as e:
        build_config({}, [f"checkpoint.init_from=hf:{d}", "data.seq_len=12"])
    assert e.value.problems == [(f"checkpoint.init_from=hf:{d}: config.json sets sliding_window=8, shorter than "
                                 f"data.seq_len=12; meshtrain's attention is not windowed, so set data.seq_len <= 8 "
                                 f"(where the window changes nothing)")]
    assert build_config({}, [f"checkpoint.init_from=hf:{d}", "data.seq_len=8"]).moe.n_experts == 4

    # The experts' shape comes from config.json; the routing numerics may be overridden.
    with pytest.raises(ConfigError, match=r"moe.n_experts=8: checkpoint.init_from=hf:\S+ has n_experts=4; drop "
                                          r"moe.n_experts"):
        build_config({}, [f"checkpoint.init_from=hf:{FIXTURES / 'olmoe'}", "moe.n_experts=8"])
    assert build_config({}, [f"checkpoint.init_from=hf:{FIXTURES / 'olmoe'}", "moe.top_k=1"]).moe.top_k == 1

    # A model no Hugging Face class computes cannot be exported as one: every field that stands in the way.
    tiny = build_config({}, ["model.preset=tiny_moe"])
    with pytest.raises(ConfigError) as e:
        architecture(tiny.model, dataclasses.replace(tiny.moe, n_shared=1, every=2, router="sigmoid"))
    assert [p.split(":")[0] for p in e.value.problems] == ["moe.n_shared=1", "moe.every=2", "moe.router='sigmoid'"]
    with pytest.raises(ConfigError, match="moe.top_k_weights='auto': without model.qk_norm"):
        architecture(tiny.model, tiny.moe)  # meshtrain's own tiny_moe: an OLMoE without its q/k norm
    with pytest.raises(ConfigError, match="model.qk_norm=all_heads: a dense model"):
        architecture(dataclasses.replace(tiny.model, qk_norm="all_heads"), MoEConfig())
