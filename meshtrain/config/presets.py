"""Model presets: `model.preset` fills the model section's shape fields (and the moe section's)."""
from __future__ import annotations

from typing import Any

# Shapes, plus the norm epsilon and RoPE of the published models (their config.json); everything else
# keeps its default. `llama1b` is the peers' benchmark shape. A `moe` entry fills the moe section the
# same way (explicit moe.* keys override it).
LLAMA2 = dict(norm_eps=1e-5, rope_theta=10000.0)
LLAMA3 = dict(norm_eps=1e-5, rope_theta=500000.0)
LLAMA31 = dict(LLAMA3, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_len=8192)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=352, vocab_size=256),
    "tiny_moe": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=352, vocab_size=256,
                     moe=dict(n_experts=8, top_k=2, d_ff_expert=96)),
    # allenai/OLMoE-1B-7B-0924 (config.json): 6.9B parameters, 1.3B active; its QK-norm is not modelled.
    "olmoe_1b7b": dict(n_layers=16, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=1024, vocab_size=50304,
                       norm_eps=1e-5, moe=dict(n_experts=64, top_k=8, d_ff_expert=1024, aux_loss_coef=0.01,
                                               z_loss_coef=0.001)),
    "small": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=704, vocab_size=512),
    "125m": dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, d_ff=2048, vocab_size=32000),
    "llama1b": dict(n_layers=24, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=5632, vocab_size=32000,
                    norm_eps=1e-5),
    "llama3_8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256, **LLAMA3),
    "llama3_1_8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256,
                        **LLAMA31),
    "llama2_13b": dict(n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, d_ff=13824, vocab_size=32000, **LLAMA2),
    "llama3_70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256,
                       **LLAMA3),
}
