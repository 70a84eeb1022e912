"""Typed, frozen configuration: YAML file, then dotted `section.key=value` overrides, then validate().

The config is the user's whole interface, so every mistake is reported as a `ConfigError` that names
the field, the value and the fix, and `validate()` reports every problem at once instead of the first.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import fnmatch
import math
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")


class ConfigError(ValueError):
    """A mistake in user configuration. `problems` holds one line per problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


# --------------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class MeshConfig:
    """Degrees of the 7 mesh axes, outermost (slowest links) first. One degree may be -1: the rest."""

    pp: int = 1
    dp: int = 1
    fsdp: int = -1
    ep: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    sequence_parallel: bool = False  # Megatron SP: norm/residual activations sharded on seq over tp


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"  # fills the shape fields below; explicit fields override it
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // n_heads
    d_ff: int = 352
    vocab_size: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    # Llama-3.1 RoPE scaling (rope_type "llama3"): long wavelengths slowed by rope_factor, short kept,
    # the band between smoothed; the wavelength bounds are rope_original_max_len / the two freq factors.
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-6
    init_std: float = 0.02
    attention: Literal["auto", "reference", "cudnn", "pallas"] = "auto"  # auto: cudnn on GPUs (bf16/fp16)
    cp_impl: Literal["ring", "allgather"] = "ring"  # context parallelism: K/V round a ring, or all-gathered
    cp_layout: Literal["zigzag", "contiguous"] = "zigzag"  # which sequence chunks a cp rank holds
    norm: Literal["reference", "pallas"] = "reference"
    loss: Literal["reference", "fused"] = "reference"
    scan_layers: bool = True

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
    capacity_factor: float = 0.0  # 0: dropless; > 0: GShard capacity per expert, overflow skips via the residual
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch/GShard form), per MoE layer
    z_loss_coef: float = 0.001  # router z-loss (ST-MoE), per MoE layer
    dispatch: Literal["auto", "ragged", "padded"] = "auto"  # dropless all-to-all; auto: ragged on GPUs
    # The experts' grouped GEMMs; auto: pallas on GPUs (XLA's GPU ragged_dot is a dense dot over all experts).
    grouped_matmul: Literal["auto", "ragged_dot", "pallas"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0

    def expert_ffn(self, model: "ModelConfig") -> int:
        return self.d_ff_expert or model.d_ff

    def is_moe_layer(self, i: int) -> bool:
        return self.enabled and (i + 1) % self.every == 0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    schedule_steps: int = 0  # 0: same as steps. Set it so that a run stopped early keeps its schedule.
    global_batch: int = 16  # sequences per optimizer step, over all devices and microbatches
    grad_accum: int = 1  # microbatches per step, scanned inside the jitted step
    zero_stage: int = 1  # what fsdp shards: 1 optimizer state, 2 + gradients, 3 + parameters
    remat: str = "none"  # none | full | save_dots | save_attn | names:<point>,<point>...
    seed: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    log_every: int = 10
    max_nonfinite: int = 5  # stop after this many consecutive skipped (non-finite) steps

    @property
    def total_schedule_steps(self) -> int:
        return self.schedule_steps or self.steps


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "file"] = "synthetic"
    path: str = ""  # token file (.bin raw or .npy) for source=file
    dtype: Literal["uint16", "uint32"] = "uint16"  # element type of a raw .bin token file
    seq_len: int = 64
    document_mask: bool = False  # split packed rows after data.eos_id: positions restart, no cross-document attention
    eos_id: int = -1  # end-of-document token id (needed by document_mask)
    eval_fraction: float = 0.0  # source=file: hold out this last fraction of the file's windows for eval
    eval_path: str = ""  # a separate token file for eval (same dtype); wins over eval_fraction
    prefetch: int = 2  # training batches built ahead on a background thread (meshtrain/prefetch.py); 0: in the loop


