"""Llama-style decoder: embedding -> L x (RMSNorm, GQA attention, RMSNorm, SwiGLU) -> RMSNorm.

The L blocks are one scanned block (params stacked on a leading `layers` axis) so compile time does
not grow with depth. Every parameter and every block-boundary activation carries logical axis
names; the model never names a mesh axis. Shapes: B batch, T sequence, D model, H query heads,
K kv heads, E head dim, F ffn, V (padded) vocabulary, L layers.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshtrain.config import ModelConfig
from meshtrain.model.attention import attention
from meshtrain.model.layers import RMSNorm, apply_rope, param, rope_tables, scaled_normal
from meshtrain.model.remat import remat_policy
from meshtrain.precision import Precision
from meshtrain.sharding import ShardingRules

RESIDUAL = ("batch", "act_res_seq", "act_embed")  # the residual stream between blocks


class Attention(nn.Module):
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    out_std: float

    @nn.compact
    def __call__(self, x_btd: jax.Array, cos_tf: jax.Array, sin_tf: jax.Array) -> jax.Array:
        c, p, r = self.cfg, self.policy, self.rules
        d, h, k, e = c.d_model, c.n_heads, c.n_kv_heads, c.kv_dim
        init = scaled_normal(c.init_std)
        wq_dhe = param(self, "wq", init, (d, h, e), ("embed", "heads", "head_dim"), p.param_dtype)
        wk_dke = param(self, "wk", init, (d, k, e), ("embed", "kv_heads", "head_dim"), p.param_dtype)
        wv_dke = param(self, "wv", init, (d, k, e), ("embed", "kv_heads", "head_dim"), p.param_dtype)
        wo_hed = param(self, "wo", scaled_normal(self.out_std), (h, e, d), ("heads", "head_dim", "embed"),
                       p.param_dtype)

        q_bthe = r.constrain(p.einsum("btd,dhe->bthe", x_btd, wq_dhe), ("batch", "act_seq", "act_heads", None))
        k_btke = r.constrain(p.einsum("btd,dke->btke", x_btd, wk_dke), ("batch", "act_seq", "act_kv_heads", None))
        v_btke = r.constrain(p.einsum("btd,dke->btke", x_btd, wv_dke), ("batch", "act_seq", "act_kv_heads", None))
        q_bthe = checkpoint_name(apply_rope(q_bthe, cos_tf, sin_tf), "qkv")
        k_btke = checkpoint_name(apply_rope(k_btke, cos_tf, sin_tf), "qkv")
        v_btke = checkpoint_name(v_btke, "qkv")

        o_bthe = attention(q_bthe, k_btke, v_btke, impl=c.attention, rules=r)
        o_bthe = checkpoint_name(r.constrain(o_bthe, ("batch", "act_seq", "act_heads", None)), "attn_out")
        return checkpoint_name(p.einsum("bthe,hed->btd", o_bthe, wo_hed), "attn_proj")


class SwiGLU(nn.Module):
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    out_std: float

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        c, p, r = self.cfg, self.policy, self.rules
        init = scaled_normal(c.init_std)
        w_gate_df = param(self, "w_gate", init, (c.d_model, c.d_ff), ("embed", "mlp"), p.param_dtype)
        w_up_df = param(self, "w_up", init, (c.d_model, c.d_ff), ("embed", "mlp"), p.param_dtype)
        w_down_fd = param(self, "w_down", scaled_normal(self.out_std), (c.d_ff, c.d_model), ("mlp", "embed"),
                          p.param_dtype)
        gate_btf = p.einsum("btd,df->btf", x_btd, w_gate_df)
        up_btf = p.einsum("btd,df->btf", x_btd, w_up_df)
        hidden_btf = r.constrain(jax.nn.silu(gate_btf) * up_btf, ("batch", "act_seq", "act_mlp"))
        hidden_btf = checkpoint_name(hidden_btf, "mlp_hidden")
        return checkpoint_name(p.einsum("btf,fd->btd", hidden_btf, w_down_fd), "mlp_out")


class Block(nn.Module):
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules

    @nn.compact
    def __call__(self, x_btd: jax.Array, cos_tf: jax.Array, sin_tf: jax.Array) -> tuple[jax.Array, None]:
        c, p, r = self.cfg, self.policy, self.rules
        out_std = c.init_std / (2 * c.n_layers) ** 0.5  # residual branches start small (GPT-2 scaling)
        h_btd = RMSNorm(c.norm_eps, p, r, c.norm, name="attn_norm")(x_btd)
        x_btd = r.constrain(x_btd + Attention(c, p, r, out_std, name="attn")(h_btd, cos_tf, sin_tf), RESIDUAL)
        h_btd = RMSNorm(c.norm_eps, p, r, c.norm, name="mlp_norm")(x_btd)
        x_btd = r.constrain(x_btd + SwiGLU(c, p, r, out_std, name="mlp")(h_btd), RESIDUAL)
        return x_btd, None  # (carry, per-layer output) as nn.scan expects


class Decoder(nn.Module):
    """tokens [B, T] -> (final hidden [B, T, D] in the compute dtype, output projection [D, V])."""

    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    vocab_padded: int
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        c, p, r = self.cfg, self.policy, self.rules
        table_vd = param(self, "embedding", scaled_normal(c.init_std), (self.vocab_padded, c.d_model),
                         ("vocab", "embed"), p.param_dtype)
        # The lookup reads a whole (compute-dtype) table: a gather from a sharded table would make the
        # compiler replicate its output anyway, and the table is small next to the layer stack.
        table_c_vd = r.constrain(p.cast(table_vd), (None, None))
        x_btd = r.constrain(jnp.take(table_c_vd, tokens_bt, axis=0), RESIDUAL)
        cos_tf, sin_tf = rope_tables(tokens_bt.shape[1], c.kv_dim, c.rope_theta)

        block = Block
        policy = remat_policy(self.remat)
        if policy is not None:
            # prevent_cse only matters outside scan; inside it would block useful fusions.
            block = nn.remat(Block, policy=policy, prevent_cse=not c.scan_layers)
        if c.scan_layers:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=(nn.broadcast, nn.broadcast), length=c.n_layers,
                            metadata_params={nn.PARTITION_NAME: "layers"})
            x_btd, _ = stack(c, p, r, name="layers")(x_btd, cos_tf, sin_tf)
        else:
            for i in range(c.n_layers):
                x_btd, _ = block(c, p, r, name=f"layer_{i}")(x_btd, cos_tf, sin_tf)

        h_btd = RMSNorm(c.norm_eps, p, r, c.norm, name="final_norm")(x_btd)
        if c.tie_embeddings:
            head_dv = table_vd.T
        else:
            head_dv = param(self, "lm_head", scaled_normal(c.d_model ** -0.5), (c.d_model, self.vocab_padded),
                            ("embed", "vocab"), p.param_dtype)
        return h_btd, head_dv
