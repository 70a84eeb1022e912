"""validate(): the config against itself and the device count, every problem at once in one ConfigError.

Each check names the field, the value and the fix. Runs before any device work (and before jax starts).
Each section's checks are one `*_problems` function: here those of the model and its layout over the mesh
(sizes, model, mesh, moe, parallel, pipeline), in run_checks.py those of how the run trains and records.
"""
from __future__ import annotations

import math

from meshtrain.config.pipeline import validate_args
from meshtrain.config.run_checks import (
    checkpoint_problems, data_problems, eval_problems, failed, precision_problems, run_problems, train_problems,
    value_problems,
)
from meshtrain.config.schema import MESH_AXES, Config, MeshConfig


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
    degrees, problems = resolve_mesh(cfg.mesh, n_devices)
    mesh = None if problems else degrees  # the checks that need every degree skip a broken mesh
    tp = degrees["tp"] if mesh else max(cfg.mesh.tp, 1)
    sizes = size_problems(cfg)
    if sizes:  # sizes below 1 would divide by zero in the checks that follow
        raise ConfigError(problems + sizes)
    problems += model_problems(cfg, tp)
    problems += mesh_problems(cfg, mesh) if mesh else []
    problems += moe_problems(cfg, mesh, tp)
    problems += parallel_problems(cfg, mesh)
    problems += pipeline_problems(cfg, mesh) if mesh and mesh["pp"] > 1 else []
    problems += value_problems(cfg)
    problems += train_problems(cfg)
    problems += precision_problems(cfg)
    problems += checkpoint_problems(cfg)
    problems += data_problems(cfg)
    problems += eval_problems(cfg)
    problems += run_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return degrees


