"""The memory guard: refuse, before anything is allocated, a config whose estimate cannot fit.

Device memory comes from the backend (GPUs report `bytes_limit`); CPU devices share the host's
memory, so their estimates are summed and compared with what the host has available. The error
names the biggest consumers and the cheapest change that fits (tried in order of how little they
cost in speed), as config overrides the user can paste; on a GPU whose allocator takes less than 95%
of it, a larger `run.gpu_memory_fraction` comes first, costing no speed at all. `run.memory_guard=false`
skips it.
"""
from __future__ import annotations

import os
from dataclasses import replace

from meshtrain.config import Config, ConfigError, runs_plain
from meshtrain.planning.layout import AXES, Layout
from meshtrain.planning.memory import Memory, attention_kind, estimate, run_estimate
from meshtrain.resolve import Execution, resolve
from meshtrain.xla_flags import JAX_DEFAULT_MEM_FRACTION

# The allocator share the guard suggests when only the allocator's limit stands in the way: what the full
# Llama-3-8B at 6 sequences per GPU ran with (docs/PERFORMANCE.md, "Four H200s").
LARGE_MEM_FRACTION = 0.95

REMAT_ORDER = ("none", "save_dots_attn", "save_attn", "save_dots", "full")  # least to most recomputation

GIB = 2.0**30


def host_available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: float(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fixes(lay: Layout, cfg: Config) -> list[tuple[str, Config, Layout]]:
    """Changes in rough order of their cost in step time, as (overrides, config, layout)."""
    g = lay.degrees
    out = []
    if cfg.model.scan_layers and g["pp"] == 1:  # less memory over fsdp on GPUs, and faster there (planning/memory.py)
        out.append(("model.scan_layers=false", replace(cfg, model=replace(cfg.model, scan_layers=False)), lay))
    if lay.loss == "reference" and runs_plain(cfg.precision, "lm_head"):
        # A token chunk's logits instead of all of them, at the same step time (Llama-3-8B on two H200s and the
        # 1.36B on one, docs/PERFORMANCE.md); an fp8 head has no fused form (config/run_checks.py).
        out.append(("model.loss=fused", replace(cfg, model=replace(cfg.model, loss="fused")), replace(lay, loss="fused")))
    if g["fsdp"] > 1:
        for z in range(lay.zero_stage + 1, 4):
            out.append((f"train.zero_stage={z}", cfg, replace(lay, zero_stage=z)))
    start = REMAT_ORDER.index(lay.remat) if lay.remat in REMAT_ORDER else 0
    out += [(f"train.remat={r}", cfg, replace(lay, remat=r)) for r in REMAT_ORDER[start + 1:]]
    for k in (2, 4, 8, 16):
        mb = lay.micro_batch // k
        if mb >= 1 and lay.micro_batch % k == 0 and mb % (g["dp"] * g["fsdp"]) == 0:
            out.append((f"train.grad_accum={lay.grad_accum * k}", cfg,
                        replace(lay, micro_batch=mb, grad_accum=lay.grad_accum * k)))
    if g["dp"] > 1:  # dp -> fsdp keeps the device count and shards the state
        out.append((f"mesh.dp=1 mesh.fsdp={g['dp'] * g['fsdp']} train.zero_stage=3", cfg,
                    replace(lay, degrees={**g, "dp": 1, "fsdp": g["dp"] * g["fsdp"]}, zero_stage=3)))
    return out


def check(cfg: Config, n_devices: int, platform: str, device_bytes: float | None,
          memory_fraction: float = JAX_DEFAULT_MEM_FRACTION) -> None:
    """Raise ConfigError when the estimate exceeds the memory available (see the module docstring).
    `memory_fraction`: the share of a GPU that `device_bytes` is (jax's allocator takes 0.75 by default)."""
    exe, est = run_estimate_on(cfg, platform)
    lay, attn = Layout.of(cfg), attention_kind(exe)
    gpu = platform != "cpu" and bool(device_bytes)
    if gpu:
        limit, per, where = device_bytes, 1, "device memory"
    else:
        limit, per, where = host_available_bytes(), n_devices, "host memory available"
    need = est.total * per
    if need <= limit:
        return
    parts = ", ".join(f"{k} {v * per / GIB:.1f}" for k, v in est.biggest())
    def fits(alt_cfg: Config, alt: Layout) -> bool:
        return estimate(alt_cfg, alt, attn, exe.moe_gemm or "ragged_dot", backend=exe.backend).total * per <= limit

    fix = next((f for f, alt_cfg, alt in _fixes(lay, cfg) if fits(alt_cfg, alt)), None)
    if gpu and memory_fraction < LARGE_MEM_FRACTION and need <= limit / memory_fraction * LARGE_MEM_FRACTION:
        fix = (f"run.gpu_memory_fraction={LARGE_MEM_FRACTION} (jax's allocator then takes {LARGE_MEM_FRACTION:.0%} of "
               f"each GPU instead of {memory_fraction:.0%}; for a process that has its GPUs to itself)"
               + (f", or {fix}" if fix else ""))
    hint = (f"the cheapest change that fits: {fix}" if fix else
            "no single change fits: use more devices, a smaller model (model.preset) or a shorter data.seq_len")
    scope = f"{n_devices} CPU devices together" if per > 1 else "per device"
    raise ConfigError(f"memory: the estimate is {need / GIB:.1f} GiB {scope} ({parts} GiB) but {where} is "
                      f"{limit / GIB:.1f} GiB; {hint} (or run.memory_guard=false to skip this check)")


def run_estimate_on(cfg: Config, platform: str) -> tuple[Execution, Memory]:
    """(what `cfg` will run on this platform, its memory estimate): the planner's "as given" row makes the
    same estimate of the same Execution (planning.search.as_given)."""
    exe = resolve(cfg, {a: getattr(cfg.mesh, a) for a in AXES}, platform)
    return exe, run_estimate(cfg, exe)


def device_limit() -> float | None:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None
