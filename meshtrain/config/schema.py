"""The configuration's schema: one frozen dataclass per section, the constants they name, and values
derived from them (padded vocabulary, fp8 exclusions, the profiled step range, the resolved mesh).

Pure Python: nothing here validates or loads; validation.py checks these values, loading.py fills them.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from meshtrain.config.pipeline import Kind

MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")

# Names of the remat save points the model marks with checkpoint_name (model/transformer.py, model/layers.py;
# attn_in and mlp_in are the two norms' outputs, the inputs of the projections; the routed experts' in
# parallel/expert.py: the tokens as the exchange delivers them, the gate and up GEMMs' outputs, the down GEMM's output).
CHECKPOINT_POINTS = ("attn_in", "qkv", "attn_out", "attn_proj", "mlp_in", "mlp_hidden", "mlp_out", "moe_in", "moe_hidden",
                     "moe_out")
# train.remat: one of these, or names: followed by some of CHECKPOINT_POINTS, or several joined by '+' (model/remat.py).
REMAT_FIXED = ("none", "full", "save_dots", "save_dots_attn", "save_attn")


def remat_parts(policy: str) -> list[tuple[str, tuple[str, ...]]]:
    """train.remat taken apart, once for all its readers (validation, model/remat.py, the memory and time
    estimates): each '+'-joined part as (a policy of REMAT_FIXED, ()) or ("names", the points of names:a,b)."""
    return [("names", tuple(part[len("names:"):].split(","))) if part.startswith("names:") else (part, ())
            for part in policy.split("+")]


# Every named matmul site: the precision policy maps each to a recipe (meshtrain/precision.py), and
# precision.fp8_exclude patterns must match some of them. The embedding is a gather and the MoE router
# runs in fp32 outside the policy, so neither is a site.
MATMUL_SITES = (
    "attn.wq", "attn.wk", "attn.wv", "attn.wo",  # model/transformer.py Attention
    "mlp.w_gate", "mlp.w_up", "mlp.w_down",  # model/layers.py SwiGLU: the dense FFN, MoE shared experts
    "moe.w_gate", "moe.w_up", "moe.w_down",  # parallel/expert.py: the routed experts' grouped GEMMs
    "lm_head",  # model/loss.py, inference.py: the output projection
)
# precision.fp8_exclude's default: the head, whose rounding reaches every logit, and the expert GEMMs,
# which have no fp8 recipe yet (they run in the compute dtype whatever the recipe says).
FP8_EXCLUDE_DEFAULT = ("lm_head", "moe.*")
# run.tracker's names: where metrics go besides metrics.jsonl (meshtrain/tracking.py).
TRACKERS = ("tensorboard", "wandb")


@dataclass(frozen=True)
class MeshConfig:
    """Degrees of the 7 mesh axes, outermost (slowest links) first. One degree may be -1: the rest."""

    pp: int = 1  # pipeline stages (layers split into consecutive stages)
    dp: int = 1  # data parallel: batch split, parameters replicated
    fsdp: int = -1  # fully sharded data parallel: batch split, train.zero_stage says what else (-1: the rest)
    ep: int = 1  # expert parallel: MoE experts split
    cp: int = 1  # context parallel: sequence split, attention by ring (parallel.cp_impl)
    sp: int = 1  # sequence parallel (Ulysses): sequence split, heads all-to-all around attention
    tp: int = 1  # tensor parallel: heads, ffn hidden and vocab split (Megatron)


@dataclass(frozen=True)
class ParallelConfig:
    """How the parallel axes run: their collectives and the layouts they move data in."""

    sequence_parallel: bool = False  # Megatron SP: norm/residual activations sharded on seq over tp
    # GPU: XLA combines fsdp's all-gathers and reduce-scatters into collectives of up to this many MiB
    # (fewer, larger transfers, each easier to hide); 0 keeps XLA's own threshold. meshtrain/xla_flags.py.
    fsdp_combine_mib: int = 128
    # How tensor parallelism's collectives meet the matmuls beside them. none: GSPMD's collectives, the
    # latency-hiding scheduler overlaps what it can; windowed_einsum: XLA's own collective matmul (GPU flags,
    # meshtrain/xla_flags.py); collective_matmul: meshtrain's shard_map ring (parallel/tensor.py),
    # which needs parallel.sequence_parallel, cp = sp = 1 and a bf16/fp16 matmul recipe. No effect with tp = 1.
    tp_overlap: Literal["none", "windowed_einsum", "collective_matmul"] = "none"
    cp_impl: Literal["ring", "allgather"] = "ring"  # context parallelism: K/V round a ring, or all-gathered
    cp_layout: Literal["zigzag", "contiguous"] = "zigzag"  # which sequence chunks a cp rank holds


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"  # fills the shape fields below; explicit fields override it
    n_layers: int = 2  # decoder blocks
    d_model: int = 128  # hidden size
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention; n_heads must be a multiple)
    head_dim: int = 0  # 0: d_model // n_heads
    d_ff: int = 352  # SwiGLU hidden width
    vocab_size: int = 256  # token ids 0..vocab_size-1 (256: bytes)
    tie_embeddings: bool = False  # the head reuses the embedding table
    rope_theta: float = 10000.0  # RoPE base wavelength
    # Llama-3.1 RoPE scaling (rope_type "llama3"): long wavelengths slowed by rope_factor, short kept,
    # the band between smoothed; the wavelength bounds are rope_original_max_len / the two freq factors.
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0  # llama3 RoPE scaling: how much long wavelengths are slowed
    rope_low_freq_factor: float = 1.0  # llama3 RoPE: long-wavelength bound = rope_original_max_len / this
    rope_high_freq_factor: float = 4.0  # llama3 RoPE: short-wavelength bound = rope_original_max_len / this
    rope_original_max_len: int = 8192  # llama3 RoPE scaling: the context length the model was pretrained at
    norm_eps: float = 1e-6  # RMSNorm epsilon
    # all_heads: one RMSNorm over each token's whole q projection (all heads together) and one over its k,
    # before RoPE (OLMoE); none: q and k go to RoPE as projected (Llama, Mixtral).
    qk_norm: Literal["none", "all_heads"] = "none"
    init_std: float = 0.02  # std of the normal initialization of a fresh model
    attention: Literal["auto", "reference", "cudnn", "pallas"] = "auto"  # auto: cudnn on GPUs (bf16/fp16)
    # Which flash-attention kernels the Pallas path runs (pallas_kernels.flash_attention's backend): auto is
    # Mosaic GPU on Hopper and Triton elsewhere. Mosaic compiles each call site at the first step (~6 s per
    # layer of an unrolled stack); triton compiles faster, and its attention takes 1.06-1.45x as long
    # (docs/PERFORMANCE.md).
    attention_kernel: Literal["auto", "mosaic", "triton"] = "auto"
    norm: Literal["reference", "pallas"] = "reference"  # RMSNorm: jnp, or the fused kernel (Triton: the triton extra)
    loss: Literal["reference", "fused"] = "reference"  # cross-entropy: jnp on full logits, or fused with the head
    # The embedding table's gradient (model/embedding.py): scatter (autodiff, atomics in the compute dtype),
    # sorted_segment_sum (sort the ids, sum runs in fp32) or onehot (one GEMM; small vocabularies only).
    embedding_grad: Literal["scatter", "sorted_segment_sum", "onehot"] = "sorted_segment_sum"
    scan_layers: bool = True  # one scanned block (fast compile) or an unrolled stack

    @property
    def kv_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (model/moe.py); n_experts=0 keeps every FFN dense."""

    n_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    top_k: int = 2  # experts each token is sent to
    d_ff_expert: int = 0  # hidden width of one expert; 0: model.d_ff
    n_shared: int = 0  # shared experts every token also passes through (one SwiGLU n_shared x as wide)
    every: int = 1  # an MoE FFN in layers every-1, 2*every-1, ...; dense SwiGLU in the others
    router: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: top-k scores normalized (DeepSeek-V3)
    # The weights of a token's top-k experts: scores (the router's softmax probabilities or sigmoid scores as they
    # are: Switch, OLMoE) or normalized to sum to 1 (Mixtral, DeepSeek-V3); auto: scores for softmax, normalized
    # for sigmoid.
    top_k_weights: Literal["auto", "scores", "normalized"] = "auto"
    capacity_factor: float = 0.0  # 0: dropless; > 0: GShard capacity per expert, overflow skips via the residual
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch/GShard form), per MoE layer
    z_loss_coef: float = 0.001  # router z-loss (ST-MoE), per MoE layer
    # The dropless exchange over ep (parallel/expert.py): allgather (tokens in, partial outputs reduce-scattered
    # out) or the padded all-to-all; auto: allgather (fewer bytes: meshtrain/resolve.py)
    dispatch: Literal["auto", "allgather", "padded"] = "auto"
    # The experts' grouped GEMMs; auto: pallas (the gmm kernel, Triton: the triton extra) on GPUs where its packages
    # are, else ragged_dot (XLA's GPU ragged_dot is a dense dot over all experts).
    grouped_matmul: Literal["auto", "ragged_dot", "pallas"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0

    def expert_ffn(self, model: "ModelConfig") -> int:
        return self.d_ff_expert or model.d_ff

    def is_moe_layer(self, i: int) -> bool:
        return self.enabled and (i + 1) % self.every == 0

    @property
    def normalize_top_k(self) -> bool:
        return self.top_k_weights == "normalized" or (self.top_k_weights == "auto" and self.router == "sigmoid")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps to train (a resumed run continues to it)
    schedule_steps: int = 0  # 0: same as steps. Set it so that a run stopped early keeps its schedule.
    global_batch: int = 16  # sequences per optimizer step, over all devices and microbatches
    grad_accum: int = 1  # microbatches per step, scanned inside the jitted step
    zero_stage: int = 1  # what fsdp shards: 1 optimizer state, 2 + gradients, 3 + parameters
    remat: str = "none"  # none | full | save_dots | save_dots_attn | save_attn | names:<point>,... | p+q
    seed: int = 0  # initialization and data order; RNG derives from (seed, step)
    # optax's adamw; adafactor (factored second moment, no first); lion (sign updates: usually a 3-10x
    # smaller lr); muon (orthogonalized momentum on the blocks' matrices, AdamW on the rest). step/optim.py.
    optimizer: Literal["adamw", "adafactor", "lion", "muon"] = "adamw"
    lr: float = 3e-3  # peak learning rate, reached at the end of the warmup
    # After the linear warmup: cosine or linear decay to lr*min_lr_ratio at the schedule's end, constant, or
    # wsd (warmup-stable-decay: lr, then a linear decay over the last train.decay_fraction). step/lr_schedules.py.
    lr_schedule: Literal["cosine", "wsd", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1  # the rate at the schedule's end, as a fraction of lr
    warmup_steps: int = 10  # linear warmup from 0 to lr
    decay_fraction: float = 0.2  # lr_schedule=wsd: the share of the schedule's steps spent decaying
    weight_decay: float = 0.1  # decoupled weight decay, scaled by the rate as in AdamW; never on norm scales
    b1: float = 0.9  # Adam first-moment decay (lion: its update's interpolation; muon: its AdamW part)
    b2: float = 0.95  # Adam second-moment decay (lion: its momentum's decay; muon: its AdamW part)
    # The first moment (adamw, lion, muon) in bfloat16 halves its memory and traffic (2 bytes a parameter less
    # to keep, read and write); Adam's second moment stays fp32, whose range and small updates bf16 would lose.
    adam_mu_dtype: Literal["float32", "bfloat16"] = "float32"
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    log_every: int = 10  # steps between printed and logged metrics
    max_nonfinite: int = 5  # stop after this many consecutive skipped (non-finite) steps (fp16: at loss scale 1)

    @property
    def total_schedule_steps(self) -> int:
        return self.schedule_steps or self.steps


@dataclass(frozen=True)
class DataConfig:
    # synthetic: the built-in learnable corpus; file: a token file (data.path); hf: text documents (data.path or
    # data.mixture) tokenized on the fly by data.tokenizer (meshtrain/documents)
    source: Literal["synthetic", "file", "hf"] = "synthetic"
    path: str = ""  # file: token file (.bin raw or .npy); hf: saved dataset dir, parquet/JSONL file, dir or glob
    dtype: Literal["uint16", "uint32"] = "uint16"  # element type of a raw .bin token file
    seq_len: int = 64  # tokens per sequence
    document_mask: bool = False  # split packed rows after data.eos_id: positions restart, no cross-document attention
    eos_id: int = -1  # end-of-document token id (needed by document_mask, and by source=hf between documents)
    eval_fraction: float = 0.0  # hold out this last fraction of the file's windows (hf: of each source's documents)
    eval_path: str = ""  # separate eval data (file: a token file of the same dtype; hf: a text source); wins over eval_fraction
    tokenizer: str = ""  # source=hf: a Hugging Face tokenizer.json, or a directory holding one
    text_column: str = "text"  # source=hf: the column (JSON key) holding each document's text
    # source=hf: several sources instead of data.path, "PATH:WEIGHT,PATH:WEIGHT" (weights relative: the share of
    # rows each source fills)
    mixture: str = ""
    cache_dir: str = ""  # source=hf: Arrow copies and per-document token counts; empty: <run.dir>/data_cache
    prefetch: int = 2  # training batches built ahead on a background thread (meshtrain/prefetch.py); 0: in the loop


@dataclass(frozen=True)
class PrecisionConfig:
    compute: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # activations and matmuls (float16: dynamic loss scaling)
    params: Literal["float32"] = "float32"  # master weights; optimizer state follows them
    # Dynamic loss scaling, used with float16 compute only (bf16 has fp32's exponent range).
    loss_scale_init: float = 32768.0
    loss_scale_growth_interval: int = 1000  # finite steps in a row before the scale doubles
    # Dense matmul recipe (meshtrain/precision.py): bf16 (the compute dtype), fp8 (per-tensor current
    # scaling), fp8_delayed (scales from an amax history), fp8_blockwise (1x128 / 128x128 tiles).
    matmul: Literal["bf16", "fp8", "fp8_delayed", "fp8_blockwise"] = "bf16"
    fp8_amax_history: int = 16  # fp8_delayed: steps of amax history the scale is taken from
    fp8_exclude: str = ",".join(FP8_EXCLUDE_DEFAULT)  # comma-separated MATMUL_SITES patterns (fnmatch) kept plain
    # fp8 / fp8_delayed: how an activation or gradient becomes fp8 in both layouts its GEMMs read (the layer sites'
    # weights are quantized once a step by XLA, fp8_delayed's in pipeline stages excepted). xla: jnp casts that XLA
    # fuses into their producers; triton: one pass of the kernel (pallas_kernels/fp8_cast.py; on a CPU, Triton's
    # interpreter): faster alone, 1.8% faster in an unrolled step without recomputation, slower in a scanned
    # save_dots one (docs/PERFORMANCE.md).
    fp8_cast: Literal["xla", "triton"] = "xla"


@dataclass(frozen=True)
class PipelineConfig:
    """How mesh.pp > 1 runs: the schedule (docs/PIPELINE.md) over train.grad_accum microbatches."""

    schedule: Kind = "1f1b"  # afab | 1f1b | interleaved | zb_h1 | dualpipe_v
    virtual_stages: int = 1  # model chunks per stage: interleaved any v >= 1, dualpipe_v 2, others 1
    # The last chunk runs its forward and backward in one op, so nothing it keeps waits in the stash: its
    # recomputation trades time against that op's own activations only. auto: none where train.remat keeps every
    # matmul output (none, save_dots, save_dots_attn, or a union with one), else train.remat; or any train.remat policy.
    last_chunk_remat: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <run.dir>/checkpoints
    every: int = 0  # steps between saves; 0: none during the run (restore still happens if dir has one)
    final: bool = True  # also save after the last step and when SIGTERM/Ctrl-C stops the run
    keep: int = 3  # keep the last N committed checkpoints
    async_save: bool = True  # write checkpoints in the background while training goes on
    init_from: str = ""  # hf:DIR starts a fresh run from a Hugging Face Llama, OLMoE or Mixtral directory (its shape too)
    timeout_s: int = 600  # a checkpoint write that takes longer fails (and stops the run) instead of hanging
    allow_data_change: bool = False  # resume even though train.seed/global_batch or the data's fields (source, path, ...) changed


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # steps between evaluations on held-out data (and after the last step); 0: never
    batches: int = 4  # global batches per evaluation (the same ones every time)


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start. Empty values are read from the environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID) or detected (SLURM); a single process needs none."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # processes in the job (0: from the environment)
    process_id: int = -1  # this process's index (-1: from the environment)
    local_device_ids: str = ""  # e.g. "0,1,2,3"; empty: all local devices
    cpu_collectives: Literal["gloo", "mpi", "none"] = "gloo"  # how CPU devices talk across processes


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"  # metrics.jsonl, checkpoints/ (by default) and traces go here
    progress: bool = True  # live progress bar on a terminal
    cpu_devices: int = 8  # simulated devices when only a CPU is found (set before jax starts)
    memory_guard: bool = True  # refuse a config whose memory estimate exceeds the device (host on CPU)
    # Share of each GPU's memory that jax's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION, set before
    # jax starts unless the environment sets it); 0 keeps jax's 0.75. A process alone on its GPUs can
    # take 0.9-0.95 for larger batches.
    gpu_memory_fraction: float = 0.0
    # Where every logged metric also goes (meshtrain/tracking.py), a comma list, empty for none: tensorboard
    # (events in <run.dir>/tensorboard), wandb (Weights & Biases; WANDB_MODE=offline logs locally only).
    tracker: str = ""
    wandb_project: str = ""  # empty: WANDB_PROJECT, else "meshtrain"
    wandb_name: str = ""  # the W&B run's name; empty: WANDB_NAME, else run.dir's last part
    wandb_dir: str = ""  # W&B writes its files under <this>/wandb; empty: WANDB_DIR, else run.dir
    # "START:END": trace the steps that take the state's step counter from START to END into
    # <run.dir>/profile (docs/PROFILE.md); empty for none.
    profile_steps: str = ""


@dataclass(frozen=True)
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.run.dir) / "checkpoints")


