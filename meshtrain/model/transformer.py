"""Llama-style decoder: embedding -> L x (RMSNorm, GQA attention, RMSNorm, SwiGLU) -> RMSNorm.
(model.qk_norm=all_heads adds OLMoE's RMSNorm of the whole q and k projections before RoPE.)

The decoder comes in pieces over one params tree, so that a pipeline stage can run only its own:

    embed(tokens [B, T])                      -> x [B, T, D]          params: embedding
    layers(x, SeqInfo)                        -> x [B, T, D]          params: layers (stacked on L)
    head(x)                                   -> (h [B, T, D], W [D, V])  params: final_norm, lm_head
    __call__(tokens, positions, segment_ids)  =  head(layers(embed(tokens), seq_info(...)))

The L blocks are one scanned block (params stacked on a leading `layers` axis) so compile time does
not grow with depth; `block_stack(..., n_layers=k)` runs any k of them, which is what a pipeline
stage does with its slice of the stack. With MoE every `moe.every`-th FFN is a mixture of experts
(model/moe.py): scanned, the stack is then a scan over groups of `every` blocks (every-1 dense, the
last MoE), so one scan body still covers the whole depth and the params stay stacked on L/every. Every parameter and every block-boundary activation carries
logical axis names; the model never names a mesh axis. Shapes: B batch, T sequence, D model, H query
heads, K kv heads, E head dim, F ffn, V (padded) vocabulary, L layers.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshtrain.config import ModelConfig, MoEConfig
from meshtrain.model.attention import attention
from meshtrain.model.embedding import embedding_lookup
from meshtrain.model.kv_cache import cached_attention
from meshtrain.model.layers import (FP8_META, SITE_GRADS, SITE_INPUTS, AllHeadsRMSNorm, Llama3RopeScaling, RMSNorm,
                                     SwiGLU, apply_rope, gathered_site_matmuls, param, rope_tables, scaled_normal,
                                     scattered_site_matmul, site_matmul, tap_sites)
from meshtrain.model.moe import LOSSES, METRICS, MoE
from meshtrain.model.remat import remat_policy
from meshtrain.precision import Precision
from meshtrain.resolve import Execution
from meshtrain.sharding import KV, Q, RESIDUAL, TOKENS, ShardingRules


@flax.struct.dataclass
class SeqInfo:
    """What every block needs to know about the tokens besides their hidden states."""

    positions_bt: jax.Array  # int32: RoPE position; causality is position order within a segment
    segment_ids_bt: jax.Array  # int32: attention stays within a segment (document)
    cos_btf: jax.Array  # fp32 [B, T, E/2]: rotary tables at these positions
    sin_btf: jax.Array


def seq_info(positions_bt: jax.Array, segment_ids_bt: jax.Array, cfg: ModelConfig, rules: ShardingRules) -> SeqInfo:
    positions_bt = rules.constrain(positions_bt, TOKENS)
    cos_btf, sin_btf = rope_tables(positions_bt, cfg.kv_dim, cfg.rope_theta, Llama3RopeScaling.of(cfg))
    return SeqInfo(positions_bt, rules.constrain(segment_ids_bt, TOKENS), cos_btf, sin_btf)


class Attention(nn.Module):
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    exe: Execution
    out_std: float
    document_mask: bool
    decode: bool = False  # generation: keep a KV cache (model/kv_cache.py)

    @nn.compact
    def __call__(self, x_btd: jax.Array, info: SeqInfo) -> jax.Array:
        c, p, r = self.cfg, self.policy, self.rules
        d, h, k, e = c.d_model, c.n_heads, c.n_kv_heads, c.kv_dim
        init = scaled_normal(c.init_std)
        wq_dhe = param(self, "wq", init, (d, h, e), ("embed", "heads", "head_dim"), p.param_dtype)
        wk_dke = param(self, "wk", init, (d, k, e), ("embed", "kv_heads", "head_dim"), p.param_dtype)
        wv_dke = param(self, "wv", init, (d, k, e), ("embed", "kv_heads", "head_dim"), p.param_dtype)
        wo_hed = param(self, "wo", scaled_normal(self.out_std), (h, e, d), ("o_heads", "head_dim", "o_embed"),
                       p.param_dtype)

        ring = self.exe.tp_ring and not self.decode
        if ring:  # one ring over tp brings x's sequence chunks to all three projections
            q_bthe, k_btke, v_btke = gathered_site_matmuls(self, x_btd, [
                ("attn.wq", "btd,dhe->bthe", wq_dhe, ("embed", "heads", "head_dim"), Q),
                ("attn.wk", "btd,dke->btke", wk_dke, ("embed", "kv_heads", "head_dim"), KV),
                ("attn.wv", "btd,dke->btke", wv_dke, ("embed", "kv_heads", "head_dim"), KV)])
        else:
            q_bthe = site_matmul(self, "attn.wq", "btd,dhe->bthe", x_btd, wq_dhe)
            k_btke = site_matmul(self, "attn.wk", "btd,dke->btke", x_btd, wk_dke)
            v_btke = site_matmul(self, "attn.wv", "btd,dke->btke", x_btd, wv_dke)
        q_bthe, k_btke, v_btke = tap_sites(self, x_btd, ("attn.wq", "attn.wk", "attn.wv"), (q_bthe, k_btke, v_btke))
        q_bthe = r.constrain(q_bthe, Q)
        k_btke, v_btke = r.constrain(k_btke, KV), r.constrain(v_btke, KV)
        if c.qk_norm == "all_heads":
            q_bthe = AllHeadsRMSNorm(c.norm_eps, p, ("heads", "head_dim"), name="q_norm")(q_bthe)
            k_btke = AllHeadsRMSNorm(c.norm_eps, p, ("kv_heads", "head_dim"), name="k_norm")(k_btke)
        q_bthe = checkpoint_name(apply_rope(q_bthe, info.cos_btf, info.sin_btf), "qkv")
        k_btke = checkpoint_name(apply_rope(k_btke, info.cos_btf, info.sin_btf), "qkv")
        v_btke = checkpoint_name(v_btke, "qkv")

        if self.decode:  # this call's k, v join the cache; the queries read all of it
            o_bthe = cached_attention(self, q_bthe, k_btke, v_btke, info.positions_bt, info.segment_ids_bt, r)
        else:
            o_bthe = attention(q_bthe, k_btke, v_btke, info.positions_bt, info.segment_ids_bt, exe=self.exe,
                               document_mask=self.document_mask, rules=r)
        o_bthe = checkpoint_name(r.constrain(o_bthe, Q), "attn_out")
        if ring:
            out_btd = scattered_site_matmul(self, "attn.wo", "bthe,hed->btd", o_bthe, wo_hed, Q,
                                            ("o_heads", "head_dim", "o_embed"))
        else:
            out_btd = site_matmul(self, "attn.wo", "bthe,hed->btd", o_bthe, wo_hed)
        (out_btd,) = tap_sites(self, o_bthe, ("attn.wo",), (out_btd,))
        return checkpoint_name(out_btd, "attn_proj")


class Block(nn.Module):
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    exe: Execution
    document_mask: bool = False
    decode: bool = False
    moe: MoEConfig | None = None  # set: the FFN is a mixture of experts

    @nn.compact
    def __call__(self, x_btd: jax.Array, info: SeqInfo) -> tuple[jax.Array, None]:
        c, p, r, exe = self.cfg, self.policy, self.rules, self.exe
        out_std = c.init_std / (2 * c.n_layers) ** 0.5  # residual branches start small (GPT-2 scaling)
        h_btd = checkpoint_name(RMSNorm(c.norm_eps, p, r, exe.norm, exe.interpret, name="attn_norm")(x_btd), "attn_in")
        attn = Attention(c, p, r, exe, out_std, self.document_mask, self.decode, name="attn")
        x_btd = r.constrain(x_btd + attn(h_btd, info), RESIDUAL)
        h_btd = checkpoint_name(RMSNorm(c.norm_eps, p, r, exe.norm, exe.interpret, name="mlp_norm")(x_btd), "mlp_in")
        ring = exe.tp_ring and not self.decode
        ffn = (MoE(c, self.moe, p, r, out_std, exe.moe_exchange, exe.moe_gemm, exe.moe_fp32, name="moe") if self.moe
               else SwiGLU(c, p, r, out_std, ring, name="mlp"))
        x_btd = r.constrain(x_btd + ffn(h_btd), RESIDUAL)
        return x_btd, None  # (carry, per-layer output) as nn.scan expects


class UnrolledStack(nn.Module):
    """The layers as separate modules (`layer_0`, ...): no scan, for compilers that schedule better so.
    Also one scanned group of `moe.every` blocks (`layer_0` .. dense, the last MoE)."""

    block: type
    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    exe: Execution
    n_layers: int
    document_mask: bool
    decode: bool = False
    moe: MoEConfig | None = None

    @nn.compact
    def __call__(self, x_btd: jax.Array, info: SeqInfo) -> tuple[jax.Array, None]:
        for i in range(self.n_layers):
            moe = self.moe if self.moe and self.moe.is_moe_layer(i) else None
            block = self.block(self.cfg, self.policy, self.rules, self.exe, self.document_mask, self.decode, moe,
                               name=f"layer_{i}")
            x_btd, _ = block(x_btd, info)
        return x_btd, None


def block_stack(cfg: ModelConfig, policy: Precision, rules: ShardingRules, exe: Execution, *, n_layers: int,
                remat: str = "none", document_mask: bool = False, decode: bool = False,
                moe: MoEConfig | None = None, scan: bool | None = None) -> nn.Module:
    """A module running `n_layers` blocks: (x [B, T, D], SeqInfo) -> (x, None); params stacked on L when
    scanned (`scan`, by default cfg.scan_layers). A pipeline stage builds one with its share of the layers."""
    scan = cfg.scan_layers if scan is None else scan
    moe = moe if moe is not None and moe.enabled else None
    block = Block
    policy_fn = remat_policy(remat)
    if policy_fn is not None:
        # prevent_cse only matters outside scan; inside it would block useful fusions.
        block = nn.remat(Block, policy=policy_fn, prevent_cse=not scan)
    if not scan:
        return UnrolledStack(block, cfg, policy, rules, exe, n_layers, document_mask, decode, moe)
    # fp8 amax histories, the decode cache, sown auxiliary losses and router metrics, and the split backward's
    # taps stack on `layers` like the params: one per layer (or per group of moe.every layers).
    variable_axes = {name: 0 for name in ("params", "cache", FP8_META, LOSSES, METRICS, SITE_INPUTS, SITE_GRADS)}
    scan = partial(nn.scan, variable_axes=variable_axes,
                   split_rngs={"params": True}, in_axes=(nn.broadcast,), metadata_params={nn.PARTITION_NAME: "layers"})
    if moe is None or moe.every == 1:
        return scan(block, length=n_layers)(cfg, policy, rules, exe, document_mask, decode, moe)
    return scan(UnrolledStack, length=n_layers // moe.every)(block, cfg, policy, rules, exe, moe.every,
                                                             document_mask, decode, moe)


def unrolled_layers(stacked: dict, n_layers: int, every: int = 1, take=lambda x, i: x[i]) -> dict:
    """A scanned stack's `layers` subtree (leaves [L, ...], or with MoE groups `layer_j` leaves [L/every, ...])
    -> the same values named as the unrolled stack names them: `layer_i` is slice i (or group i // every,
    member i % every). `take(leaf, i)` makes slice i (of a tree of shardings, say)."""
    if every == 1:
        return {f"layer_{i}": jax.tree.map(lambda x, i=i: take(x, i), stacked) for i in range(n_layers)}
    # Members a collection lacks stay absent (only the MoE member sows the router losses).
    return {f"layer_{g * every + int(member.removeprefix('layer_'))}": jax.tree.map(lambda x, g=g: take(x, g), tree)
            for member, tree in stacked.items() for g in range(n_layers // every)}


def stacked_layers(unrolled: dict, n_layers: int, every: int = 1, stack_leaves=lambda *xs: jnp.stack(xs)) -> dict:
    """The inverse of unrolled_layers: `layer_i` subtrees -> leaves stacked on L (or per group member).
    `stack_leaves(*leaves)` makes one stacked leaf (of a tree of shapes, say)."""
    def stack(names):
        return jax.tree.map(stack_leaves, *[unrolled[name] for name in names])

    if every == 1:
        return stack([f"layer_{i}" for i in range(n_layers)])
    members = {f"layer_{i % every}" for i in range(n_layers) if f"layer_{i}" in unrolled}
    return {member: stack([f"layer_{g * every + int(member.removeprefix('layer_'))}" for g in range(n_layers // every)])
            for member in sorted(members)}


def init_variables(model: "Decoder", key: jax.Array, tokens_bt: jax.Array) -> dict:
    """`model.init`'s variables (unboxed), drawn through the scanned stack even when the model unrolls its
    layers, then renamed: the numbers do not depend on `scan_layers`, and the compiler sees one scan body
    instead of a random-number kernel for every parameter of every layer (an unrolled 1B model's init
    took longer to compile than its train step)."""
    cfg = model.cfg
    scanned = model if cfg.scan_layers else model.clone(cfg=dataclasses.replace(cfg, scan_layers=True))
    variables = nn.unbox(scanned.init(key, tokens_bt, tokens_bt, tokens_bt))
    if cfg.scan_layers:
        return variables
    return {name: {**tree, "layers": unrolled_layers(tree["layers"], cfg.n_layers, model.every)} if "layers" in tree
            else tree for name, tree in variables.items()}


class Decoder(nn.Module):
    """(tokens, positions, segment_ids) [B, T] -> (final hidden [B, T, D] in the compute dtype, output
    projection [D, V]); also callable piecewise (module docstring)."""

    cfg: ModelConfig
    policy: Precision
    rules: ShardingRules
    exe: Execution  # every `auto` decided (kernels, the tp ring, the expert exchange, the padded vocabulary)
    remat: str = "none"
    document_mask: bool = False
    decode: bool = False  # generation: every attention keeps a KV cache (collection "cache")
    moe: MoEConfig | None = None

    def setup(self) -> None:
        c, p, r, exe = self.cfg, self.policy, self.rules, self.exe
        self.embedding = param(self, "embedding", scaled_normal(c.init_std), (exe.vocab_padded, c.d_model),
                               ("vocab", "embed"), p.param_dtype)
        self.layers = self.stack(c.n_layers)
        self.final_norm = RMSNorm(c.norm_eps, p, r, exe.norm, exe.interpret)
        if not c.tie_embeddings:
            self.lm_head = param(self, "lm_head", scaled_normal(c.d_model ** -0.5), (c.d_model, exe.vocab_padded),
                                 ("embed", "vocab"), p.param_dtype)

    @property
    def vocab_padded(self) -> int:
        return self.exe.vocab_padded

    @nn.nowrap  # a builder, not a module method: callable on an unbound decoder (the pipeline's stages)
    def stack(self, n_layers: int, scan: bool | None = None) -> nn.Module:
        """The module running `n_layers` of this decoder's blocks, built as its own stack is (the one
        builder): the whole stack in `setup`, a pipeline stage's chunk of it elsewhere."""
        return block_stack(self.cfg, self.policy, self.rules, self.exe, n_layers=n_layers, remat=self.remat,
                           document_mask=self.document_mask, decode=self.decode, moe=self.moe, scan=scan)

    @property
    def every(self) -> int:
        """Layers per scanned group: moe.every with MoE layers, else 1 (unrolled_layers' grouping)."""
        return self.moe.every if self.moe is not None and self.moe.enabled else 1

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        # A gather from the whole compute-dtype table; the fp32 table goes in, so that its gradient
        # (summed as model.embedding_grad says) comes back fp32.
        x_btd = embedding_lookup(self.embedding, tokens_bt, compute_dtype=self.policy.compute_dtype,
                                 grad=self.cfg.embedding_grad, rules=self.rules)
        return self.rules.constrain(x_btd, RESIDUAL)

    def head(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
        h_btd = self.final_norm(x_btd)
        head_dv = self.embedding.T if self.cfg.tie_embeddings else self.lm_head
        return h_btd, head_dv

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array,
                 segment_ids_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        x_btd = self.embed(tokens_bt)
        x_btd, _ = self.layers(x_btd, seq_info(positions_bt, segment_ids_bt, self.cfg, self.rules))
        return self.head(x_btd)
