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
      (memory_layer.RESIDUALS, and memory_moe.EXPERT_RESIDUALS for an MoE FFN, checked against jax's own
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

from dataclasses import dataclass, field

from meshtrain.config import Config, padded_vocab
from meshtrain.config.pipeline import last_chunk_remat
from meshtrain.planning.layout import DTYPE_BYTES, Layout, moe_layers, tokens_per_device
from meshtrain.planning.memory_layer import layer_activation_bytes, split_backward_bytes
from meshtrain.planning.memory_moe import grouped_matmul_working_bytes
from meshtrain.planning.memory_pipeline import chunk_layers, in_flight, stage_activation_bytes
from meshtrain.resolve import Execution
from pallas_kernels.cross_entropy_sum import token_chunk


@dataclass(frozen=True)
class Tensor:
    """A parameter tensor by the mesh axes that may shard it."""

    elems: int
    tp: int = 1  # divisor from tensor parallelism
    embed: bool = True  # ZeRO-3 shards it over fsdp (sharding.py says along which dim)
    layer: bool = True  # in the layer stack (pp shards it)
    ep: int = 1  # divisor from expert parallelism
    routed: bool = False  # a routed expert's weights (memory_moe counts what their region keeps)


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


def run_estimate(cfg: Config, exe: Execution) -> Memory:
    """The one estimate of a config as it will run: its own layout and schedule, the attention its
    Execution picked. The memory guard and the planner's "as given" row both read this."""
    return estimate(cfg, Layout.of(cfg), attention_kind(exe), exe.moe_gemm or "ragged_dot", backend=exe.backend)


def attention_kind(exe: Execution) -> str:
    """The estimator's attention class: "flash" keeps no [T, S] scores, "reference" does."""
    return "flash" if exe.fused_attention else "reference"


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
