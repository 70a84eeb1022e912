"""A Hugging Face Llama `config.json` as ModelConfig field values, and back.

The reading (config.json -> ModelConfig fields, both RoPE spellings) lives in meshtrain/config/from_hf.py,
because build_config applies it for `checkpoint.init_from=hf:DIR` and config sits below hf; it is
re-exported here so that HF interop has one entry point. The writing is here: `config_json` writes both
spellings, so that transformers 4 and 5 read the export alike. Pure Python (no jax).
"""
from __future__ import annotations

from typing import Any

from meshtrain.config import ModelConfig
from meshtrain.config.from_hf import (
    HF_PREFIX, NUMERICS_FROM_HF, SHAPE_FROM_HF, apply_hf_values, hf_dir, model_values, read_config_json, rope_values,
)

__all__ = ["HF_PREFIX", "NUMERICS_FROM_HF", "SHAPE_FROM_HF", "apply_hf_values", "config_json", "hf_dir",
           "model_values", "read_config_json", "rope_values"]


def config_json(m: ModelConfig, *, dtype: str = "float32", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A LlamaForCausalLM config.json for ModelConfig `m`, in transformers 5's spelling and 4's."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    legacy_scaling = None
    if m.rope_scaling == "llama3":
        legacy_scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                          "high_freq_factor": m.rope_high_freq_factor,
                          "original_max_position_embeddings": m.rope_original_max_len}
        rope.update(legacy_scaling)
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.kv_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        # Not part of the model's function (RoPE needs no table); a source model's own value wins (extra).
        "max_position_embeddings": int(m.rope_original_max_len * m.rope_factor) if legacy_scaling else 4096,
        "rope_parameters": rope, "rope_theta": m.rope_theta, "rope_scaling": legacy_scaling,
        "dtype": dtype, "torch_dtype": dtype,
    }
    out.update(extra or {})
    return out
