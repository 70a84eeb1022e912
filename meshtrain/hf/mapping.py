"""Which Hugging Face tensor is which meshtrain parameter, for each architecture (torch Linear: [out, in]).

    HF tensor of layer i (`model.layers.i.` + name)    meshtrain parameter (scanned: leading L axis)
    self_attn.q_proj.weight           [H*E, D]          layers/attn/wq           [L, D, H, E]
    self_attn.k_proj, v_proj .weight  [K*E, D]          layers/attn/wk, wv       [L, D, K, E]
    self_attn.o_proj.weight           [D, H*E]          layers/attn/wo           [L, H, E, D]
    self_attn.q_norm.weight (olmoe)   [H*E]             layers/attn/q_norm/scale [L, H, E]
    self_attn.k_norm.weight (olmoe)   [K*E]             layers/attn/k_norm/scale [L, K, E]
    input_layernorm.weight            [D]               layers/attn_norm/scale   [L, D]
    post_attention_layernorm.weight   [D]               layers/mlp_norm/scale    [L, D]
  llama
    mlp.gate_proj, up_proj .weight    [F, D]            layers/mlp/w_gate, w_up  [L, D, F]
    mlp.down_proj.weight              [D, F]            layers/mlp/w_down        [L, F, D]
  olmoe (mlp.) and mixtral (block_sparse_moe.), expert x of X
    gate.weight                       [X, D]            layers/moe/router        [L, D, X]
    experts.x.gate_proj | w1 .weight  [F, D]            layers/moe/w_gate        [L, X, D, F]
    experts.x.up_proj   | w3 .weight  [F, D]            layers/moe/w_up          [L, X, D, F]
    experts.x.down_proj | w2 .weight  [D, F]            layers/moe/w_down        [L, X, F, D]

    model.embed_tokens.weight [V, D] -> embedding [Vp, D];  model.norm.weight [D] -> final_norm/scale;
    lm_head.weight [V, D] -> lm_head [D, Vp] (absent when tied; Vp: V padded for tp)

No permutation of q/k is needed: HF's models and meshtrain both rotate halves (pairs (i, i + E/2)).
These are the Hub's per-expert names, which transformers 5 also writes (save_pretrained's original format).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from meshtrain.config import ModelConfig, MoEConfig
from meshtrain.hf.config import architecture

EXPERT = "{x}"  # in a tensor name: one HF tensor per expert, stacked on meshtrain's X axis


@dataclass(frozen=True)
class Tensor:
    """One layer's HF tensor (one expert's, when its name holds EXPERT) and how it maps to meshtrain's layout."""

    name: str
    shape: tuple[int, ...]
    to_ours: Callable
    to_hf: Callable


def layer_table(m: ModelConfig, moe: MoEConfig | None = None) -> dict[tuple[str, ...], Tensor]:
    """meshtrain's path under `layers` (one layer's) -> its HF tensor, for `architecture(m, moe)`."""
    kind = architecture(m, moe, exact=False)
    d, h, k, e, f = m.d_model, m.n_heads, m.n_kv_heads, m.kv_dim, m.d_ff
    same, t = (lambda x: x), (lambda x: x.T)  # noqa: E731
    table = {
        ("attn", "wq"): Tensor("self_attn.q_proj.weight", (h * e, d), lambda w: w.T.reshape(d, h, e),
                               lambda p: p.reshape(d, h * e).T),
        ("attn", "wk"): Tensor("self_attn.k_proj.weight", (k * e, d), lambda w: w.T.reshape(d, k, e),
                               lambda p: p.reshape(d, k * e).T),
        ("attn", "wv"): Tensor("self_attn.v_proj.weight", (k * e, d), lambda w: w.T.reshape(d, k, e),
                               lambda p: p.reshape(d, k * e).T),
        ("attn", "wo"): Tensor("self_attn.o_proj.weight", (d, h * e), lambda w: w.T.reshape(h, e, d),
                               lambda p: p.reshape(h * e, d).T),
        ("attn_norm", "scale"): Tensor("input_layernorm.weight", (d,), same, same),
        ("mlp_norm", "scale"): Tensor("post_attention_layernorm.weight", (d,), same, same),
    }
    if kind == "olmoe":
        table[("attn", "q_norm", "scale")] = Tensor("self_attn.q_norm.weight", (h * e,), lambda w: w.reshape(h, e),
                                                    lambda p: p.reshape(h * e))
        table[("attn", "k_norm", "scale")] = Tensor("self_attn.k_norm.weight", (k * e,), lambda w: w.reshape(k, e),
                                                    lambda p: p.reshape(k * e))
    if kind == "llama":
        table.update({("mlp", "w_gate"): Tensor("mlp.gate_proj.weight", (f, d), t, t),
                      ("mlp", "w_up"): Tensor("mlp.up_proj.weight", (f, d), t, t),
                      ("mlp", "w_down"): Tensor("mlp.down_proj.weight", (d, f), t, t)})
        return table
    fx = moe.expert_ffn(m)
    block, gate, up, down = (("mlp", "gate_proj", "up_proj", "down_proj") if kind == "olmoe"
                             else ("block_sparse_moe", "w1", "w3", "w2"))
    table.update({
        ("moe", "router"): Tensor(f"{block}.gate.weight", (moe.n_experts, d), t, t),
        ("moe", "w_gate"): Tensor(f"{block}.experts.{EXPERT}.{gate}.weight", (fx, d), t, t),
        ("moe", "w_up"): Tensor(f"{block}.experts.{EXPERT}.{up}.weight", (fx, d), t, t),
        ("moe", "w_down"): Tensor(f"{block}.experts.{EXPERT}.{down}.weight", (d, fx), t, t),
    })
    return table


def layer_names(tensor: Tensor, i: int, n_experts: int) -> list[str]:
    """The full HF names of `tensor` in layer i: one, or one per expert in expert order."""
    name = f"model.layers.{i}.{tensor.name}"
    return [name.replace(EXPERT, str(x)) for x in range(n_experts)] if EXPERT in name else [name]


def hf_shapes(m: ModelConfig, moe: MoEConfig | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config stores in its architecture, with its HF shape."""
    d, v = m.d_model, m.vocab_size
    n_experts = moe.n_experts if moe is not None else 0
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for tensor in layer_table(m, moe).values():
        for i in range(m.n_layers):
            out.update(dict.fromkeys(layer_names(tensor, i, n_experts), tensor.shape))
    if not m.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out
