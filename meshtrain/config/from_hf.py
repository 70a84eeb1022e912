"""A Hugging Face `config.json` read as model and moe field values (`checkpoint.init_from=hf:DIR`).

Three architectures, by `model_type`: llama (LlamaForCausalLM), olmoe (OlmoeForCausalLM: q/k norm over
the whole projections, softmax router, top-k probabilities as they are unless norm_topk_prob) and mixtral
(MixtralForCausalLM: softmax over the top-k logits, i.e. renormalized top-k probabilities). Reads both
spellings of RoPE: transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...}); published
checkpoints carry `rope_theta` beside `rope_scaling` ({rope_type or type, factor, ...}, or null). Pure
Python (no jax): build_config resolves the model's shape from it before any device work, which is why it
lives here, below meshtrain/hf (whose config.py writes config.json back for the export).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtrain.config.schema import DataConfig
from meshtrain.config.validation import ConfigError

HF_PREFIX = "hf:"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# Fields a Hugging Face config decides; an explicit value that differs is refused for the shape fields
# (the weights would not fit) and wins for the numerics (e.g. a longer context's RoPE, another top-k).
SHAPE_FROM_HF = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "tie_embeddings",
                 "qk_norm")
NUMERICS_FROM_HF = ("norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor", "rope_original_max_len")
MOE_SHAPE_FROM_HF = ("n_experts", "d_ff_expert", "n_shared", "every")
MOE_NUMERICS_FROM_HF = ("top_k", "router", "top_k_weights")
# transformers' defaults where config.json leaves a value out (configuration_<model_type>.py).
NORM_EPS = {"llama": 1e-6, "olmoe": 1e-5, "mixtral": 1e-5}
ROPE_THETA = {"llama": 10000.0, "olmoe": 10000.0, "mixtral": 1e6}


def hf_dir(init_from: str) -> Path | None:
    """The directory of `hf:DIR`, or None for any other value."""
    return Path(init_from[len(HF_PREFIX):]).expanduser() if init_from.startswith(HF_PREFIX) else None


def read_config_json(directory: Path, field: str = "checkpoint.init_from") -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{field}=hf:{directory}: no config.json there; point it at a Hugging Face model "
                          f"directory (config.json and *.safetensors)")
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{field}=hf:{directory}: config.json is not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{field}=hf:{directory}: config.json holds a {type(values).__name__}, not an object")
    return values


def model_type(hf: dict[str, Any], where: str) -> str:
    kind = hf.get("model_type", "llama")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type {kind!r} is not supported; meshtrain reads "
                          f"{', '.join(f'{k} ({v})' for k, v in ARCHITECTURES.items())}")
    return kind


def _positive(hf: dict[str, Any], keys: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}: {k}={hf[k]!r} in config.json must be a positive whole number" for k in keys
            if hf.get(k) is not None and not (isinstance(hf[k], int) and not isinstance(hf[k], bool) and hf[k] > 0)]


def model_values(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig field values of a config.json; ConfigError (all problems) for what meshtrain cannot run."""
    kind = model_type(hf, where)
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"{where}: hidden_act {hf['hidden_act']!r}: meshtrain's MLP is SwiGLU (silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            problems.append(f"{where}: {bias}=true: meshtrain's {kind} has no biases")
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        problems.append(f"{where}: clip_qkv={hf['clip_qkv']!r}: meshtrain does not clip q, k and v; only OLMoE "
                        f"models with clip_qkv null are supported")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in hf]
    if missing:
        problems.append(f"{where}: config.json lacks {', '.join(missing)}")
    problems += _positive(hf, ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size", "num_key_value_heads", "head_dim"), where)
    if problems:
        raise ConfigError(problems)
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or d // h)
    if kind == "olmoe" and head_dim * h != d:  # transformers sizes OLMoE's q norm by hidden_size
        raise ConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={h} != hidden_size={d}: an OLMoE "
                          f"model's q norm spans hidden_size, so its heads must fill it")
    values: dict[str, Any] = dict(
        n_layers=int(hf["num_hidden_layers"]), d_model=d, n_heads=h,
        n_kv_heads=int(hf.get("num_key_value_heads") or h), head_dim=0 if head_dim * h == d else head_dim,
        d_ff=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", NORM_EPS[kind])), qk_norm="all_heads" if kind == "olmoe" else "none")
    values.update(rope_values(hf, where, ROPE_THETA[kind]))
    return values


def moe_values(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """MoEConfig field values of a config.json: every layer's FFN routed (olmoe, mixtral), or none (llama).
    Training-only settings (router_aux_loss_coef, router_jitter_noise, output_router_logits) stay the run's."""
    kind = model_type(hf, where)
    if kind == "llama":
        return dict(n_experts=0)
    experts_key = "num_experts" if kind == "olmoe" else "num_local_experts"
    n_experts = hf.get(experts_key, hf.get("num_experts", hf.get("num_local_experts")))
    problems = [f"{where}: config.json lacks {k}" for k, v in ((experts_key, n_experts),
                                                               ("num_experts_per_tok", hf.get("num_experts_per_tok")))
                if v is None]
    problems += _positive(hf, (experts_key, "num_experts_per_tok"), where)
    if problems:
        raise ConfigError(problems)
    normalized = kind == "mixtral" or bool(hf.get("norm_topk_prob", False))
    return dict(n_experts=int(n_experts), top_k=int(hf["num_experts_per_tok"]),
                d_ff_expert=int(hf["intermediate_size"]), n_shared=0, every=1, router="softmax",
                top_k_weights="normalized" if normalized else "scores")


def rope_values(hf: dict[str, Any], where: str, default_theta: float = 10000.0) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=theta, rope_scaling="none")
    if kind != "llama3":
        raise ConfigError(f"{where}: RoPE type {kind!r} is not supported; meshtrain implements 'default' and "
                          f"'llama3' (Llama 3.1)")
    try:
        return dict(rope_theta=theta, rope_scaling="llama3", rope_factor=float(rope["factor"]),
                    rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_original_max_len=int(rope["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{where}: llama3 RoPE scaling lacks {e.args[0]!r}") from None


def window_problems(hf: dict[str, Any], seq_len: int, where: str) -> list[str]:
    """meshtrain's attention sees the whole sequence: a sliding window shorter than it would change the model.
    (transformers' Llama ignores the key; OLMoE and Mixtral attend within it.)"""
    window = hf.get("sliding_window")
    if window is None or model_type(hf, where) == "llama":
        return []
    if not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        return [f"{where}: sliding_window={window!r} in config.json must be a positive whole number or null"]
    if window >= seq_len:
        return []
    return [f"{where}: config.json sets sliding_window={window!r}, shorter than data.seq_len={seq_len}; "
            f"meshtrain's attention is not windowed, so set data.seq_len <= {window} (where the window "
            f"changes nothing)"]


def apply_hf_values(sections: dict[str, dict[str, Any]], explicit: dict[str, Any], directory: Path) -> list[str]:
    """Merge a Hugging Face config into the model and moe sections (`sections[name][field]`): HF values over
    the preset, explicit shape fields (`explicit["model.d_model"]`, ...) must agree, explicit numerics win.
    Returns the problems (one line each)."""
    where = f"checkpoint.init_from=hf:{directory}"
    try:
        hf = read_config_json(directory)
        values = {"model": model_values(hf, where), "moe": moe_values(hf, where)}
    except ConfigError as e:
        return e.problems
    problems = window_problems(hf, int(sections["data"].get("seq_len", DataConfig.seq_len)), where)
    shape = {f"model.{k}" for k in SHAPE_FROM_HF} | {f"moe.{k}" for k in MOE_SHAPE_FROM_HF}
    for section, fields in values.items():
        for k, v in fields.items():
            key = f"{section}.{k}"
            if key in explicit and key in shape and explicit[key] != v:
                problems.append(f"{key}={explicit[key]!r}: {where} has {k}={v!r}; drop {key} (the model's shape "
                                f"comes from its config.json)")
            if key not in explicit or key in shape:
                sections[section][k] = v
    return problems
