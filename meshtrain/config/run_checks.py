"""validate()'s checks of how the run trains and records: the train, precision, checkpoint, data, eval and
run sections, one `*_problems` function each (validation.py holds those of the model and its layout).

A check is a pair (condition, message); `failed` keeps the messages whose condition is false, one line
per problem, each naming the field, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import importlib.util
from pathlib import Path
from typing import Iterable

from meshtrain.config.schema import (
    CHECKPOINT_POINTS, MATMUL_SITES, REMAT_FIXED, TRACKERS, Config, fp8_exclude_patterns, profile_range, remat_parts,
    runs_plain, tracker_names,
)
from meshtrain.config.text_sources import text_source_problems


def value_problems(cfg: Config) -> list[str]:
    """Every float setting finite, and the optimizer's and the model's numbers in their ranges: a NaN or an
    infinity here would only show as a non-finite loss some steps in."""
    problems = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for f in dataclasses.fields(part):
            v = getattr(part, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                problems.append(f"{section.name}.{f.name}={v}: must be a finite number")
    if problems:  # the range checks below would repeat them
        return problems
    t, m = cfg.train, cfg.model
    return failed([
        (0 <= t.b1 < 1, f"train.b1={t.b1}: must be in [0, 1) (Adam's first-moment decay, e.g. 0.9)"),
        (0 <= t.b2 < 1, f"train.b2={t.b2}: must be in [0, 1) (Adam's second-moment decay, e.g. 0.95)"),
        (t.weight_decay >= 0, f"train.weight_decay={t.weight_decay}: must be >= 0"),
        (m.init_std > 0, f"model.init_std={m.init_std}: must be > 0 (e.g. 0.02)"),
        (m.norm_eps > 0, f"model.norm_eps={m.norm_eps}: must be > 0 (e.g. 1e-6)"),
        (m.rope_theta > 0, f"model.rope_theta={m.rope_theta}: must be > 0 (e.g. 10000)"),
    ])


def failed(checks: Iterable[tuple[bool, str]]) -> list[str]:
    """The message of every check whose condition is false."""
    return [msg for ok, msg in checks if not ok]


def remat_checks(field: str, policy: str, also: str = "") -> list[tuple[bool, str]]:
    """A remat policy's spelling (model/remat.py), for the config `field` that names it; `also`: another value
    the field takes."""
    parts = remat_parts(policy)
    choices = ", ".join(((also,) if also else ()) + REMAT_FIXED)
    checks = [(name in REMAT_FIXED or (name == "names" and points != ("",)),
               f"{field}={policy!r}: {spelled!r} must be one of {choices} or names:<point>,... "
               f"(points: {', '.join(CHECKPOINT_POINTS)}); policies join with '+'")
              for (name, points), spelled in zip(parts, policy.split("+"))]
    checks.append((len(parts) == 1 or ("none", ()) not in parts,
                   f"{field}={policy!r}: 'none' keeps everything already; join only recomputing policies"))
    checks += [(p in CHECKPOINT_POINTS, f"{field}={policy!r}: unknown point {p!r}; known: "
                                        f"{', '.join(CHECKPOINT_POINTS)}")
               for name, points in parts if name == "names" and points != ("",) for p in points]
    return checks


def train_problems(cfg: Config) -> list[str]:
    """The optimizer step and its schedule: ZeRO stage, recomputation (a pipeline's last chunk's too), learning rate,
    clipping."""
    t = cfg.train
    checks = [(t.zero_stage in (0, 1, 2, 3), f"train.zero_stage={t.zero_stage}: must be 0, 1, 2 or 3")]
    checks += remat_checks("train.remat", t.remat)
    if cfg.pipeline.last_chunk_remat != "auto":
        checks += remat_checks("pipeline.last_chunk_remat", cfg.pipeline.last_chunk_remat, also="auto")
    checks += [
        (t.schedule_steps == 0 or t.schedule_steps >= t.steps,
         f"train.schedule_steps={t.schedule_steps}: must be >= train.steps={t.steps} (or 0 for the same)"),
        (t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps}: must be >= 0"),
        (t.lr > 0, f"train.lr={t.lr}: must be > 0"),
        (0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio}: must be in [0, 1]"),
        (0 < t.decay_fraction <= 1, f"train.decay_fraction={t.decay_fraction}: must be in (0, 1] (the share of the "
                                    f"schedule that train.lr_schedule=wsd spends decaying, e.g. 0.2)"),
        (t.grad_clip >= 0, f"train.grad_clip={t.grad_clip}: must be >= 0 (0 disables clipping)"),
        (t.max_nonfinite >= 1, f"train.max_nonfinite={t.max_nonfinite}: must be >= 1"),
    ]
    return failed(checks)


def precision_problems(cfg: Config) -> list[str]:
    """Loss scaling, and the fp8 settings against themselves and the loss implementation."""
    pc, problems = cfg.precision, []
    if pc.loss_scale_init < 1:
        problems.append(f"precision.loss_scale_init={pc.loss_scale_init}: must be >= 1")
    if pc.loss_scale_growth_interval < 1:
        problems.append(f"precision.loss_scale_growth_interval={pc.loss_scale_growth_interval}: must be >= 1")
    if pc.fp8_amax_history < 1:
        problems.append(f"precision.fp8_amax_history={pc.fp8_amax_history}: must be >= 1")
    problems.extend(fp8_exclude_problems(cfg))
    head_fp8 = not runs_plain(pc, "lm_head")
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


def fp8_exclude_problems(cfg: Config) -> list[str]:
    """precision.fp8_exclude against the matmul sites: every pattern must match one (a typo would leave its
    site in fp8 unnoticed), and under an fp8 recipe an MoE model keeps its expert sites plain."""
    pc = cfg.precision
    patterns = fp8_exclude_patterns(pc)
    plain = lambda site: any(fnmatch.fnmatchcase(site, p) for p in patterns)  # noqa: E731
    problems = [f"precision.fp8_exclude: pattern {p!r} matches no matmul site; the sites are {', '.join(MATMUL_SITES)}"
                for p in patterns if not any(fnmatch.fnmatchcase(s, p) for s in MATMUL_SITES)]
    experts = [s for s in MATMUL_SITES if s.startswith("moe.") and not plain(s)]
    if pc.matmul != "bf16" and cfg.moe.enabled and experts:
        problems.append(f"precision.fp8_exclude={pc.fp8_exclude!r} lets {', '.join(experts)} run {pc.matmul}, but "
                        f"the experts' grouped GEMMs have no fp8 recipe yet (they would run in the compute dtype); "
                        f"add moe.* to precision.fp8_exclude")
    return problems


def checkpoint_problems(cfg: Config) -> list[str]:
    c = cfg.checkpoint
    return failed([
        (c.every >= 0, f"checkpoint.every={c.every}: must be >= 0 (0 disables saving)"),
        (c.keep >= 1, f"checkpoint.keep={c.keep}: must be >= 1"),
        (c.timeout_s >= 1, f"checkpoint.timeout_s={c.timeout_s}: must be >= 1 (seconds a checkpoint write may take)"),
        (not c.init_from or c.init_from.startswith("hf:"),
         f"checkpoint.init_from={c.init_from!r}: must be hf:DIR (a Hugging Face Llama directory); to continue a "
         f"meshtrain run, set checkpoint.dir instead"),
    ])


def data_problems(cfg: Config) -> list[str]:
    """The token source, document masking, prefetching and the held-out data."""
    d, m = cfg.data, cfg.model
    checks = []
    if d.document_mask:
        checks += [
            (0 <= d.eos_id < m.vocab_size, f"data.eos_id={d.eos_id}: data.document_mask=true needs the end-of-document "
                                           f"token id, in [0, model.vocab_size={m.vocab_size}); set data.eos_id"),
            (m.attention != "cudnn", "model.attention=cudnn cannot mask documents (it takes no segment ids) and "
                                     "data.document_mask=true: use model.attention=pallas (or auto, which picks it)"),
        ]
    if d.source == "file":
        checks += [
            (bool(d.path), "data.path is empty: data.source=file needs a token file (scripts/prepare_data.py "
                           "makes one)"),
            (not d.path or Path(d.path).is_file(), f"data.path={d.path!r}: no such file"),
            (not d.eval_path or Path(d.eval_path).is_file(), f"data.eval_path={d.eval_path!r}: no such file"),
        ]
    if d.source == "hf":
        missing = missing_package("datasets", "data", "data.source=hf")
        checks += [(not missing, str(missing)), *((False, p) for p in text_source_problems(d, m.vocab_size))]
    checks += [
        (d.prefetch >= 0, f"data.prefetch={d.prefetch}: must be >= 0 (batches built ahead; 0 builds them in the loop)"),
        (0 <= d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction}: must be in [0, 1)"),
        (not (d.source == "synthetic" and (d.eval_fraction or d.eval_path)),
         "data.eval_fraction and data.eval_path apply to data.source=file or hf; the synthetic corpus draws its eval "
         "batches from a stream of its own"),
    ]
    return failed(checks)


def eval_problems(cfg: Config) -> list[str]:
    e, d = cfg.eval, cfg.data
    return failed([
        (e.every >= 0, f"eval.every={e.every}: must be >= 0 (0 disables evaluation)"),
        (e.batches >= 1, f"eval.batches={e.batches}: must be >= 1"),
        (not (d.source in ("file", "hf") and e.every and not (d.eval_fraction or d.eval_path)),
         f"eval.every={e.every} needs held-out data: set data.eval_fraction (e.g. 0.01, the end of data.path) or "
         f"data.eval_path"),
    ])


def missing_package(module: str, extra: str, what: str) -> str | None:
    """None when `module` is importable, else the problem: `what` needs it, and the install line the README
    uses (`pip install -e ".[extra]"` in the checkout)."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f'{what} needs the {module} package: pip install -e ".[{extra}]"'


def run_problems(cfg: Config) -> list[str]:
    """What the run records (its trackers, a device trace) and the GPU memory it takes."""
    r = cfg.run
    memory = [(0 <= r.gpu_memory_fraction <= 1, f"run.gpu_memory_fraction={r.gpu_memory_fraction}: must be in (0, 1], "
                                                f"or 0 for jax's default (0.75)")]
    return tracker_problems(cfg) + profile_problems(cfg) + failed(memory)


# The package each tracker writes with, and the extra that installs it.
TRACKER_PACKAGES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}


def tracker_problems(cfg: Config) -> list[str]:
    """run.tracker: known names, each with its package installed (checked here, before any device work)."""
    names = tracker_names(cfg.run)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        return [f"run.tracker={cfg.run.tracker!r}: unknown tracker {unknown[0]!r}; a comma list of "
                f"{', '.join(TRACKERS)}, or empty for none"]
    missing = (missing_package(*TRACKER_PACKAGES[n], f"run.tracker={n}") for n in names)
    return [m for m in missing if m]


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
