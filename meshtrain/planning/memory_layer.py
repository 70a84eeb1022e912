"""What one layer keeps for its backward pass, per microbatch and device: the remat policies' residuals by shape
class (checked against jax's saved_residuals in the tests), fp8 sites' quantized inputs, and the tapped sites a
split backward keeps from F and B to W. memory.py adds them up over the stack; memory_moe.py counts the routed
experts' region."""
from __future__ import annotations

from meshtrain.config import MATMUL_SITES, Config, remat_parts, runs_plain
from meshtrain.planning.layout import DTYPE_BYTES, Layout, moe_layers, tokens_per_device, tp_degrees
from meshtrain.planning.memory_moe import expert_layer_bytes

# What JAX's autodiff keeps per layer for meshtrain's block (the scan's stacked residuals, read with
# jax.ad_checkpoint.saved_residuals): tensor counts by shape class, per remat policy.
#   D: [tokens, d_model]  F: [tokens, d_ff/tp]  Q: [tokens, heads/tp, E]  KV: [tokens, kv_heads/tp, E]
#   S: [b, heads/tp, s, s] attention scores/probabilities (reference attention only)
# `c` entries are in the compute dtype, `f32` entries always fp32 (norms and softmax run in fp32).
RESIDUALS = {
    "none": dict(D_c=2, D_f32=4, F_c=6, Q_c=4, KV_c=0, S_c=1, S_f32=2),
    "full": dict(D_c=1),
    "save_dots": dict(D_c=2, F_c=2, Q_c=1, KV_c=2),
    # save_dots with the rotated q and k in place of the projections before RoPE, plus the fused attention
    # kernel's output o (its fp32 log-sum-exp, [b, H/tp, s], is left out as small). With the jnp reference
    # attention there is no o to keep: it counts as save_dots (residual_counts).
    "save_dots_attn": dict(D_c=2, F_c=2, Q_c=2, KV_c=2),
    "save_attn": dict(D_c=1, Q_c=2, KV_c=2),
}
# attn_proj and mlp_out feed only the residual add, whose backward needs neither: saving them keeps nothing.
# The routed experts' points (moe_*) keep the exchange's row buffers: memory_moe.EXPERT_POINTS counts them.
NAMED_POINTS = {"attn_in": dict(D_c=1), "qkv": dict(Q_c=1, KV_c=2), "attn_out": dict(Q_c=1), "attn_proj": {},
                "mlp_in": dict(D_c=1), "mlp_hidden": dict(F_c=1), "mlp_out": {}, "moe_in": {}, "moe_hidden": {},
                "moe_out": {}}


def residual_counts(remat: str, fused_attention: bool = True) -> dict:
    """Tensors kept per shape class. A union of policies (p+q) is counted as the sum of its parts, with the
    block input once: a bound where both parts keep the same value. fused_attention=False: the jnp reference
    attention, which has no kernel output for save_dots_attn to keep (it counts as save_dots)."""
    parts = [_part_counts(policy, points, fused_attention) for policy, points in remat_parts(remat)]
    if len(parts) == 1:
        return parts[0]
    counts = {"D_c": 1}
    for part in parts:
        for k, v in part.items():
            counts[k] = counts.get(k, 0) + v - (k == "D_c")
    return counts


def _part_counts(policy: str, points: tuple[str, ...], fused_attention: bool) -> dict:
    if policy == "save_dots_attn" and not fused_attention:
        return RESIDUALS["save_dots"]
    if policy in RESIDUALS:
        return RESIDUALS[policy]
    counts = {"D_c": 1}  # the block input, as for every policy that recomputes
    for point in points:
        for k, v in NAMED_POINTS[point].items():
            counts[k] = counts.get(k, 0) + v
    return counts


def layer_activation_bytes(cfg: Config, lay: Layout, attention_impl: str, remat: str | None = None,
                           quantized_inputs: bool = True) -> float:
    """Bytes one layer keeps for the backward pass, per microbatch, per device (the mean over the stack's dense
    and MoE layers). quantized_inputs=False counts fp8 sites' inputs as bf16 sites keep them (fp8_input_bytes)."""
    m, g = cfg.model, lay.degrees
    c = DTYPE_BYTES[cfg.precision.compute]
    policy = lay.remat if remat is None else remat
    counts = residual_counts(policy, fused_attention=attention_impl != "reference")
    tp, tpk = tp_degrees(cfg, lay)
    n = tokens_per_device(cfg, lay)
    b = n / (cfg.data.seq_len / (g["cp"] * g["sp"]))
    s = cfg.data.seq_len / (g["cp"] * g["sp"])
    # Ulysses (sp) runs attention over the whole sequence with heads/sp; context parallelism (cp)
    # holds s/cp queries against s/cp keys per ring step.
    s_att, h_att = s * g["sp"], m.n_heads / tp / g["sp"]
    sp_div = tp if lay.sequence_parallel else 1  # fp32 norm internals live on the seq-sharded stream
    d_c = n * m.d_model / (sp_div if counts.get("D_c", 0) == 1 else 1)
    out = d_c * c * counts.get("D_c", 0) + n * m.d_model / sp_div * 4 * counts.get("D_f32", 0)
    # The dense FFN's width, over the stack: an MoE layer has only its shared experts' dense SwiGLU.
    n_moe, L = moe_layers(cfg), m.n_layers
    f = ((L - n_moe) * m.d_ff + n_moe * cfg.moe.n_shared * cfg.moe.expert_ffn(m)) / L
    out += n * f / tp * c * counts.get("F_c", 0)
    out += n * m.n_heads / tp * m.kv_dim * c * counts.get("Q_c", 0)
    out += n * m.n_kv_heads / tpk * m.kv_dim * c * counts.get("KV_c", 0)
    if counts.get("S_c") or counts.get("S_f32"):
        if attention_impl == "reference":
            scores = b * h_att * s_att * s_att
            out += scores * (c * counts.get("S_c", 0) + 4 * counts.get("S_f32", 0))
            out += 2 * b * h_att * s_att * 4 + 4 * n * 4  # softmax max/sum, norm 1/rms
        else:  # flash kernels keep the output (counted in Q) and the log-sum-exp
            out += b * h_att * s_att * 4 + 4 * n * 4
    if n_moe:
        out += n_moe / L * expert_layer_bytes(cfg, policy, g, n, c)
    if quantized_inputs and policy == "none" and not n_moe and per_tensor_fp8_layers(cfg):
        out += fp8_input_bytes(cfg, n, tp, tpk, c)
    return out