# ------------------------------------------------------------------------------------ derived values


def padded_vocab(model: ModelConfig, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp so the logits shard evenly; pads are masked out."""
    return -(-model.vocab_size // tp) * tp


def fp8_exclude_patterns(pc: PrecisionConfig) -> tuple[str, ...]:
    return tuple(p.strip() for p in pc.fp8_exclude.split(",") if p.strip())


def runs_plain(pc: PrecisionConfig, site: str) -> bool:
    """Whether matmul `site` runs the bf16 recipe: precision.matmul is bf16 or a fp8_exclude pattern keeps it
    plain (precision.Precision.recipe decides the same for the model)."""
    return pc.matmul == "bf16" or any(fnmatch.fnmatchcase(site, p) for p in fp8_exclude_patterns(pc))


def profile_range(text: str) -> tuple[int, int] | None:
    """run.profile_steps "START:END" -> (START, END); None when empty or malformed (validate() says which)."""
    start, sep, end = text.strip().partition(":")
    try:
        return (int(start), int(end)) if sep else None
    except ValueError:
        return None


def tracker_names(run: RunConfig) -> tuple[str, ...]:
    """run.tracker "tensorboard, wandb" -> ("tensorboard", "wandb"); validate() checks the names against TRACKERS."""
    return tuple(dict.fromkeys(t.strip() for t in run.tracker.split(",") if t.strip()))


def with_mesh(cfg: Config, degrees: dict[str, int]) -> Config:
    """The config with the -1 degree filled in (what gets saved beside a checkpoint)."""
    return replace(cfg, mesh=replace(cfg.mesh, **degrees))