@dataclass(frozen=True)
class PrecisionConfig:
    compute: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    params: Literal["float32"] = "float32"  # master weights; optimizer state follows them
    # Dynamic loss scaling, used with float16 compute only (bf16 has fp32's exponent range).
    loss_scale_init: float = 32768.0
    loss_scale_growth_interval: int = 1000  # finite steps in a row before the scale doubles
    # Dense matmul recipe (meshtrain/precision.py): bf16 (the compute dtype), fp8 (per-tensor current
    # scaling), fp8_delayed (scales from an amax history), fp8_blockwise (1x128 / 128x128 tiles).
    matmul: Literal["bf16", "fp8", "fp8_delayed", "fp8_blockwise"] = "bf16"
    fp8_amax_history: int = 16  # fp8_delayed: steps of amax history the scale is taken from
    fp8_exclude: str = "embedding,lm_head,*router"  # comma-separated site patterns (fnmatch) kept plain


@dataclass(frozen=True)
class PipelineConfig:
    """How mesh.pp > 1 runs: the schedule (docs/PIPELINE.md) over train.grad_accum microbatches."""

    schedule: Literal["afab", "1f1b", "interleaved", "zb_h1", "dualpipe_v"] = "1f1b"
    virtual_stages: int = 1  # model chunks per stage: interleaved any v >= 1, dualpipe_v 2, others 1


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <run.dir>/checkpoints
    every: int = 0  # steps between saves; 0 disables saving (restore still happens if dir has one)
    keep: int = 3  # keep the last N committed checkpoints
    async_save: bool = True
    init_from: str = ""  # hf:DIR starts a fresh run from a Hugging Face Llama directory (its shape too)


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # steps between evaluations on held-out data (and after the last step); 0: never
    batches: int = 4  # global batches per evaluation (the same ones every time)


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start. Empty values are read from the environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID) or detected (SLURM); a single process needs none."""

    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    local_device_ids: str = ""  # e.g. "0,1,2,3"; empty: all local devices
    cpu_collectives: Literal["gloo", "mpi", "none"] = "gloo"  # how CPU devices talk across processes


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    progress: bool = True  # live progress bar on a terminal
    cpu_devices: int = 8  # simulated devices when only a CPU is found (set before jax starts)
    memory_guard: bool = True  # refuse a config whose memory estimate exceeds the device (host on CPU)
    tensorboard: bool = False  # also write every metric as TensorBoard events to <run.dir>/tensorboard
    # "START:END": trace the steps that take the state's step counter from START to END into
    # <run.dir>/profile (docs/PROFILE.md); empty for none.
    profile_steps: str = ""


@dataclass(frozen=True)
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
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


# ------------------------------------------------------------------------------------ model presets

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


# --------------------------------------------------------------------------------- loading/overrides


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _section_types().items() for f in fields(cls)]


def _unknown(key: str, candidates: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(candidates)}"
    return f"unknown config key '{where}': {hint}"


def _coerce(key: str, raw: Any, tp: Any) -> Any:
    """Turn a YAML/CLI value into the field's declared type, or raise ConfigError naming the key."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        value = str(raw) if not isinstance(raw, str) else raw
        if value not in choices:
            raise ConfigError(f"{key}={raw!r}: must be one of {', '.join(map(str, choices))}")
        return value
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: must be true or false")
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r}: must be an integer")
        try:
            f = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r}: must be an integer") from None
        if not f.is_integer():
            raise ConfigError(f"{key}={raw!r}: must be an integer")
        return int(f)
    if tp is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r}: must be a number") from None
    if tp is str:
        return "" if raw is None else str(raw)
    raise TypeError(f"unsupported config field type {tp} for {key}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _parse_cli_value(text: str) -> Any:
    # YAML parsing gives `1e-3` -> float, `true` -> bool, `[1,2]` -> list, and leaves words as str.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def build_config(file_values: dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- model preset <- YAML mapping <- `section.key=value` overrides. Collects all errors."""
    flat: dict[str, Any] = {}
    cli_text: dict[str, str] = {}  # override text as typed: string fields take it verbatim
    problems: list[str] = []
    sections = _section_types()
    for section, values in (file_values or {}).items():
        if section not in sections:
            problems.append(_unknown(str(section), list(sections), str(section)))
            continue
        if values is None:  # a section whose keys are all commented out
            continue
        if not isinstance(values, dict):
            problems.append(f"config section '{section}' must be a mapping of key: value, got {values!r}")
            continue
        for k, v in values.items():
            flat[f"{section}.{k}"] = v
    for item in overrides or []:
        if "=" not in item:
            problems.append(f"override '{item}' must look like section.key=value (e.g. train.steps=10)")
            continue
        k, v = item.split("=", 1)
        flat[k.strip()] = _parse_cli_value(v)
        cli_text[k.strip()] = v

    # The preset first, so that explicit model fields override it.
    preset = flat.get("model.preset", ModelConfig.preset)
    model_values: dict[str, Any] = {}
    if str(preset) not in PRESETS:
        problems.append(f"model.preset={preset!r}: unknown preset; choose one of {', '.join(PRESETS)}")
    else:
        model_values.update(PRESETS[str(preset)])

    per_section: dict[str, dict[str, Any]] = {s: {} for s in sections}
    per_section["moe"].update(model_values.pop("moe", {}))
    per_section["model"].update(model_values)
    valid = all_keys()
    for key, raw in flat.items():
        section, _, name = key.partition(".")
        if key not in valid:
            problems.append(_unknown(key, valid, key))
            continue
        tp = _field_types(sections[section])[name]
        if tp is str and key in cli_text:
            raw = cli_text[key]  # YAML would turn `run.dir=010` into 8 and `host=10:30` into 630
        try:
            per_section[section][name] = _coerce(key, raw, tp)
        except ConfigError as e:
            problems.extend(e.problems)
    # A Hugging Face model decides the shape: its config.json goes over the preset (hf/config.py).
    if str(per_section["checkpoint"].get("init_from", "")).startswith("hf:"):
        from meshtrain.hf.config import apply_hf_values, hf_dir
        explicit = {k[6:]: per_section["model"][k[6:]] for k in flat
                    if k.startswith("model.") and k in valid and k[6:] in per_section["model"]}
        problems.extend(apply_hf_values(per_section["model"], explicit, hf_dir(per_section["checkpoint"]["init_from"])))
    # Read before jax starts (run.py simulates the CPU devices), so it cannot wait for validate().
    if per_section["run"].get("cpu_devices", RunConfig.cpu_devices) < 1:
        problems.append(f"run.cpu_devices={per_section['run']['cpu_devices']}: must be >= 1")
    if problems:
        raise ConfigError(problems)
    return Config(**{s: sections[s](**per_section[s]) for s in sections})


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    file_values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file; configs/ holds the shipped ones")
        try:
            file_values = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            detail = " ".join(str(e).split())  # one line per problem, as everywhere
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({detail})") from None
        if not isinstance(file_values, dict):
            raise ConfigError(f"--config {str(path)!r}: top level must be a mapping of sections")
    return build_config(file_values, overrides)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def help_text(machine_defaults: list[str] | None = None, why: str = "") -> str:
    """Every key, its type and the default that applies: `machine_defaults` (overrides such as the CPU
    run's) replace the dataclass default, which is then named beside it with `why`."""
    applied = build_config({}, machine_defaults or [])
    lines = []
    for section, cls in _section_types().items():
        types_ = _field_types(cls)
        for f in fields(cls):
            default, here = f.default, getattr(getattr(applied, section), f.name)
            tp = types_[f.name]
            kind = "|".join(map(str, get_args(tp))) if get_origin(tp) is Literal else tp.__name__
            note = f" ({why}; {default!r} otherwise)" if here != default else ""
            lines.append(f"  {section + '.' + f.name:<30} {kind:<24} default {here!r}{note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- validation


def resolve_mesh(mesh: MeshConfig, n_devices: int) -> tuple[dict[str, int], list[str]]:
    """Fill the one -1 degree; return the degrees and any problems."""
    degrees = {a: getattr(mesh, a) for a in MESH_AXES}
    problems = []
    free = [a for a, d in degrees.items() if d == -1]
    bad = [a for a, d in degrees.items() if d == 0 or d < -1]
    for a in bad:
        problems.append(f"mesh.{a}={degrees[a]}: a degree must be >= 1 (or -1 for 'the rest')")
    if len(free) > 1:
        problems.append(f"mesh: only one degree may be -1, got {', '.join('mesh.' + a for a in free)}; "
                        f"set all but one explicitly")
    if bad or len(free) > 1:
        return degrees, problems
    fixed = math.prod(d for d in degrees.values() if d != -1)
    if free:
        if n_devices % fixed:
            problems.append(f"mesh.{free[0]}=-1: the other degrees multiply to {fixed}, which does not divide "
                            f"the {n_devices} devices; change them so their product divides {n_devices}")
        else:
            degrees[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        shape = " x ".join(f"mesh.{a}={d}" for a, d in degrees.items() if d != 1) or "mesh: all degrees 1"
        problems.append(f"{shape} uses {fixed} devices but {n_devices} are visible; make the product "
                        f"{n_devices}, or set one degree (e.g. mesh.fsdp) to -1")
    return degrees, problems


def padded_vocab(model: ModelConfig, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp so the logits shard evenly; pads are masked out."""
    return -(-model.vocab_size // tp) * tp


REMAT_FIXED = ("none", "full", "save_dots", "save_attn")


def validate(cfg: Config, n_devices: int) -> dict[str, int]:
    """Check the config against itself and the device count; raise one ConfigError listing every problem.

    Returns the resolved mesh degrees. Runs before any device work.
    """
    m, t, d = cfg.model, cfg.train, cfg.data
    degrees, problems = resolve_mesh(cfg.mesh, n_devices)
    ok_mesh = not problems
    tp = degrees["tp"] if ok_mesh else max(cfg.mesh.tp, 1)

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    n_mesh_problems = len(problems)
    for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        need(getattr(m, name) >= 1, f"model.{name}={getattr(m, name)}: must be >= 1")
    for name in ("steps", "global_batch", "grad_accum", "log_every"):
        need(getattr(t, name) >= 1, f"train.{name}={getattr(t, name)}: must be >= 1")
    need(d.seq_len >= 1, f"data.seq_len={d.seq_len}: must be >= 1")
    need(m.head_dim >= 0, f"model.head_dim={m.head_dim}: must be >= 1, or 0 for d_model // n_heads")
    if len(problems) > n_mesh_problems:  # sizes below 1 would divide by zero in the checks that follow
        raise ConfigError(problems)

    # Attention heads over tp (Megatron): query heads split; kv heads split too, or replicated when fewer.
    need(m.n_heads % m.n_kv_heads == 0, f"model.n_kv_heads={m.n_kv_heads}: must divide model.n_heads="
                                        f"{m.n_heads} (grouped-query attention)")
    need(m.head_dim > 0 or m.d_model % m.n_heads == 0,
         f"model.d_model={m.d_model}: must be divisible by model.n_heads={m.n_heads}, or set model.head_dim")
    need(m.n_heads % tp == 0, f"model.n_heads={m.n_heads}: must be divisible by mesh.tp={tp}; "
                              f"choose a tp that divides {m.n_heads}")
    need(m.n_kv_heads < tp or m.n_kv_heads % tp == 0,
         f"model.n_kv_heads={m.n_kv_heads}: with mesh.tp={tp} it must be divisible by tp (or fewer than tp, "
         f"then replicated); choose tp dividing {m.n_kv_heads}")
    need(m.attention != "pallas" or m.n_kv_heads >= tp or tp % m.n_kv_heads == 0,
         f"model.attention=pallas with model.n_kv_heads={m.n_kv_heads} < mesh.tp={tp}: tp must be a multiple of "
         f"n_kv_heads so that each tp shard's query heads share one kv head")
    need(m.d_ff % tp == 0, f"model.d_ff={m.d_ff}: must be divisible by mesh.tp={tp}")
    if ok_mesh:
        fsdp = degrees["fsdp"]
        need(m.d_model % fsdp == 0, f"model.d_model={m.d_model}: must be divisible by mesh.fsdp={fsdp} "
                                    f"(fsdp shards the embed dimension)")
        batch_split = degrees["dp"] * fsdp * degrees["ep"] * t.grad_accum  # ep is a batch axis outside experts
        need(t.global_batch % batch_split == 0,
             f"train.global_batch={t.global_batch}: must be divisible by mesh.dp*mesh.fsdp*mesh.ep*train.grad_accum"
             f" = {degrees['dp']}*{fsdp}*{degrees['ep']}*{t.grad_accum} = {batch_split}")
        cp, sp = degrees["cp"], degrees["sp"]
        # Context parallelism cuts the sequence into 2*cp chunks (zig-zag), each rank's share again over sp.
        seq_split = (2 if cp > 1 else 1) * cp * sp * (tp if cfg.mesh.sequence_parallel else 1)
        what = ("2*" if cp > 1 else "") + "mesh.cp*mesh.sp" + \
            ("*mesh.tp (sequence_parallel)" if cfg.mesh.sequence_parallel else "")
        need(d.seq_len % seq_split == 0, f"data.seq_len={d.seq_len}: must be divisible by {what} = {seq_split}; "
                                         f"choose a multiple of {seq_split}")
        if sp > 1:  # Ulysses: each tp shard's heads are split again over sp
            need(m.n_heads % (tp * sp) == 0, f"model.n_heads={m.n_heads}: must be divisible by mesh.tp*mesh.sp = "
                                             f"{tp * sp} (Ulysses splits heads over tp, then sp); lower mesh.sp")
            need(m.n_kv_heads % (tp * sp) == 0 or (tp * sp) % m.n_kv_heads == 0,
                 f"model.n_kv_heads={m.n_kv_heads}: with mesh.tp*mesh.sp = {tp * sp} it must be a multiple or a "
                 f"divisor of {tp * sp} (fewer kv heads are replicated); change mesh.sp or mesh.tp")
        if cp * sp > 1:
            need(m.attention != "cudnn", f"model.attention=cudnn cannot run with the sequence split (mesh.cp={cp}, "
                                         f"mesh.sp={sp}): it masks by index only; use model.attention=pallas (or auto)")
    problems.extend(validate_moe(cfg, degrees if ok_mesh else None, tp))
    if ok_mesh and degrees["pp"] > 1:
        problems.extend(pipeline_problems(cfg, degrees["pp"]))
        need(degrees["cp"] * degrees["sp"] == 1,
             f"mesh.pp={degrees['pp']} with mesh.cp*mesh.sp={degrees['cp'] * degrees['sp']}: the pipeline and the "
             f"sequence split are not composed yet; set mesh.pp=1 or mesh.cp=mesh.sp=1")
    need(t.zero_stage in (0, 1, 2, 3), f"train.zero_stage={t.zero_stage}: must be 0, 1, 2 or 3")
    need(t.remat in REMAT_FIXED or (t.remat.startswith("names:") and len(t.remat) > 6),
         f"train.remat={t.remat!r}: must be one of {', '.join(REMAT_FIXED)} or names:<point>,... "
         f"(points: {', '.join(CHECKPOINT_POINTS)})")
    if t.remat.startswith("names:"):
        for p in t.remat[6:].split(","):
            need(p in CHECKPOINT_POINTS, f"train.remat={t.remat!r}: unknown point {p!r}; "
                                         f"known: {', '.join(CHECKPOINT_POINTS)}")
    need(t.schedule_steps == 0 or t.schedule_steps >= t.steps,
         f"train.schedule_steps={t.schedule_steps}: must be >= train.steps={t.steps} (or 0 for the same)")
    need(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps}: must be >= 0")
    need(t.lr > 0, f"train.lr={t.lr}: must be > 0")
    need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio}: must be in [0, 1]")
    need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip}: must be >= 0 (0 disables clipping)")
    need(t.max_nonfinite >= 1, f"train.max_nonfinite={t.max_nonfinite}: must be >= 1")
    need(cfg.precision.loss_scale_init >= 1, f"precision.loss_scale_init={cfg.precision.loss_scale_init}: must be >= 1")
    need(cfg.precision.loss_scale_growth_interval >= 1,
         f"precision.loss_scale_growth_interval={cfg.precision.loss_scale_growth_interval}: must be >= 1")
    problems.extend(precision_problems(cfg))
    need(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0 (0 disables saving)")
    need(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    if d.document_mask:
        need(0 <= d.eos_id < m.vocab_size, f"data.eos_id={d.eos_id}: data.document_mask=true needs the end-of-document "
                                           f"token id, in [0, model.vocab_size={m.vocab_size}); set data.eos_id")
        need(m.attention != "cudnn", "model.attention=cudnn cannot mask documents (it takes no segment ids) and "
                                     "data.document_mask=true: use model.attention=pallas (or auto, which picks it)")
    if d.source == "file":
        need(bool(d.path), "data.path is empty: data.source=file needs a token file (scripts/prepare_data.py "
                           "makes one)")
        need(not d.path or Path(d.path).is_file(), f"data.path={d.path!r}: no such file")
    problems.extend(validate_new_sections(cfg))
    if problems:
        raise ConfigError(problems)
    return degrees


def validate_moe(cfg: Config, degrees: dict[str, int] | None, tp: int) -> list[str]:
    """Problems of the moe section, and of ep, one line each."""
    e, m, problems = cfg.moe, cfg.model, []
    ep = degrees["ep"] if degrees else 1

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    need(e.n_experts >= 0, f"moe.n_experts={e.n_experts}: must be >= 0 (0 for a dense model)")
    if not e.enabled:
        need(ep == 1, f"mesh.ep={ep}: expert parallelism needs an MoE model; set moe.n_experts (e.g. "
                      f"model.preset=tiny_moe) or mesh.ep=1")
        return problems
    need(1 <= e.top_k <= e.n_experts, f"moe.top_k={e.top_k}: must be in [1, moe.n_experts={e.n_experts}]")
    need(e.d_ff_expert >= 0, f"moe.d_ff_expert={e.d_ff_expert}: must be >= 1, or 0 for model.d_ff")
    need(e.expert_ffn(m) % tp == 0, f"moe.d_ff_expert={e.expert_ffn(m)}: must be divisible by mesh.tp={tp} "
                                    f"(tp splits each expert's hidden width)")
    need(e.n_shared >= 0, f"moe.n_shared={e.n_shared}: must be >= 0")
    need(e.every >= 1 and m.n_layers % max(e.every, 1) == 0,
         f"moe.every={e.every}: must be >= 1 and divide model.n_layers={m.n_layers} (layers are scanned in "
         f"groups of moe.every)")
    need(e.capacity_factor >= 0, f"moe.capacity_factor={e.capacity_factor}: must be >= 0 (0 for dropless)")
    need(e.aux_loss_coef >= 0, f"moe.aux_loss_coef={e.aux_loss_coef}: must be >= 0")
    need(e.z_loss_coef >= 0, f"moe.z_loss_coef={e.z_loss_coef}: must be >= 0")
    need(e.n_experts % ep == 0, f"moe.n_experts={e.n_experts}: must be divisible by mesh.ep={ep} (each ep "
                                f"rank holds n_experts/ep experts)")
    if degrees:
        need(degrees["pp"] == 1, f"mesh.pp={degrees['pp']} with moe.n_experts={e.n_experts}: MoE layers do not "
                                 f"run under pipeline parallelism yet; set mesh.pp=1 (use ep/fsdp) or moe.n_experts=0")
        need(degrees["cp"] * degrees["sp"] == 1,
             f"mesh.cp={degrees['cp']}, mesh.sp={degrees['sp']} with moe.n_experts={e.n_experts}: the expert exchange "
             f"and the sequence split are not composed yet; set mesh.cp=mesh.sp=1 or moe.n_experts=0")
    return problems


def validate_new_sections(cfg: Config) -> list[str]:
    """RoPE scaling, checkpoint.init_from, eval and its held-out data."""
    m, d, e = cfg.model, cfg.data, cfg.eval
    problems = []
    if m.rope_scaling == "llama3":
        if not (m.rope_factor >= 1 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                and m.rope_original_max_len >= 1):
            problems.append(f"model.rope_scaling=llama3 needs rope_factor >= 1 (got {m.rope_factor}), 0 < "
                            f"rope_low_freq_factor < rope_high_freq_factor (got {m.rope_low_freq_factor}, "
                            f"{m.rope_high_freq_factor}) and rope_original_max_len >= 1 "
                            f"(got {m.rope_original_max_len})")
    init = cfg.checkpoint.init_from
    if init and not init.startswith("hf:"):
        problems.append(f"checkpoint.init_from={init!r}: must be hf:DIR (a Hugging Face Llama directory); to "
                        f"continue a meshtrain run, set checkpoint.dir instead")
    if e.every < 0:
        problems.append(f"eval.every={e.every}: must be >= 0 (0 disables evaluation)")
    if e.batches < 1:
        problems.append(f"eval.batches={e.batches}: must be >= 1")
    if d.prefetch < 0:
        problems.append(f"data.prefetch={d.prefetch}: must be >= 0 (batches built ahead; 0 builds them in the loop)")
    if not 0 <= d.eval_fraction < 1:
        problems.append(f"data.eval_fraction={d.eval_fraction}: must be in [0, 1)")
    if d.eval_path and not Path(d.eval_path).is_file():
        problems.append(f"data.eval_path={d.eval_path!r}: no such file")
    if d.source == "synthetic" and (d.eval_fraction or d.eval_path):
        problems.append("data.eval_fraction and data.eval_path apply to data.source=file; the synthetic corpus "
                        "draws its eval batches from a stream of its own")
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        problems.append("run.tensorboard=true needs the tensorboardX package: pip install 'meshtrain[tensorboard]'")
    problems.extend(profile_problems(cfg))
    if d.source == "file" and e.every and not (d.eval_fraction or d.eval_path):
        problems.append(f"eval.every={e.every} needs held-out data: set data.eval_fraction (e.g. 0.01, the end of "
                        f"data.path) or data.eval_path")
    return problems


def profile_range(text: str) -> tuple[int, int] | None:
    """run.profile_steps "START:END" -> (START, END); None when empty or malformed (validate() says which)."""
    start, sep, end = text.strip().partition(":")
    try:
        return (int(start), int(end)) if sep else None
    except ValueError:
        return None


def profile_problems(cfg: Config) -> list[str]:
    text, steps = cfg.run.profile_steps, cfg.train.steps
    if not text:
        return []
    r = profile_range(text)
    if r is None or not 0 <= r[0] < r[1]:
        # A YAML file reads an unquoted 10:13 as the base-60 number 613, hence the hint.
        return [f"run.profile_steps={text!r}: must be START:END with 0 <= START < END (e.g. 10:13, the steps taking "
                f"the step counter from 10 to 13; quote it in YAML), or empty for no trace"]
    if r[1] > steps:
        return [f"run.profile_steps={text!r}: END={r[1]} is past train.steps={steps}; lower END or raise train.steps"]
    return []


def fp8_exclude_patterns(pc: PrecisionConfig) -> tuple[str, ...]:
    return tuple(p.strip() for p in pc.fp8_exclude.split(",") if p.strip())


def precision_problems(cfg: Config) -> list[str]:
    """The fp8 settings against themselves and the loss implementation."""
    pc, problems = cfg.precision, []
    if pc.fp8_amax_history < 1:
        problems.append(f"precision.fp8_amax_history={pc.fp8_amax_history}: must be >= 1")
    head_fp8 = pc.matmul != "bf16" and not any(fnmatch.fnmatchcase("lm_head", p) for p in fp8_exclude_patterns(pc))
    if head_fp8 and pc.matmul == "fp8_delayed":
        problems.append(f"precision.fp8_exclude={pc.fp8_exclude!r} lets lm_head run fp8_delayed, but the head matmul "
                        f"sits in the loss, outside the model's state; keep lm_head in precision.fp8_exclude or "
                        f"use precision.matmul=fp8")
    if pc.matmul == "fp8_delayed" and cfg.eval.every:
        problems.append(f"precision.matmul=fp8_delayed with eval.every={cfg.eval.every}: evaluation does not carry the "
                        f"amax histories yet; set eval.every=0 or use precision.matmul=fp8")
    if head_fp8 and cfg.model.loss == "fused":
        problems.append(f"precision.fp8_exclude={pc.fp8_exclude!r} lets lm_head run {pc.matmul}, but model.loss=fused "
                        f"computes the head inside its kernel in the compute dtype; keep lm_head in "
                        f"precision.fp8_exclude or use model.loss=reference")
    return problems


def pipeline_problems(cfg: Config, pp: int) -> list[str]:
    """What stops mesh.pp > 1 from running cfg.pipeline: schedule arguments, layer split, kernels."""
    from meshtrain.parallel.schedules import validate_args  # pure Python, no jax

    m, pl = cfg.model, cfg.pipeline
    problems = validate_args(pl.schedule, pp, cfg.train.grad_accum, pl.virtual_stages,
                             names={"kind": "pipeline.schedule", "n_stages": "mesh.pp",
                                    "n_microbatches": "train.grad_accum", "virtual_stages": "pipeline.virtual_stages"})
    chunks = pp * pl.virtual_stages
    if pl.virtual_stages >= 1 and m.n_layers % chunks:
        problems.append(f"model.n_layers={m.n_layers}: must be divisible by mesh.pp*pipeline.virtual_stages = "
                        f"{pp}*{pl.virtual_stages} = {chunks} (each stage runs whole layers); change the layer "
                        f"count, mesh.pp or pipeline.virtual_stages")
    if not m.scan_layers:
        problems.append("model.scan_layers=false: the pipeline splits the stacked layer axis over mesh.pp; set "
                        "model.scan_layers=true")
    for name, value in (("attention", m.attention), ("norm", m.norm), ("loss", m.loss)):
        if value in ("pallas", "fused"):
            problems.append(f"model.{name}={value}: the Pallas kernels do not run inside a pipeline stage yet; "
                            f"use model.{name}={'reference' if name != 'attention' else 'cudnn or reference'} "
                            f"with mesh.pp={pp}")
    if m.attention == "cudnn":  # seen on jax 0.11.2: its partitioning rule fails inside the pp-manual region
        problems.append(f"model.attention=cudnn: cuDNN attention does not compile inside a pipeline stage "
                        f"(mesh.pp={pp}); use model.attention=reference (auto picks it under pp)")
    if cfg.precision.matmul == "fp8_delayed":
        problems.append(f"precision.matmul=fp8_delayed with mesh.pp={pp}: the pipeline does not carry the amax "
                        f"histories yet; use precision.matmul=fp8 (current scaling)")
    if cfg.data.document_mask and m.attention == "auto":  # auto picks the Pallas kernel on a GPU
        problems.append(f"model.attention=auto with data.document_mask=true and mesh.pp={pp}: the Pallas kernel it "
                        f"picks on a GPU does not run inside a pipeline stage yet; set model.attention=reference")
    return problems


# Names of the remat save points the model marks with checkpoint_name (model/transformer.py).
CHECKPOINT_POINTS = ("qkv", "attn_out", "attn_proj", "mlp_hidden", "mlp_out")


def with_mesh(cfg: Config, degrees: dict[str, int]) -> Config:
    """The config with the -1 degree filled in (what gets saved beside a checkpoint)."""
    return replace(cfg, mesh=replace(cfg.mesh, **degrees))


def cpu_default_overrides() -> list[str]:
    """The embedded default on a CPU-only machine: 8 simulated devices as dp=2, fsdp=2, tp=2."""
    return ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.steps=60", "train.log_every=5"]

