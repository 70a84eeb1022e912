"""Analytic per-device memory of a train step: parameters, gradients, optimizer state, activations.

The Ultra-Scale Playbook's accounting, applied to the tensors meshtrain actually keeps:

    state (per parameter)   meshtrain: fp32 master params 4 B, fp32 grads 4 B, Adam m and v 8 B
                            = 16 B/param (the playbook's mixed-precision figure is 2+2+12 = 16 B too,
                            with a bf16 copy where meshtrain casts on the fly)
    ZeRO over fsdp (N_d)    stage 1: optimizer / N_d; 2: + grads / N_d; 3: + params / N_d
    tp                      every matrix's heads, kv heads (when tp divides them), ffn and vocab dim
    pp                      the layer stack (the first/last stage also hold embedding/head)
    ep                      the routed experts' weights (whole experts per rank); the router is replicated

    activations per layer, per microbatch, per device: what autodiff keeps for meshtrain's block
      (RESIDUALS below, and memory_moe.EXPERT_RESIDUALS for an MoE FFN, checked against jax's own
      saved_residuals in the tests), by shape class:
      [tokens, D], [tokens, F/tp], [tokens, H/tp, E], [tokens, K/tp, E] and, for reference attention,
      the fp32 scores [b, H/tp, s, s] -- the Korthikanti et al. "sbh(34 + 5as/h)" of a GPT layer
      (playbook.gpt_layer_activation_bytes), recounted for a Llama block (no dropout, SwiGLU, GQA, fp32 norms);
      none keeps them all, full only the block input, save_dots the projections, save_attn q, k, v
      and the attention output. Tokens per device are divided by dp, fsdp and ep (sequences) and by cp
      and sp (sequence); tp divides heads and ffn, and with sequence parallelism the fp32 norm
      internals and a recomputing policy's block input.

Transient buffers that the compiler must also hold are counted where they belong: the gradient of the
scanned stack and (grad_accum > 1) its accumulator under `grads`, the optimizer's update under `optimizer`, a
ZeRO-3 layer's gathered weights and a pipeline's copy of the stage's weights under `params`; under
`activations` the layer being differentiated (its cotangents or recomputed residuals, its weights sliced out of
the stack, the experts' grouped-matmul buffers), the logits and their gradient, a pipeline stage's stash
(memory_pipeline).

Exact and approximate. The resident state (params, optimizer state, the batch) is what the step receives: it
equals memory_analysis()'s argument bytes to a few bytes. The per-layer residuals and a stage's stash are exact
counts of what jax keeps. XLA's peak is not a sum: it is the size of the heap its buffer assignment packs, and
buffers live at different times share it imperfectly. For XLA:CPU the estimate adds every term (grads, the working
layer and the head are never all live at the forward's end, where a remat-none step peaks); that sum tracks the
packed heap within 10% on tests/test_memory_grid.py's grid. XLA:GPU packs tighter, and `estimate(backend="gpu")`
says where (tests/test_memory_gpu_peaks.py: measured peaks within 10%). Neither bounds the heap: read it as an
estimate.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from meshtrain.config import MATMUL_SITES, Config, padded_vocab, remat_parts, runs_plain
from meshtrain.config.pipeline import last_chunk_remat
from meshtrain.planning.memory_moe import expert_layer_bytes, grouped_matmul_working_bytes
from meshtrain.planning.memory_pipeline import chunk_layers, in_flight, stage_activation_bytes
from meshtrain.resolve import Execution
from pallas_kernels.cross_entropy_sum import token_chunk

AXES = ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by config dtype name


@dataclass(frozen=True)
class Layout:
    """One way to run a model: mesh degrees and the knobs that trade memory for time."""

    degrees: dict[str, int]
    zero_stage: int = 1
    remat: str = "none"
    micro_batch: int = 16  # sequences per microbatch, over all devices
    grad_accum: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # pipeline schedule, used when pp > 1
    virtual_stages: int = 1  # its chunks per stage
    loss: str = "reference"  # model.loss: `fused` holds one token chunk's logits, not all of them

    @classmethod
    def of(cls, cfg: Config) -> "Layout":
        """The layout `cfg` asks for, its pipeline schedule included."""
        return cls({a: getattr(cfg.mesh, a) for a in AXES}, cfg.train.zero_stage, cfg.train.remat,
                   cfg.train.global_batch // cfg.train.grad_accum, cfg.train.grad_accum,
                   cfg.parallel.sequence_parallel, cfg.pipeline.schedule, cfg.pipeline.virtual_stages, cfg.model.loss)

    def overrides(self) -> list[str]:
        """The config overrides that select this layout."""
        return ([f"mesh.{a}={self.degrees[a]}" for a in AXES] +
                [f"train.zero_stage={self.zero_stage}", f"train.remat={self.remat}",
                 f"train.grad_accum={self.grad_accum}",
                 f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}", f"model.loss={self.loss}"]
                + ([f"pipeline.schedule={self.schedule}", f"pipeline.virtual_stages={self.virtual_stages}",
                    "model.scan_layers=true"]  # the stages split the stacked layer axis (a chunk runs it unrolled)
                   if self.degrees["pp"] > 1 else [])
                + (["parallel.cp_impl=allgather"] if self.gathers_kv_in_stages else []))

    @property
    def gathers_kv_in_stages(self) -> bool:
        """Inside a pipeline stage the ring runs on two ranks only (config validation): the planner gathers K/V
        there instead."""
        return self.degrees["pp"] > 1 and self.degrees["cp"] > 2

    def label(self) -> str:
        mesh = " ".join(f"{a}{n}" for a, n in self.degrees.items() if n > 1) or "1 device"
        sp = "+SP" if self.sequence_parallel else ""
        pipe = ""
        if self.degrees["pp"] > 1:
            pipe = f" {self.schedule}" + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        loss = " fused-loss" if self.loss == "fused" else ""
        return f"{mesh}{sp}{pipe} Z{self.zero_stage} {self.remat} mb{self.micro_batch}x{self.grad_accum}{loss}"


@dataclass(frozen=True)
class Tensor:
    """A parameter tensor by the mesh axes that may shard it."""

    elems: int
    tp: int = 1  # divisor from tensor parallelism
    embed: bool = True  # ZeRO-3 shards it over fsdp (sharding.py says along which dim)
    layer: bool = True  # in the layer stack (pp shards it)
    ep: int = 1  # divisor from expert parallelism
    routed: bool = False  # a routed expert's weights (memory_moe counts what their region keeps)


def moe_layers(cfg: Config) -> int:
    """Layers whose FFN is a mixture of experts (every `moe.every`-th; none in a dense model)."""
    return _moe_layers(cfg.moe, cfg.model.n_layers)


@functools.lru_cache(maxsize=64)  # the planner asks once per layout it estimates
def _moe_layers(moe, n_layers: int) -> int:
    return sum(moe.is_moe_layer(i) for i in range(n_layers))


def param_tensors(cfg: Config, tp: int, ep: int = 1) -> list[Tensor]:
    m, moe = cfg.model, cfg.moe
    d, h, k, e, f, L = m.d_model, m.n_heads, m.n_kv_heads, m.kv_dim, m.d_ff, m.n_layers
    v = padded_vocab(m, tp)
    tpk = tp if k % tp == 0 else 1  # fewer kv heads than tp: replicated
    n_moe = moe_layers(cfg)
    out = [Tensor(L * d * h * e, tp), Tensor(2 * L * d * k * e, tpk), Tensor(L * h * e * d, tp),
           Tensor(3 * (L - n_moe) * d * f, tp), Tensor(2 * L * d), Tensor(v * d, tp, layer=False),
           Tensor(d, layer=False)]
    if n_moe:  # the router (replicated over ep), the routed experts (whole experts over ep), the shared ones
        fx, x = moe.expert_ffn(m), moe.n_experts
        out += [Tensor(n_moe * d * x), Tensor(3 * n_moe * x * d * fx, tp, ep=ep, routed=True)]
        if moe.n_shared:
            out.append(Tensor(3 * n_moe * d * moe.n_shared * fx, tp))
    if not m.tie_embeddings:
        out.append(Tensor(d * v, tp, layer=False))
    return out


def param_count(cfg: Config, tp: int = 1) -> int:
    return sum(t.elems for t in param_tensors(cfg, tp))


def sharded_elems(tensors: list[Tensor], lay: Layout, over_fsdp: bool) -> float:
    g = lay.degrees
    total = 0.0
    for t in tensors:
        n = t.elems / (t.tp * t.ep)
        if over_fsdp and t.embed:
            n /= g["fsdp"]
        if t.layer:
            n /= g["pp"]
        total += n
    return total


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    detail: dict = field(default_factory=dict, compare=False)
    # Bytes counted twice above that the backend's buffer assignment gives once (estimate: the gradients written
    # into the space the residuals free during the backward).
    reused: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations - self.reused

    def to_json(self) -> dict:
        return {"params": int(self.params), "grads": int(self.grads), "optimizer": int(self.optimizer),
                "activations": int(self.activations), "total": int(self.total)}

    def biggest(self) -> list[tuple[str, float]]:
        """The parts, largest first; equal parts in the order above (the error lines print them)."""
        return sorted(((k, v) for k, v in self.to_json().items() if k != "total"), key=lambda kv: -kv[1])


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
    parts = remat_parts(remat)
    if len(parts) > 1:
        counts = {"D_c": 1}
        for part in remat.split("+"):
            for k, v in residual_counts(part, fused_attention).items():
                counts[k] = counts.get(k, 0) + v - (k == "D_c")
        return counts
    (policy, points), = parts
    if policy == "save_dots_attn" and not fused_attention:
        return RESIDUALS["save_dots"]
    if policy in RESIDUALS:
        return RESIDUALS[policy]
    counts = {"D_c": 1}  # the block input, as for every policy that recomputes
    for point in points:
        for k, v in NAMED_POINTS[point].items():
            counts[k] = counts.get(k, 0) + v
    return counts


def tp_degrees(cfg: Config, lay: Layout) -> tuple[int, int]:
    """(tp, tp over the kv heads): kv heads fewer than tp, or not divided by it, are replicated."""
    tp = lay.degrees["tp"]
    return tp, (tp if cfg.model.n_kv_heads % tp == 0 else 1)


def tokens_per_device(cfg: Config, lay: Layout) -> float:
    """Tokens of one microbatch on a device: sequences over dp, fsdp and ep (outside the experts ep is one more
    data axis), each sequence over cp and sp."""
    g = lay.degrees
    return lay.micro_batch / (g["dp"] * g["fsdp"] * g["ep"]) * cfg.data.seq_len / (g["cp"] * g["sp"])


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


def run_estimate(cfg: Config, exe: Execution) -> Memory:
    """The one estimate of a config as it will run: its own layout and schedule, the attention its
    Execution picked. The memory guard and the planner's "as given" row both read this."""
    return estimate(cfg, Layout.of(cfg), attention_kind(exe), exe.moe_gemm or "ragged_dot", backend=exe.backend)


