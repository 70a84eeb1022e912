"""validate(): the config against itself and the device count, every problem at once in one ConfigError.

Each check names the field, the value and the fix. Runs before any device work (and before jax starts).
"""
from __future__ import annotations

import fnmatch
import importlib.util
import math
from pathlib import Path

from meshtrain.config.schema import (
    CHECKPOINT_POINTS, MESH_AXES, REMAT_FIXED, Config, MeshConfig, fp8_exclude_patterns, profile_range,
)


class ConfigError(ValueError):
    """A mistake in user configuration. `problems` holds one line per problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


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
    need(cfg.parallel.fsdp_combine_mib >= 0, f"parallel.fsdp_combine_mib={cfg.parallel.fsdp_combine_mib}: must be "
                                             f">= 0 (MiB; 0 keeps XLA's own combine threshold)")
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
        seq_split = (2 if cp > 1 else 1) * cp * sp * (tp if cfg.parallel.sequence_parallel else 1)
        what = ("2*" if cp > 1 else "") + "mesh.cp*mesh.sp" + \
            ("*mesh.tp (sequence_parallel)" if cfg.parallel.sequence_parallel else "")
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
    if ok_mesh and tp > 1 and cfg.parallel.tp_overlap == "collective_matmul":
        problems.extend(collective_matmul_problems(cfg, degrees))
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
    if not 0 <= cfg.run.gpu_memory_fraction <= 1:
        problems.append(f"run.gpu_memory_fraction={cfg.run.gpu_memory_fraction}: must be in (0, 1], or 0 for jax's "
                        f"default (0.75)")
    if d.source == "file" and e.every and not (d.eval_fraction or d.eval_path):
        problems.append(f"eval.every={e.every} needs held-out data: set data.eval_fraction (e.g. 0.01, the end of "
                        f"data.path) or data.eval_path")
    return problems


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


def collective_matmul_problems(cfg: Config, degrees: dict[str, int]) -> list[str]:
    """parallel.tp_overlap=collective_matmul (parallel/collective_matmul.py): where its ring applies."""
    fix = "or use parallel.tp_overlap=none"
    problems = []
    if not cfg.parallel.sequence_parallel:
        problems.append(f"parallel.tp_overlap=collective_matmul with mesh.tp={degrees['tp']} needs "
                        f"parallel.sequence_parallel=true (it overlaps sequence parallelism's collectives); set it, "
                        f"{fix}")
    if degrees["cp"] * degrees["sp"] > 1 or degrees["pp"] > 1:
        problems.append(f"parallel.tp_overlap=collective_matmul with mesh.cp={degrees['cp']}, mesh.sp={degrees['sp']}, "
                        f"mesh.pp={degrees['pp']}: it runs with tp alone splitting the sequence; set them to 1, {fix}")
    if cfg.precision.matmul != "bf16":
        problems.append(f"parallel.tp_overlap=collective_matmul with precision.matmul={cfg.precision.matmul}: it runs "
                        f"the bf16 recipe only; set precision.matmul=bf16, {fix}")
    if cfg.moe.n_experts:
        problems.append(f"parallel.tp_overlap=collective_matmul with moe.n_experts={cfg.moe.n_experts}: MoE models "
                        f"are not supported yet; {fix}")
    return problems
