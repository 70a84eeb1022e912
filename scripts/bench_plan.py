"""The planner's predicted step time and memory against measured ones, for one of three sets of
layouts (below). One command, one result directory:

  PYTHONPATH=. python scripts/bench_plan.py --out DIR                       # --set timing: 1B and 8B layouts
  PYTHONPATH=. python scripts/bench_plan.py --out DIR --set calibration     # the memory guard's estimate
  PYTHONPATH=. python scripts/bench_plan.py --out DIR --plan-top K [--config F] --devices N \
      --device-memory GIB [section.key=value ...]                           # the planner's top K, measured
  ... --tiny                       # any of them as a CPU smoke run: tiny shapes, 2 simulated devices

  timing       layouts of the 1B and 8B shapes on one or two GPUs (2xH200; those needing 2 GPUs skip on 1),
               each predicted as given (the estimate the memory guard makes).
  calibration  the shipped configs as the memory guard sees them: configs/llama1b_h100.yaml on 1 GPU,
               configs/llama3_8b_fsdp.yaml on 2 GPUs at 4 sequences per GPU, and the 1B config as a
               2-stage 1F1B pipeline (8 microbatches) on 2 GPUs; predicted as given.
  --plan-top K the search of `python -m meshtrain.plan` for the config (--config and the overrides) on N
               devices of GIB each, and its K fastest layouts that fit, each predicted by its candidate.
               With --tiny the config gets the tiny shapes first (use --devices 2 --device-memory 1).

Trailing `section.key=value` overrides apply to every layout (after its own). Each layout runs in its
own process (a clean device, no buffers of the previous one): the XLA flags `run` sets, the step built
as `run` builds it, compile, 2 warm-up steps, then the median of --steps individually synchronized steps
(DESIGN.md §8); it also reports tokens/s and MFU (on GPUs of known peak). The parent sets the prediction
beside the measurement, each with its error in percent: step time, and memory per device against the
allocator's peak. CPU devices report no allocator peak; there the peak of XLA's compiled step
(memory_analysis: arguments + outputs - aliased + temporaries) stands in, marked "(XLA)". Results:
DIR/bench_plan.jsonl (one record per layout) and DIR/bench_plan.md (the table printed last).

The 8B shape is Llama 3 8B (32 layers). On one H200 its fp32 state alone (16 B/param = 128 GB) leaves
no room, so the one-GPU 8B layout of the timing set keeps 8 of the 32 layers (`model.n_layers=8`, said
in its label). The calibration set's 8B row (estimate about 129 GiB per GPU) needs H200s and the allocator's
0.95 share; on H100s it fails for memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 2.0**30

GPU_COMMON = ["data.seq_len=2048", "precision.compute=bfloat16", "model.attention=cudnn", "run.progress=false",
              "train.warmup_steps=2"]
# (label, devices, overrides)
GPU_LAYOUTS = [  # 1B and 8B interleaved, so that a spent time budget costs both alike
    ("1b fsdp1 Z1 save_dots b8", 1, ["model.preset=llama1b", "mesh.fsdp=1", "train.global_batch=8",
                                     "train.remat=save_dots"]),
    ("8b fsdp2 Z3 full b4", 2, ["model.preset=llama3_8b", "mesh.fsdp=2", "train.zero_stage=3",
                                "train.global_batch=4", "train.remat=full"]),
    ("1b fsdp2 Z3 save_dots b16", 2, ["model.preset=llama1b", "mesh.fsdp=2", "train.zero_stage=3",
                                      "train.global_batch=16", "train.remat=save_dots"]),
    ("8b tp2+SP Z1 full b4", 2, ["model.preset=llama3_8b", "mesh.tp=2", "mesh.fsdp=1", "parallel.sequence_parallel=true",
                                 "train.global_batch=4", "train.remat=full"]),
    ("1b tp2+SP save_dots b8", 2, ["model.preset=llama1b", "mesh.tp=2", "mesh.fsdp=1", "parallel.sequence_parallel=true",
                                   "train.global_batch=8", "train.remat=save_dots"]),
    ("8b(8 of 32 layers) fsdp1 Z1 full b4", 1, ["model.preset=llama3_8b", "model.n_layers=8", "mesh.fsdp=1",
                                                "train.global_batch=4", "train.remat=full"]),
    ("1b dp2 Z0 save_dots b16", 2, ["model.preset=llama1b", "mesh.dp=2", "mesh.fsdp=1", "train.zero_stage=0",
                                    "train.global_batch=16", "train.remat=save_dots"]),
    ("1b fsdp1 Z1 none b4", 1, ["model.preset=llama1b", "mesh.fsdp=1", "train.global_batch=4", "train.remat=none"]),
]
# model.attention=auto: the shipped configs ask for cuDNN, which a CPU does not have (auto is the default).
TINY_COMMON = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
               "model.vocab_size=128", "data.seq_len=32", "precision.compute=float32", "run.progress=false",
               "model.attention=auto"]
TINY_LAYOUTS = [
    ("tiny fsdp1 b8", 1, ["mesh.fsdp=1", "train.global_batch=8"]),
    ("tiny fsdp2 Z3 b8", 2, ["mesh.fsdp=2", "train.zero_stage=3", "train.global_batch=8"]),
    ("tiny tp2+SP full b8", 2, ["mesh.tp=2", "mesh.fsdp=1", "parallel.sequence_parallel=true", "train.global_batch=8",
                                "train.remat=full"]),
    ("tiny dp2 save_dots b8", 2, ["mesh.dp=2", "mesh.fsdp=1", "train.zero_stage=0", "train.global_batch=8",
                                  "train.remat=save_dots"]),
    ("tiny fsdp1 accum2 b8", 1, ["mesh.fsdp=1", "train.global_batch=8", "train.grad_accum=2"]),
]
# (label, devices, config file, overrides): the shipped configs as the memory guard estimates them.
CALIBRATION = [
    ("1b config as given b8", 1, "configs/llama1b_h100.yaml", []),
    # 4 sequences per GPU, as the config runs on four. Its estimate (129 GiB) is above the 75% of an H200
    # that jax's allocator takes by default, and the config's comment ran 6 per GPU at 0.95.
    ("8b config fsdp2 b8", 2, "configs/llama3_8b_fsdp.yaml", ["train.global_batch=8", "run.gpu_memory_fraction=0.95"]),
    # validate() asks a pipeline for scanned layers (the stages split the stacked layer axis).
    ("1b config pp2 1f1b accum8 b8", 2, "configs/llama1b_h100.yaml",
     ["mesh.pp=2", "mesh.fsdp=1", "pipeline.schedule=1f1b", "train.grad_accum=8", "train.global_batch=8",
      "model.scan_layers=true"]),
]


@dataclass
class Job:
    """One layout to measure, and what the planner said of it before it ran."""

    label: str
    devices: int
    overrides: list[str]
    config: str | None = None  # YAML file under the overrides (absolute path), or the built-in defaults
    predicted: dict = field(default_factory=dict)  # predicted_step_s, predicted_mem_gib


# -- the child: one layout measured in a process of its own ------------------------------------------

def measure(config: str | None, overrides: list[str], n_devices: int, steps: int) -> dict:
    """Child process: compile and time the step on the first n devices."""
    from meshtrain import xla_flags
    from meshtrain.config import load_config

    cfg = load_config(config, overrides)
    xla_flags.apply_config(cfg)  # as `run` does, before jax starts its backend (flags, allocator share)

    import jax

    from benchtime import time_train_steps
    from meshtrain.launch import validated_mesh
    from meshtrain.metrics import active_params, count_params, flops_per_token, memory_in_use, peak_flops
    from meshtrain.step.state import build_setup, init_state, make_batches
    from meshtrain.step.train_step import make_train_step
    from meshtrain.planning.aot import compile_step

    cfg, mesh = validated_mesh(cfg, n_devices)
    setup = build_setup(cfg, mesh)
    batches = make_batches(setup)
    state, step = init_state(setup), make_train_step(setup)
    batch = [batches.batch(i) for i in range(2)]  # data off the clock
    n_params = count_params(state.params)  # before the step donates the state
    # A backend without allocator statistics (CPU) gets XLA's figure instead, taken before anything runs.
    xla_peak = ({} if jax.devices()[0].memory_stats() else
                {"xla_peak_mem_gib": compile_step(cfg, mesh).memory["peak_bytes"] / GIB})  # what `inspect` reads
    run = time_train_steps(step, state, batch, steps, warmup=2)
    # Tokens/s and MFU as the trainer counts them: 6N (active parameters) + attention, over the mesh's devices.
    tokens = cfg.train.global_batch * cfg.data.seq_len
    flops = flops_per_token(cfg.model, active_params(n_params, cfg.model, cfg.moe), cfg.data.seq_len) * tokens
    peak = peak_flops(jax.devices()[0])
    return dict(step_s=run.median_s, compile_s=run.first_s, loss=float(run.metrics["loss"]), params=n_params,
                tokens_per_s=tokens / run.median_s,
                mfu=flops / run.median_s / mesh.devices.size / peak if peak else None,
                device=jax.devices()[0].device_kind, jax=jax.__version__, **memory_in_use(), **xla_peak)


# -- the parent: which layouts, and what the planner predicts for each ---------------------------------

def as_given(job: Job, rates_name: str) -> dict:
    """The estimate of the config exactly as given: what the memory guard computes before a run."""
    from meshtrain.config import load_config, resolve_mesh, with_mesh
    from meshtrain.planning.search import as_given as estimate_as_given
    from meshtrain.planning.timing import Rates

    cfg = load_config(job.config, job.overrides)
    degrees, _ = resolve_mesh(cfg.mesh, job.devices)
    given, _ = estimate_as_given(with_mesh(cfg, degrees), Rates.preset(rates_name), job.devices,
                                 backend="cpu" if rates_name == "cpu" else "gpu")
    return dict(predicted_step_s=given.time["total_s"], predicted_mem_gib=given.memory.total / GIB)


def set_jobs(name: str, tiny: bool, extra: list[str], rates_name: str) -> list[Job]:
    """A named set (timing, calibration), each layout predicted as given."""
    if name == "timing":
        layouts, common = (TINY_LAYOUTS, TINY_COMMON) if tiny else (GPU_LAYOUTS, GPU_COMMON)
        jobs = [Job(label, n, common + ov + extra) for label, n, ov in layouts]
    else:  # calibration: the configs as given on GPUs; on the CPU the same files and layouts, tiny shapes
        common = TINY_COMMON if tiny else []
        jobs = [Job(("tiny " if tiny else "") + label, n, common + ov + extra, str(REPO / path))
                for label, n, path, ov in CALIBRATION]
    for job in jobs:
        job.predicted = as_given(job, rates_name)
    return jobs


def plan_jobs(a: argparse.Namespace, rates_name: str) -> list[Job]:
    """The search `python -m meshtrain.plan` makes, its K fastest fitting layouts, each predicted by its candidate."""
    from meshtrain.config import load_config
    from meshtrain.planning.search import search
    from meshtrain.planning.timing import Rates

    base = (TINY_COMMON if a.tiny else []) + a.overrides
    config = str(Path(a.config).resolve()) if a.config else None
    cfg = load_config(config, base)  # plan.py's launch.load(..., cpu_defaults=False): the plain defaults
    cands, _ = search(cfg, a.devices, a.device_memory * GIB, Rates.preset(rates_name),
                      backend="cpu" if rates_name == "cpu" else "gpu", top=a.plan_top)
    if not cands:
        raise SystemExit(f"bench_plan: no layout fits {a.devices} devices of {a.device_memory:g} GiB "
                         f"(python -m meshtrain.plan says why)")
    return [Job(f"#{i} {c.layout.label()}", a.devices, base + c.layout.overrides(), config,
                dict(predicted_step_s=c.time["total_s"], predicted_mem_gib=c.memory.total / GIB))
            for i, c in enumerate(cands, 1)]


def run_child(job: Job, a: argparse.Namespace, env: dict, timeout: float) -> dict:
    """Measure one job in a process of its own; the fields it measured, or `failed` with the last error line."""
    spec = json.dumps({"config": job.config, "overrides": job.overrides, "devices": job.devices})
    try:
        proc = subprocess.run([sys.executable, __file__, "--out", a.out, "--steps", str(a.steps), "--child", spec],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s"}
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
    if line is None:
        return {"failed": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(line[7:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="result directory")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes on 2 simulated devices")
    ap.add_argument("--set", choices=("timing", "calibration"), help="named set of layouts (default timing)")
    ap.add_argument("--plan-top", type=int, metavar="K", help="measure the planner's K fastest layouts that fit")
    ap.add_argument("--config", help="YAML config for --plan-top (default: the built-in defaults)")
    ap.add_argument("--devices", type=int, help="devices to plan for (--plan-top)")
    ap.add_argument("--device-memory", type=float, metavar="GIB", help="memory per device, GiB (--plan-top)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (median)")
    ap.add_argument("--rates", default="h200", choices=("h100", "h200"), help="planner rate defaults on GPU")
    ap.add_argument("--budget-s", type=float, default=360,
                    help="start no layout after this many seconds; each stops by budget + 100 s (default fits 8 min)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="applied to every layout, last")
    a = ap.parse_intermixed_args()
    if a.child:  # one measurement, in a process of its own
        spec = json.loads(a.child)
        print("RESULT " + json.dumps(measure(spec["config"], spec["overrides"], spec["devices"], a.steps)), flush=True)
        return 0
    if a.plan_top is not None:
        if a.set or a.devices is None or a.device_memory is None:
            ap.error("--plan-top K takes --devices N and --device-memory GIB, and no --set")
    elif a.config or a.devices or a.device_memory:
        ap.error("--config, --devices and --device-memory go with --plan-top")

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = "cpu" if a.tiny else a.rates
    jobs = plan_jobs(a, rates) if a.plan_top is not None else set_jobs(a.set or "timing", a.tiny, a.overrides, rates)
    env = dict(os.environ)
    n_visible = max(2, a.devices or 0) if a.tiny else _visible_gpus()
    if a.tiny:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n_visible}")
    start, records = time.time(), []
    for job in jobs:
        rec = dict(label=job.label, devices=job.devices, config=job.config, overrides=job.overrides, **job.predicted)
        if job.devices > n_visible:
            rec["skipped"] = f"needs {job.devices} devices, {n_visible} visible"
        elif time.time() - start > a.budget_s:
            rec["skipped"] = f"time budget of {a.budget_s:.0f} s spent"
        else:
            rec.update(run_child(job, a, env, timeout=max(30.0, a.budget_s + 100 - (time.time() - start))))
            rec.update(_errors(rec))
        records.append(rec)
        print(_row(rec), flush=True)
    with (out / "bench_plan.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    table = _table(records, _title(a, rates))
    (out / "bench_plan.md").write_text(table + "\n")
    print("\n" + table)
    return 0


def _visible_gpus() -> int:
    import jax
    return len([d for d in jax.devices() if d.platform == "gpu"]) or jax.device_count()


def _errors(r: dict) -> dict:
    """Prediction against measurement, in percent of the measurement: step time, and memory against the
    allocator's peak (XLA's compiled peak where the backend keeps no allocator statistics)."""
    if "step_s" not in r:
        return {}
    errs = {"error_pct": (r["predicted_step_s"] / r["step_s"] - 1) * 100}
    peak = r.get("peak_mem_gib", r.get("xla_peak_mem_gib"))
    if peak:
        errs["mem_error_pct"] = (r["predicted_mem_gib"] / peak - 1) * 100
    return errs


def _title(a: argparse.Namespace, rates: str) -> str:
    if a.plan_top is not None:
        what = (f"the planner's top {a.plan_top} for {a.devices} devices of {a.device_memory:g} GiB "
                f"({a.config or 'built-in defaults'}), each as its candidate predicts")
    elif a.set == "calibration":
        what = "the memory guard's estimate of each config as given"
    else:
        what = "each layout as given"
    return f"planner ({rates} rates): {what}, against measured (median of {a.steps} timed steps)"


def _row(r: dict) -> str:
    pred = f"| {r['label']} | {r['devices']} | {r['predicted_step_s'] * 1e3:.1f} |"
    if "step_s" not in r:
        why = r.get("skipped") or r.get("failed")
        return f"{pred} - | {why} | - | - | {r['predicted_mem_gib']:.3g} | - | - |"
    if "peak_mem_gib" in r:
        peak = f"{r['peak_mem_gib']:.3g}"
    elif "xla_peak_mem_gib" in r:
        peak = f"{r['xla_peak_mem_gib']:.3g} (XLA)"
    else:
        peak = "-"
    mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "-"
    mem_err = f"{r['mem_error_pct']:+.1f}%" if "mem_error_pct" in r else "-"
    return (f"{pred} {r['step_s'] * 1e3:.1f} | {r['error_pct']:+.1f}% | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{r['predicted_mem_gib']:.3g} | {peak} | {mem_err} |")


def _table(records: list[dict], title: str) -> str:
    head = (f"{title}\n\n"
            "| layout | GPUs | predicted ms | measured ms | error | tokens/s | MFU | predicted GiB | measured peak GiB "
            "| memory error |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [_row(r) for r in records])


if __name__ == "__main__":
    sys.exit(main())