def attention_kind(exe: Execution) -> str:
    """The estimator's attention class: "flash" keeps no [T, S] scores, "reference" does."""
    return "flash" if exe.fused_attention else "reference"


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


def estimate(cfg: Config, lay: Layout, attention_impl: str = "reference", grouped_matmul: str = "ragged_dot",
             backend: str = "gpu") -> Memory:
    """Per-device bytes of `cfg`'s model run as `lay` (the config's own layout fields are ignored). A pipeline
    stage holds its schedule's stash (memory_pipeline). `grouped_matmul`: how the experts' GEMMs run
    (Execution.moe_gemm); XLA's ragged_dot holds more (memory_moe.grouped_matmul_working_bytes).

    `backend`: whose buffer assignment to model. "cpu" (XLA:CPU; tests/test_memory_grid.py's grid): every term
    is added, a pipeline's stash counts twice and an fp8 value takes 4 bytes (its matmuls run on fp32 values).
    "gpu" (XLA:GPU, whose memory_analysis() peak equals the allocator's measured peak: docs/PERFORMANCE.md
    2026-11-27): without gradient accumulation the stack's gradients are written into the space its residuals
    free (`reused`: the smaller of the two counts once; over fsdp, half of it); with it, the accumulator and the
    microbatch's gradients live beside the residuals, so everything adds up; a pipeline stage holds its stash
    once and its per-layer accumulators (the restacked gradients come after the stash is gone). Checked against
    eight measured GPU peaks, each within 10%, and two layouts that ran out of memory (tests/test_memory_gpu_peaks.py)."""
    fp8_value_bytes = 4 if backend == "cpu" else 1
    g, m = lay.degrees, cfg.model
    tensors = param_tensors(cfg, g["tp"], g["ep"])
    p_res = sharded_elems(tensors, lay, lay.zero_stage >= 3)
    p_grad = sharded_elems(tensors, lay, lay.zero_stage >= 2)
    layer_weights = 4 * sum(t.elems / (t.tp * t.ep) for t in tensors if t.layer) / m.n_layers

    params = 4 * p_res
    # Not counted: the sites' compute-dtype (or e4m3) copies the step makes once where the loss starts
    # (precision.cast_sites). They replaced per-layer copies inside the blocks, and on GPUs the peak did not move with
    # them (OLMoE at ep=2, 51.9 GiB before and after; the 8B-shaped fp8 step 51.6 and 52.1 GiB, docs/PERFORMANCE.md).
    if lay.zero_stage >= 3:  # one layer gathered for its forward/backward (the scan gathers per layer)
        params += layer_weights
    if g["pp"] > 1:  # the copy of the stage's layer weights its ops read (memory_pipeline): cast to the compute
        # dtype once a step (ops.chunk_weights); fp8 sites keep per-layer slices of the fp32 master
        copy = 4 if cfg.precision.matmul.startswith("fp8") else DTYPE_BYTES[cfg.precision.compute]
        params += copy * sharded_elems([t for t in tensors if t.layer], lay, lay.zero_stage >= 3)
    # Gradients of the whole stack live at once (the scan's stacked output); a second copy when the
    # microbatch loop accumulates them.
    grads = 4 * p_grad * (2 if lay.grad_accum > 1 and not (backend == "gpu" and g["pp"] > 1) else 1)
    optimizer = optimizer_state_bytes(cfg, tensors, lay)

    kept = layer_activation_bytes(cfg, lay, attention_impl)
    # The layer being differentiated makes its fp8 sites' inputs in the compute dtype before it quantizes them.
    full_set = layer_activation_bytes(cfg, lay, attention_impl, remat="none", quantized_inputs=False)
    c = DTYPE_BYTES[cfg.precision.compute]
    n = tokens_per_device(cfg, lay)
    # Around the stack: the final norm and the stack's input, and the loss's own buffers.
    head = n * m.d_model * (2 * 4 + c)
    if lay.loss == "fused":
        # Over the whole vocabulary: the head's compute-dtype copy (gathered over tp and a ZeRO-3 fsdp), one
        # token chunk's fp32 logits and its dlogits, the fp32 weight gradient, the fp32 dh
        # (pallas_kernels.cross_entropy_sum).
        v = padded_vocab(m, g["tp"])
        head += token_chunk(int(n), v) * v * (4 + c) + m.d_model * v * (c + 4) + n * m.d_model * 4
    else:  # fp32 logits and exp kept for the loss gradient, the label mask
        head += n * padded_vocab(m, g["tp"]) / g["tp"] * (4 + 4 + 1)
    batch_in = 4 * 4 * lay.grad_accum * n  # the four int32 batch fields, all microbatches
    # The layer being differentiated holds about one full set more: its cotangents (remat none) or its
    # recomputed activations (any other policy); under the microbatch scan, also its weights, which the scan's
    # backward slices out of the stack (under ZeRO-3 that is the gathered layer, counted under params).
    working = full_set
    if g["pp"] == 1 and lay.zero_stage < 3:
        working += layer_weights
    if moe_layers(cfg) and grouped_matmul == "ragged_dot":
        working += grouped_matmul_working_bytes(cfg, g, n, c)
    if g["pp"] == 1:  # the scan's stacked residuals of every layer, one microbatch at a time
        stack = kept * m.n_layers
    else:
        # The last chunk's forward and backward are one computation, so XLA fuses the elementwise residuals that
        # a chunk keeping everything would stash into the backward's kernels, and holds about the matmul and
        # attention outputs (the 1.36B config at pp=2, save_dots_attn elsewhere: XLA:GPU's peak 0.14 GiB higher
        # with its 12 layers at remat none, where jax.vjp's residuals would be 1.78 GiB more).
        last_policy = last_chunk_remat(cfg.pipeline.last_chunk_remat, lay.remat)
        last = layer_activation_bytes(cfg, lay, attention_impl,
                                      remat="save_dots_attn" if last_policy == "none" else last_policy)
        stack = stage_activation_bytes(m.n_layers, lay, kept, split_backward_bytes(cfg, lay), last,
                                       stash_copies=2 if backend == "cpu" else 1)
        if cfg.precision.matmul.startswith("fp8"):
            # A chunk runs its layers unrolled (step/pipeline/ops.py), and its op holds every layer's quantized
            # weights and their transposes at once (read from the compiled step: k x about twice the layer's
            # weights at fp32 on the CPU, where the quantized values are fp32). Under `fp8` the chunk's weights
            # are quantized once a step (ops.chunk_weights) and an op makes only the transposes (two pp=2 rows of
            # tests/test_memory_grid.py's shape in fp8, 1f1b and interleaved over fsdp=2: 71.6 and 63.3 MiB
            # compiled, against 75.0 and 70.4 when every op quantized).
            per_op = 1 if cfg.precision.matmul == "fp8" else 2
            working += per_op * chunk_layers(m.n_layers, lay) * layer_weights / 4 * fp8_value_bytes
    activations = stack + working + head + batch_in
    reused = 0.0
    if backend == "gpu" and g["pp"] == 1 and lay.grad_accum == 1:
        # Over fsdp a scanned stack's gradient is reduce-scattered out of an unsharded buffer, and the measured peaks
        # show half the gradient bytes in the freed space: Llama-3-8B at fsdp=2 ZeRO-3 (118.6 GiB measured), and
        # ZeRO-1 and ZeRO-2 beside it running out of 134 GiB where the whole gradient's reuse would have fitted them.
        # Unrolled, each layer's gradient is its own buffer, written where that layer's residuals were: the same
        # model at fsdp=2 peaked 5.8 GiB lower unrolled (112.8 GiB) and 127.2 GiB at 5 sequences a GPU, both within
        # 3.5% of the whole gradient's reuse.
        halved = g["fsdp"] > 1 and cfg.model.scan_layers
        reused = min(grads, activations) / (2 if halved else 1)
    return Memory(params, grads, optimizer, activations, reused=reused,
                  detail=dict(kept_per_layer=kept, layer_full_set=full_set, head=head, in_flight=in_flight(lay),
                              stack=stack, working=working, arguments=4 * p_res + optimizer + batch_in))


def optimizer_state_bytes(cfg: Config, tensors: list[Tensor], lay: Layout) -> float:
    """The optimizer's state on one device (train.optimizer); the update is computed in place of the donated state."""
    mu = DTYPE_BYTES[cfg.train.adam_mu_dtype]  # the first moment: fp32, or bf16 with train.adam_mu_dtype
    p_opt = sharded_elems(tensors, lay, lay.zero_stage >= 1)
    if cfg.train.optimizer == "lion":  # the momentum alone
        return mu * p_opt
    if cfg.train.optimizer == "adafactor":  # a row and a column per matrix: negligible against the parameters
        return 0.0
    if cfg.train.optimizer == "muon":  # a momentum everywhere, Adam's fp32 second moment outside the blocks
        return mu * p_opt + 4 * sharded_elems([t for t in tensors if not t.layer], lay, lay.zero_stage >= 1)
    return (mu + 4) * p_opt  # AdamW: m and an fp32 v
