"""Enumerate layouts for a model and a global batch, estimate each, keep what fits, rank by time.

Candidates: every factorisation of the device count over the seven axes x ZeRO stage x remat
policy x microbatch size x grad_accum (microbatch x grad_accum = global batch) x, where pp > 1, the
pipeline schedule and its virtual stages (pipeline_options); a layout that does not fit with the plain loss
is tried with the fused one (model.loss). Filtered by what the model's shape allows
(heads over tp, sequence over cp/sp, sequences over dp/fsdp, layers over pp x virtual stages). Layouts are
grouped into families (which axes are used) so that the planner can say why a family was dropped:
"does not divide", "not available in this version" or "over memory by X GiB at best".
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from meshtrain.config import Config, ConfigError, build_config, runs_plain, validate
from meshtrain.config.pipeline import validate_args
from meshtrain.planning.layout import AXES, Layout
from meshtrain.planning.memory import Memory, attention_kind, estimate, run_estimate
from meshtrain.planning.timing import Rates, step_time
from meshtrain.resolve import Execution, resolve

REMATS = ("none", "save_dots_attn", "save_attn", "save_dots", "full")
# The schedules searched: afab holds every microbatch with 1f1b's bubble, so it never wins; interleaved with up to
# MAX_VIRTUAL chunks per stage (more cut the chunks too thin for their matmuls and add ticks).
SCHEDULES = ("1f1b", "interleaved", "zb_h1", "dualpipe_v")
MAX_VIRTUAL = 8
UNAVAILABLE = "is not available in this version"  # validate()'s words for an axis still to come


@dataclass
class Candidate:
    layout: Layout
    memory: Memory
    time: dict[str, float]

    def to_json(self) -> dict:
        return {"layout": dict(self.layout.degrees, zero_stage=self.layout.zero_stage, remat=self.layout.remat,
                               micro_batch=self.layout.micro_batch, grad_accum=self.layout.grad_accum,
                               sequence_parallel=self.layout.sequence_parallel),
                "overrides": self.layout.overrides(), "memory_bytes": self.memory.to_json(),
                "step_time_s": self.time["total_s"], "time_breakdown_s": self.time}


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def layout_config(cfg: Config, lay: Layout) -> Config:
    return build_config(cfg.to_dict(), lay.overrides())


def evaluate(cfg: Config, lay: Layout, rates: Rates, n_devices: int, attention_impl: str, backend: str) -> Candidate:
    return Candidate(lay, estimate(cfg, lay, attention_impl, backend=backend), step_time(cfg, lay, rates, n_devices))


def as_given(cfg: Config, rates: Rates, n_devices: int, backend: str) -> tuple[Candidate, Execution]:
    """The config's own layout (mesh degrees resolved), estimated as it will run on `backend`: the same
    estimate the memory guard makes (memory.run_estimate)."""
    exe = resolve(cfg, {a: getattr(cfg.mesh, a) for a in AXES}, backend)
    lay = Layout.of(cfg)
    return Candidate(lay, run_estimate(cfg, exe), step_time(cfg, lay, rates, n_devices)), exe


def pipeline_options(cfg: Config, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) that run `microbatches` over `pp` stages of this model, the config's own first."""
    own = (cfg.pipeline.schedule, cfg.pipeline.virtual_stages)
    candidates = [own] + [(kind, v) for kind in SCHEDULES
                          for v in ((2,) if kind == "dualpipe_v" else range(2, MAX_VIRTUAL + 1) if kind == "interleaved"
                                    else (1,))]
    out = []
    for kind, v in candidates:
        if (kind, v) not in out and cfg.model.n_layers % (pp * v) == 0 and not validate_args(kind, pp, microbatches, v):
            out.append((kind, v))
    return out


def family(lay: Layout) -> str:
    used = [a for a in AXES if lay.degrees[a] > 1]
    return "+".join(used) or "single device"


