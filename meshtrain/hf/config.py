"""A Hugging Face `config.json` as model and moe field values, and back.

The reading (config.json -> field values, both RoPE spellings) lives in meshtrain/config/from_hf.py,
because build_config applies it for `checkpoint.init_from=hf:DIR` and config sits below hf; it is
re-exported here so that HF interop has one entry point. The writing is here: `architecture` names the
transformers class that computes what a meshtrain model computes, and `config_json` writes its config in
transformers 5's RoPE spelling and 4's, so that both read the export alike. Pure Python (no jax).
"""
from __future__ import annotations

from typing import Any

from meshtrain.config import ConfigError, ModelConfig, MoEConfig
from meshtrain.config.from_hf import (
    ARCHITECTURES, HF_PREFIX, NUMERICS_FROM_HF, SHAPE_FROM_HF, apply_hf_values, hf_dir, model_values, moe_values,
    read_config_json, rope_values,
)

__all__ = ["ARCHITECTURES", "HF_PREFIX", "NUMERICS_FROM_HF", "SHAPE_FROM_HF", "apply_hf_values", "architecture",
           "config_json", "hf_dir", "model_values", "moe_values", "read_config_json", "rope_values"]


def architecture(m: ModelConfig, moe: MoEConfig | None = None, *, exact: bool = True) -> str:
    """The model_type (llama, olmoe, mixtral) whose transformers model computes what this config computes:
    dense is Llama, q/k norm marks OLMoE, the rest is Mixtral. exact (export): ConfigError naming the fields
    that no such model has; not exact (loading, where a run may override the routing): the tensor names."""
    kind = "llama" if moe is None or not moe.enabled else "olmoe" if m.qk_norm == "all_heads" else "mixtral"
    if not exact:
        return kind
    if kind == "llama":
        if m.qk_norm != "none":
            raise ConfigError(f"model.qk_norm={m.qk_norm}: a dense model with q/k norm has no Hugging Face "
                              f"architecture here (Llama has none); export supports llama, olmoe and mixtral")
        return kind
    problems = [f"moe.{k}={getattr(moe, k)!r}: {why}" for k, bad, why in (
        ("n_shared", moe.n_shared != 0, "OLMoE and Mixtral have no shared experts; it must be 0"),
        ("every", moe.every != 1, "OLMoE and Mixtral route every layer's FFN; it must be 1"),
        ("router", moe.router != "softmax", "OLMoE and Mixtral route by softmax"),
        ("top_k_weights", kind == "mixtral" and not moe.normalize_top_k,
         "without model.qk_norm (OLMoE) the model is a Mixtral, whose top-k weights are normalized"),
    ) if bad]
    if kind == "olmoe" and m.head_dim not in (0, m.d_model // m.n_heads):
        problems.append(f"model.head_dim={m.head_dim}: OLMoE's q norm spans hidden_size, so n_heads x head_dim "
                        f"must equal d_model={m.d_model}")
    if problems:
        raise ConfigError(problems)
    return kind


def config_json(m: ModelConfig, moe: MoEConfig | None = None, *, dtype: str = "float32",
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of `architecture(m, moe)` for these fields, in transformers 5's spelling and 4's."""
    kind = architecture(m, moe)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    legacy_scaling = None
    if m.rope_scaling == "llama3":
        legacy_scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                          "high_freq_factor": m.rope_high_freq_factor,
                          "original_max_position_embeddings": m.rope_original_max_len}
        rope.update(legacy_scaling)
    out = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.kv_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        # Not part of the model's function (RoPE needs no table); a source model's own value wins (extra).
        "max_position_embeddings": int(m.rope_original_max_len * m.rope_factor) if legacy_scaling else 4096,
        "rope_parameters": rope, "rope_theta": m.rope_theta, "rope_scaling": legacy_scaling,
        "dtype": dtype, "torch_dtype": dtype,
    }
    if kind == "olmoe":
        del out["head_dim"], out["mlp_bias"]  # OLMoE derives head_dim from hidden_size and has no mlp_bias
        out.update(intermediate_size=moe.expert_ffn(m), num_experts=moe.n_experts,
                   num_experts_per_tok=moe.top_k, norm_topk_prob=moe.normalize_top_k, clip_qkv=None)
    elif kind == "mixtral":
        del out["mlp_bias"]
        out.update(intermediate_size=moe.expert_ffn(m), num_local_experts=moe.n_experts,
                   num_experts_per_tok=moe.top_k, sliding_window=None)
    out.update(extra or {})
    return out