def some_layer_site_plain(cfg: Config) -> bool:
    """Some dense layer matmul site (attn.*, mlp.*) runs plain bf16, not an fp8 recipe."""
    return any(runs_plain(cfg.precision, site) for site in MATMUL_SITES if site.startswith(("attn.", "mlp.")))


def per_tensor_fp8_layers(cfg: Config) -> bool:
    """Every dense layer site runs a per-tensor fp8 recipe (fp8, fp8_delayed): none excluded."""
    return cfg.precision.matmul in ("fp8", "fp8_delayed") and not some_layer_site_plain(cfg)


def fp8_input_bytes(cfg: Config, n: float, tp: int, tpk: int, c: int) -> float:
    """What per-tensor fp8 sites change in a dense layer's residuals under remat none (fp8.per_tensor_matmul keeps
    each site's input quantized and transposed, one byte a value): the inputs that only matmuls read leave the
    compute dtype (the two norms' outputs, attention's output, the SwiGLU hidden), each site keeps its own e4m3
    copy (q, k, v, gate and up of [tokens, D], wo's of the attention output, w_down's of the hidden), and the
    attention weights, reshaped in the layer, keep their e4m3 values per layer. Checked against jax's
    saved_residuals (tests/test_planning.py)."""
    m = cfg.model
    d, q, kv, f = m.d_model, m.n_heads / tp * m.kv_dim, m.n_kv_heads / tpk * m.kv_dim, m.d_ff / tp
    dropped = n * (2 * d + q + f) * c
    quantized = n * (5 * d + q + f) + d * (2 * q + 2 * kv)
    return quantized - dropped


def tapped_site_bytes(cfg: Config, lay: Layout) -> float:
    """Bytes one layer's tapped matmul sites keep per microbatch in a split backward (step/pipeline/weight_grads.py):
    the sites' inputs from F to W (the attention's normed input, its output, the FFN's normed input, its hidden)
    and their outputs' gradients from B to W (q, k, v, the attention's projection, gate, up, the FFN's output).
    Counted for a dense layer with bf16 sites: fp8 sites and the routed experts are not tapped."""
    m = cfg.model
    c = DTYPE_BYTES[cfg.precision.compute]
    tp, tpk = tp_degrees(cfg, lay)
    n = tokens_per_device(cfg, lay)
    d, q, kv, f = n * m.d_model, n * m.n_heads / tp * m.kv_dim, n * m.n_kv_heads / tpk * m.kv_dim, n * m.d_ff / tp
    return c * ((2 * d + q + f) + (q + 2 * kv + d + 2 * f + d))


def split_pullback_bytes(cfg: Config, lay: Layout) -> float:
    """What a layer's pullback keeps per microbatch beyond its remat policy's residuals when its backward is split:
    the tapped sites' outputs, which B differentiates through without W's matmuls (q, k, v, a [tokens, D] and
    gate and up), less what the policy keeps already (remat none: everything; save_attn, names:qkv,...: q, k
    and v). Counted from a chunk's Stash (step/pipeline/ops.py) under none, full, save_dots and save_attn."""
    if lay.remat == "none":
        return 0.0
    m = cfg.model
    c = DTYPE_BYTES[cfg.precision.compute]
    tp, tpk = tp_degrees(cfg, lay)
    n = tokens_per_device(cfg, lay)
    out = n * (m.d_model + 2 * m.d_ff / tp)
    if lay.remat != "save_attn" and "qkv" not in lay.remat:
        out += n * (m.n_heads / tp + 2 * m.n_kv_heads / tpk) * m.kv_dim
    return c * out


def split_backward_bytes(cfg: Config, lay: Layout) -> float:
    """What a tapped layer keeps per microbatch for a split backward: its sites (tapped_site_bytes) and what its
    split pullback keeps more (split_pullback_bytes). memory_pipeline counts it per chunk and stash slot. Nothing
    where every layer site runs an fp8 recipe: only bf16 sites are tapped (model/layers.py `tap_sites`); where some
    do, all are counted (an upper bound)."""
    if not some_layer_site_plain(cfg):
        return 0.0
    return tapped_site_bytes(cfg, lay) + split_pullback_bytes(cfg, lay)