def search(cfg: Config, n_devices: int, device_bytes: float, rates: Rates, *, backend: str = "gpu",
           top: int | None = 10) -> tuple[list[Candidate], dict[str, str]]:
    """(the `top` fitting candidates (None: all), fastest first; {family: why it has no fitting candidate})."""
    best_by_family: dict[str, Candidate] = {}
    fits: list[Candidate] = []
    refused: dict[str, str] = {}
    unavailable: dict[str, list[Candidate]] = {}
    gb = cfg.train.global_batch
    fused_loss_may_help = cfg.model.loss == "reference" and runs_plain(cfg.precision, "lm_head")
    accums = [a for a in (1, 2, 4, 8, 16, 32, 64) if gb % a == 0]
    for shape in factorizations(n_devices, len(AXES)):
        degrees = dict(zip(AXES, shape))
        if cfg.model.n_heads % (degrees["sp"] * degrees["tp"]):  # Ulysses splits heads over sp, then tp
            refused.setdefault(family(Layout(degrees)), f"model.n_heads={cfg.model.n_heads} is not divisible by "
                                                        f"sp*tp={degrees['sp'] * degrees['tp']}")
            continue
        if degrees["ep"] > 1 and not cfg.moe.n_experts:
            refused.setdefault(family(Layout(degrees)), "ep shards MoE experts; this model has none")
            continue
        # A pipeline needs a schedule that runs its microbatches (at least one per stage).
        pp = degrees["pp"]
        schedules = {a: pipeline_options(cfg, pp, a) if pp > 1 else [(cfg.pipeline.schedule, 1)] for a in accums}
        runnable = [a for a in accums if (gb // a) % (degrees["dp"] * degrees["fsdp"]) == 0 and schedules[a]]
        for sp_flag in ((False, True) if degrees["tp"] > 1 else (False,)):
            base = Layout(degrees, sequence_parallel=sp_flag, loss=cfg.model.loss)
            fam = family(base)
            # Validated as its first runnable knobs, or (none runnable) as the most microbatches, so that the
            # config error names what else stops the family.
            first = runnable[0] if runnable else accums[-1]
            kind, v = schedules[first][0] if runnable else (cfg.pipeline.schedule, cfg.pipeline.virtual_stages)
            base_cfg = layout_config(cfg, replace(base, micro_batch=gb // first, grad_accum=first, schedule=kind,
                                                  virtual_stages=v))
            try:
                validate(base_cfg, n_devices)
                available = True
            except ConfigError as e:
                other = [p for p in e.problems if UNAVAILABLE not in p]
                if other:
                    refused.setdefault(fam, other[0])
                    continue
                available = False  # estimated all the same, so the plan shows what the axis would give
            try:  # what this layout would run (attention under pp or cp differs), as run there would decide it
                attention_impl = attention_kind(resolve(base_cfg, degrees, backend, packages_here=False))
            except ConfigError as e:
                refused.setdefault(fam, e.problems[0])
                continue
            knobs = [(zero, remat, accum, kind, v)
                     for zero, remat, accum in itertools.product((0, 1, 2, 3) if degrees["fsdp"] > 1 else (0,), REMATS,
                                                                 runnable)
                     for kind, v in schedules[accum]]
            for zero, remat, accum, kind, v in knobs:
                lay = replace(base, zero_stage=zero, remat=remat, micro_batch=gb // accum, grad_accum=accum,
                              schedule=kind, virtual_stages=v)
                cand = evaluate(cfg, lay, rates, n_devices, attention_impl, backend)
                if cand.memory.total > device_bytes and fused_loss_may_help:
                    # The fused loss costs no time (docs/PERFORMANCE.md); it is tried only where the plain one
                    # does not fit, so the plan keeps the config's own loss wherever that runs.
                    cand = evaluate(cfg, replace(lay, loss="fused"), rates, n_devices, attention_impl, backend)
                prev = best_by_family.get(fam)
                if prev is None or cand.memory.total < prev.memory.total:
                    best_by_family[fam] = cand
                if not available:
                    unavailable.setdefault(fam, [])
                    if cand.memory.total <= device_bytes:
                        unavailable[fam].append(cand)
                elif cand.memory.total <= device_bytes:
                    fits.append(cand)
    fitting_families = {family(c.layout) for c in fits}
    for fam, cands in unavailable.items():
        axes = [a for a in fam.split("+") if a in ("pp", "ep", "cp", "sp")]
        if cands:
            fast = min(cands, key=lambda c: c.time["total_s"])
            refused[fam] = (f"{','.join(axes)} not available in this version (would fit: {fast.layout.label()}, "
                            f"{fast.memory.total / 2**30:.1f} GiB, {fast.time['total_s']:.3g} s/step)")
        else:
            refused[fam] = f"{','.join(axes)} not available in this version (and over memory)"
        fitting_families.add(fam)
    for fam, cand in best_by_family.items():
        if fam not in fitting_families:
            over = (cand.memory.total - device_bytes) / 2**30
            refused[fam] = f"over memory by {over:.1f} GiB at best ({cand.layout.label()})"
    for fam in list(refused):
        if fam in {family(c.layout) for c in fits}:
            del refused[fam]
    fits.sort(key=lambda c: (c.time["total_s"], c.memory.total))
    return fits[:top] if top is not None else fits, refused
