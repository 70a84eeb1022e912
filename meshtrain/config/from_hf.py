"""A Hugging Face Llama `config.json` read as ModelConfig field values (`checkpoint.init_from=hf:DIR`).

Reads both spellings of RoPE: transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...});
published Llama checkpoints carry `rope_theta` beside `rope_scaling` ({rope_type or type, factor, ...},
or null). Pure Python (no jax): build_config resolves the model's shape from it before any device work,
which is why it lives here, below meshtrain/hf (whose config.py writes config.json back for the export).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtrain.config.validation import ConfigError

HF_PREFIX = "hf:"
# ModelConfig fields a Hugging Face config decides; an explicit value that differs is refused for the
# shape fields (the weights would not fit) and wins for the numerics (e.g. a longer context's RoPE).
SHAPE_FROM_HF = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "tie_embeddings")
NUMERICS_FROM_HF = ("norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor", "rope_original_max_len")


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


def model_values(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig field values of a Llama config.json; ConfigError (all problems) for what meshtrain cannot run."""
    problems = []
    if hf.get("model_type", "llama") != "llama":
        problems.append(f"{where}: model_type {hf.get('model_type')!r} is not supported; meshtrain reads Llama models")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"{where}: hidden_act {hf['hidden_act']!r}: meshtrain's MLP is SwiGLU (silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            problems.append(f"{where}: {bias}=true: meshtrain's Llama has no biases")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in hf]
    if missing:
        problems.append(f"{where}: config.json lacks {', '.join(missing)}")
    counts = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
              "num_key_value_heads", "head_dim")
    problems += [f"{where}: {k}={hf[k]!r} in config.json must be a positive whole number" for k in counts
                 if hf.get(k) is not None and not (isinstance(hf[k], int) and not isinstance(hf[k], bool) and hf[k] > 0)]
    if problems:
        raise ConfigError(problems)
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or d // h)
    values: dict[str, Any] = dict(
        n_layers=int(hf["num_hidden_layers"]), d_model=d, n_heads=h,
        n_kv_heads=int(hf.get("num_key_value_heads") or h), head_dim=0 if head_dim * h == d else head_dim,
        d_ff=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    values.update(rope_values(hf, where))
    return values


def rope_values(hf: dict[str, Any], where: str) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
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


def apply_hf_values(flat_model: dict[str, Any], explicit: dict[str, Any], directory: Path) -> list[str]:
    """Merge a Hugging Face config into the model section: HF values over the preset, explicit shape
    fields must agree, explicit numerics win. Returns the problems (one line each)."""
    try:
        values = model_values(read_config_json(directory), f"checkpoint.init_from=hf:{directory}")
    except ConfigError as e:
        return e.problems
    problems = []
    for k, v in values.items():
        if k in explicit and k in SHAPE_FROM_HF and explicit[k] != v:
            problems.append(f"model.{k}={explicit[k]!r}: checkpoint.init_from=hf:{directory} has {k}={v!r}; drop "
                            f"model.{k} (the model's shape comes from its config.json)")
        if k not in explicit or k in SHAPE_FROM_HF:
            flat_model[k] = v
    return problems