def size_problems(cfg: Config) -> list[str]:
    """Every count that must be positive (the other checks divide by them)."""
    m, t, d = cfg.model, cfg.train, cfg.data
    return failed([
        *((getattr(m, name) >= 1, f"model.{name}={getattr(m, name)}: must be >= 1")
          for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size")),
        *((getattr(t, name) >= 1, f"train.{name}={getattr(t, name)}: must be >= 1")
          for name in ("steps", "global_batch", "grad_accum", "log_every")),
        (d.seq_len >= 1, f"data.seq_len={d.seq_len}: must be >= 1"),
        (m.head_dim >= 0, f"model.head_dim={m.head_dim}: must be >= 1, or 0 for d_model // n_heads"),
    ])


def model_problems(cfg: Config, tp: int) -> list[str]:
    """The model's shape against itself and tp, and its RoPE scaling."""
    m = cfg.model
    # Attention heads over tp (Megatron): query heads split; kv heads split too, or replicated when fewer.
    checks = [
        (m.n_heads % m.n_kv_heads == 0, f"model.n_kv_heads={m.n_kv_heads}: must divide model.n_heads={m.n_heads} "
                                        f"(grouped-query attention)"),
        (m.head_dim > 0 or m.d_model % m.n_heads == 0,
         f"model.d_model={m.d_model}: must be divisible by model.n_heads={m.n_heads}, or set model.head_dim"),
        (m.n_heads % tp == 0, f"model.n_heads={m.n_heads}: must be divisible by mesh.tp={tp}; "
                              f"choose a tp that divides {m.n_heads}"),
        (m.n_kv_heads < tp or m.n_kv_heads % tp == 0,
         f"model.n_kv_heads={m.n_kv_heads}: with mesh.tp={tp} it must be divisible by tp (or fewer than tp, "
         f"then replicated); choose tp dividing {m.n_kv_heads}"),
        (m.attention != "pallas" or m.n_kv_heads >= tp or tp % m.n_kv_heads == 0,
         f"model.attention=pallas with model.n_kv_heads={m.n_kv_heads} < mesh.tp={tp}: tp must be a multiple of "
         f"n_kv_heads so that each tp shard's query heads share one kv head"),
        (m.d_ff % tp == 0, f"model.d_ff={m.d_ff}: must be divisible by mesh.tp={tp}"),
    ]
    if m.rope_scaling == "llama3":
        checks.append((m.rope_factor >= 1 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                       and m.rope_original_max_len >= 1,
                       f"model.rope_scaling=llama3 needs rope_factor >= 1 (got {m.rope_factor}), 0 < "
                       f"rope_low_freq_factor < rope_high_freq_factor (got {m.rope_low_freq_factor}, "
                       f"{m.rope_high_freq_factor}) and rope_original_max_len >= 1 (got {m.rope_original_max_len})"))
    return failed(checks)


def mesh_problems(cfg: Config, degrees: dict[str, int]) -> list[str]:
    """The resolved mesh against the batch, the sequence and the heads it splits, and the axes it composes."""
    m, t, d = cfg.model, cfg.train, cfg.data
    dp, fsdp, ep, cp, sp, tp, pp = (degrees[a] for a in ("dp", "fsdp", "ep", "cp", "sp", "tp", "pp"))
    batch_split = dp * fsdp * ep * t.grad_accum  # ep is a batch axis outside experts
    # Context parallelism cuts the sequence into 2*cp chunks (zig-zag), each rank's share again over sp.
    seq_split = (2 if cp > 1 else 1) * cp * sp * (tp if cfg.parallel.sequence_parallel else 1)
    what = ("2*" if cp > 1 else "") + "mesh.cp*mesh.sp" + \
        ("*mesh.tp (sequence_parallel)" if cfg.parallel.sequence_parallel else "")
    checks = [
        (m.d_model % fsdp == 0, f"model.d_model={m.d_model}: must be divisible by mesh.fsdp={fsdp} "
                                f"(fsdp shards the embed dimension)"),
        (t.global_batch % batch_split == 0,
         f"train.global_batch={t.global_batch}: must be divisible by mesh.dp*mesh.fsdp*mesh.ep*train.grad_accum"
         f" = {dp}*{fsdp}*{ep}*{t.grad_accum} = {batch_split}"),
        (d.seq_len % seq_split == 0, f"data.seq_len={d.seq_len}: must be divisible by {what} = {seq_split}; "
                                     f"choose a multiple of {seq_split}"),
    ]
    if sp > 1:  # Ulysses: each tp shard's heads are split again over sp
        checks += [
            (m.n_heads % (tp * sp) == 0, f"model.n_heads={m.n_heads}: must be divisible by mesh.tp*mesh.sp = "
                                         f"{tp * sp} (Ulysses splits heads over tp, then sp); lower mesh.sp"),
            (m.n_kv_heads % (tp * sp) == 0 or (tp * sp) % m.n_kv_heads == 0,
             f"model.n_kv_heads={m.n_kv_heads}: with mesh.tp*mesh.sp = {tp * sp} it must be a multiple or a "
             f"divisor of {tp * sp} (fewer kv heads are replicated); change mesh.sp or mesh.tp"),
        ]
    if cp * sp > 1:
        checks.append((m.attention != "cudnn", f"model.attention=cudnn cannot run with the sequence split "
                                               f"(mesh.cp={cp}, mesh.sp={sp}): it masks by index only; use "
                                               f"model.attention=pallas (or auto)"))
    if pp > 1 and cp > 1:
        # Inside a stage only collectives whose groups stay within the stage may run: each stage takes its own
        # branch of the tick's switch, and a permute pairing devices of two stages waits for ever. The ring's
        # hop between two ranks runs there as an all-to-all of the cp group (parallel/sequence/ring.py).
        checks.append((cfg.parallel.cp_impl == "allgather" or cp == 2,
                       f"mesh.pp={pp} with mesh.cp={cp} and parallel.cp_impl=ring: inside a pipeline stage the "
                       f"ring runs on two ranks only; set mesh.cp=2 or parallel.cp_impl=allgather"))
    return failed(checks)


def moe_problems(cfg: Config, degrees: dict[str, int] | None, tp: int) -> list[str]:
    """The moe section, and ep (degrees None: the mesh did not resolve)."""
    e, m = cfg.moe, cfg.model
    ep = degrees["ep"] if degrees else 1
    if not e.enabled:
        return failed([
            (e.n_experts >= 0, f"moe.n_experts={e.n_experts}: must be >= 0 (0 for a dense model)"),
            (ep == 1, f"mesh.ep={ep}: expert parallelism needs an MoE model; set moe.n_experts (e.g. "
                      f"model.preset=tiny_moe) or mesh.ep=1"),
        ])
    checks = [
        (1 <= e.top_k <= e.n_experts, f"moe.top_k={e.top_k}: must be in [1, moe.n_experts={e.n_experts}]"),
        (e.d_ff_expert >= 0, f"moe.d_ff_expert={e.d_ff_expert}: must be >= 1, or 0 for model.d_ff"),
        (e.expert_ffn(m) % tp == 0, f"moe.d_ff_expert={e.expert_ffn(m)}: must be divisible by mesh.tp={tp} "
                                    f"(tp splits each expert's hidden width)"),
        (e.n_shared >= 0, f"moe.n_shared={e.n_shared}: must be >= 0"),
        (e.every >= 1 and m.n_layers % max(e.every, 1) == 0,
         f"moe.every={e.every}: must be >= 1 and divide model.n_layers={m.n_layers} (layers are scanned in "
         f"groups of moe.every)"),
        (e.capacity_factor >= 0, f"moe.capacity_factor={e.capacity_factor}: must be >= 0 (0 for dropless)"),
        (e.aux_loss_coef >= 0, f"moe.aux_loss_coef={e.aux_loss_coef}: must be >= 0"),
        (e.z_loss_coef >= 0, f"moe.z_loss_coef={e.z_loss_coef}: must be >= 0"),
        (e.n_experts % ep == 0, f"moe.n_experts={e.n_experts}: must be divisible by mesh.ep={ep} (each ep "
                                f"rank holds n_experts/ep experts)"),
    ]
    return failed(checks)


def parallel_problems(cfg: Config, degrees: dict[str, int] | None) -> list[str]:
    """The parallel section: fsdp's combine threshold, and where tp's collective matmul can run."""
    pc = cfg.parallel
    problems = failed([(pc.fsdp_combine_mib >= 0, f"parallel.fsdp_combine_mib={pc.fsdp_combine_mib}: must be >= 0 "
                                                  f"(MiB; 0 keeps XLA's own combine threshold)")])
    if degrees and degrees["tp"] > 1 and pc.tp_overlap == "collective_matmul":
        problems += collective_matmul_problems(cfg, degrees)
    return problems


def pipeline_problems(cfg: Config, degrees: dict[str, int]) -> list[str]:
    """What stops mesh.pp > 1 from running cfg.pipeline: schedule arguments, the layer split.

    The two settings a config written for one GPU lacks (scanned layers, microbatches for the stages)
    come as one line with the overrides that fix both, so `mesh.pp=2` on such a config is one retry."""
    m, pl, pp = cfg.model, cfg.pipeline, degrees["pp"]
    names = {"kind": "pipeline.schedule", "n_stages": "mesh.pp", "n_microbatches": "train.grad_accum",
             "virtual_stages": "pipeline.virtual_stages"}
    needs = []  # (override, why)
    microbatches = cfg.train.grad_accum
    if not m.scan_layers:
        needs.append(("model.scan_layers=true", "the stages split the stacked layer axis"))
    if isinstance(microbatches, int) and 0 < microbatches < pp:
        # As many microbatches as the batch allows (one sequence each), if the schedule takes that many.
        per_replica = cfg.train.global_batch // max(degrees["dp"] * degrees["fsdp"] * degrees["ep"], 1)
        fits = per_replica >= pp and not validate_args(pl.schedule, pp, per_replica, pl.virtual_stages, names=names)
        microbatches = per_replica if fits else pp
        needs.append((f"train.grad_accum={microbatches}" if fits else f"train.grad_accum>={pp}",
                      f"it is {cfg.train.grad_accum}: a microbatch at least for every stage"))
    problems = []
    if needs:
        overrides = [o for o, _ in needs if ">=" not in o]
        problems.append(f"mesh.pp={pp} needs " + "; ".join(f"{o} ({why})" for o, why in needs) +
                        (": add " + " ".join(overrides) if len(overrides) == len(needs) else ""))
    problems += validate_args(pl.schedule, pp, microbatches, pl.virtual_stages, names=names)
    chunks = pp * pl.virtual_stages
    if pl.virtual_stages >= 1 and m.n_layers % chunks:
        problems.append(f"model.n_layers={m.n_layers}: must be divisible by mesh.pp*pipeline.virtual_stages = "
                        f"{pp}*{pl.virtual_stages} = {chunks} (each stage runs whole layers); change the layer "
                        f"count, mesh.pp or pipeline.virtual_stages")
    elif cfg.moe.enabled and pl.virtual_stages >= 1 and (m.n_layers // chunks) % cfg.moe.every:
        problems.append(f"moe.every={cfg.moe.every}: must divide the layers per pipeline chunk, model.n_layers/"
                        f"(mesh.pp*pipeline.virtual_stages) = {m.n_layers // chunks} (a chunk runs whole groups of "
                        f"a dense and an MoE block); change moe.every, mesh.pp or pipeline.virtual_stages")
    return problems


def collective_matmul_problems(cfg: Config, degrees: dict[str, int]) -> list[str]:
    """parallel.tp_overlap=collective_matmul (parallel/tensor.py): where its ring applies."""
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
