"""The planner's predicted step time (and memory) against measured ones, for layouts of the 1B and 8B
shapes on one or two GPUs. One command, one result directory:

  PYTHONPATH=. python scripts/bench_plan.py --out DIR            # 2xH200 (layouts needing 2 GPUs skip on 1)
  PYTHONPATH=. python scripts/bench_plan.py --out DIR --tiny     # CPU smoke run, tiny shapes, 2 simulated devices

Each layout runs in its own process (a clean device, no buffers of the previous one): build the step
as `run` does, compile, 2 warm-up steps, then the median of --steps individually synchronized steps
(DESIGN.md §8). The parent prints the planner's estimate beside it. Results: DIR/bench_plan.jsonl (one
record per layout) and DIR/bench_plan.md (the table printed last).

The 8B shape is Llama 3 8B (32 layers). On one H200 its fp32 state alone (16 B/param = 128 GB) leaves
no room, so the one-GPU 8B layout keeps 8 of the 32 layers (`model.n_layers=8`, said in its label).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
TINY_COMMON = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
               "model.vocab_size=128", "data.seq_len=32", "precision.compute=float32", "run.progress=false"]
TINY_LAYOUTS = [
    ("tiny fsdp1 b8", 1, ["mesh.fsdp=1", "train.global_batch=8"]),
    ("tiny fsdp2 Z3 b8", 2, ["mesh.fsdp=2", "train.zero_stage=3", "train.global_batch=8"]),
    ("tiny tp2+SP full b8", 2, ["mesh.tp=2", "mesh.fsdp=1", "parallel.sequence_parallel=true", "train.global_batch=8",
                                "train.remat=full"]),
    ("tiny dp2 save_dots b8", 2, ["mesh.dp=2", "mesh.fsdp=1", "train.zero_stage=0", "train.global_batch=8",
                                  "train.remat=save_dots"]),
    ("tiny fsdp1 accum2 b8", 1, ["mesh.fsdp=1", "train.global_batch=8", "train.grad_accum=2"]),
]


def measure(overrides: list[str], n_devices: int, steps: int) -> dict:
    """Child process: compile and time the step on the first n devices."""
    import jax

    from benchtime import time_train_steps
    from meshtrain.config import build_config
    from meshtrain.launch import validated_mesh
    from meshtrain.metrics import memory_in_use
    from meshtrain.step.state import build_setup, init_state, make_batches
    from meshtrain.step.train_step import make_train_step

    cfg, mesh = validated_mesh(build_config({}, overrides), n_devices)
    setup = build_setup(cfg, mesh)
    batches = make_batches(setup)
    state, step = init_state(setup), make_train_step(setup)
    batch = [batches.batch(i) for i in range(2)]  # data off the clock
    run = time_train_steps(step, state, batch, steps, warmup=2)
    return dict(step_s=run.median_s, compile_s=run.first_s, loss=float(run.metrics["loss"]),
                device=jax.devices()[0].device_kind, jax=jax.__version__, **memory_in_use())


def predict(overrides: list[str], n_devices: int, rates_name: str) -> dict:
    from meshtrain.config import build_config, resolve_mesh, with_mesh
    from meshtrain.planning.search import as_given
    from meshtrain.planning.timing import Rates

    cfg = build_config({}, overrides)
    degrees, _ = resolve_mesh(cfg.mesh, n_devices)
    given, _ = as_given(with_mesh(cfg, degrees), Rates.preset(rates_name), n_devices,
                        backend="cpu" if rates_name == "cpu" else "gpu")
    return dict(predicted_step_s=given.time["total_s"], predicted_mem_gib=given.memory.total / 2**30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="result directory")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes on 2 simulated devices")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (median)")
    ap.add_argument("--rates", default="h200", choices=("h100", "h200"), help="planner rate defaults on GPU")
    ap.add_argument("--budget-s", type=float, default=360,
                    help="start no layout after this many seconds; each stops by budget + 100 s (default fits 8 min)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one measurement, in a process of its own
        spec = json.loads(a.child)
        print("RESULT " + json.dumps(measure(spec["overrides"], spec["devices"], a.steps)), flush=True)
        return 0

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    layouts, common = (TINY_LAYOUTS, TINY_COMMON) if a.tiny else (GPU_LAYOUTS, GPU_COMMON)
    rates = "cpu" if a.tiny else a.rates
    env = dict(os.environ)
    if a.tiny:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    n_visible = 2 if a.tiny else _visible_gpus()
    start, records = time.time(), []
    for label, n, ov in layouts:
        overrides = common + ov
        rec = dict(label=label, devices=n, overrides=overrides, **predict(overrides, n, rates))
        if n > n_visible:
            rec["skipped"] = f"needs {n} devices, {n_visible} visible"
        elif time.time() - start > a.budget_s:
            rec["skipped"] = f"time budget of {a.budget_s:.0f} s spent"
        else:
            spec = json.dumps({"overrides": overrides, "devices": n})
            left = max(30.0, a.budget_s + 100 - (time.time() - start))
            try:
                proc = subprocess.run([sys.executable, __file__, "--out", a.out, "--steps", str(a.steps),
                                       "--child", spec], env=env, capture_output=True, text=True, timeout=left)
                line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
                if line:
                    rec.update(json.loads(line[7:]))
                    rec["error_pct"] = (rec["predicted_step_s"] / rec["step_s"] - 1) * 100
                else:
                    rec["failed"] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            except subprocess.TimeoutExpired:
                rec["failed"] = f"timed out after {left:.0f} s"
        records.append(rec)
        print(_row(rec), flush=True)
    with (out / "bench_plan.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    table = _table(records, rates)
    (out / "bench_plan.md").write_text(table + "\n")
    print("\n" + table)
    return 0


def _visible_gpus() -> int:
    import jax
    return len([d for d in jax.devices() if d.platform == "gpu"]) or jax.device_count()


def _row(r: dict) -> str:
    if "step_s" in r:
        mem = f"{r.get('peak_mem_gib', float('nan')):.1f}" if "peak_mem_gib" in r else "-"
        return (f"| {r['label']} | {r['devices']} | {r['predicted_step_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
                f"{r['error_pct']:+.1f}% | {r['predicted_mem_gib']:.3g} | {mem} |")
    why = r.get("skipped") or r.get("failed")
    return f"| {r['label']} | {r['devices']} | {r['predicted_step_s'] * 1e3:.1f} | - | {why} | " \
           f"{r['predicted_mem_gib']:.3g} | - |"


def _table(records: list[dict], rates: str) -> str:
    head = (f"planner ({rates} rates) against measured step time, median of timed steps\n\n"
            "| layout | GPUs | predicted ms | measured ms | error | predicted GiB | measured peak GiB |\n"
            "|---|---|---|---|---|---|---|")
    return "\n".join([head] + [_row(r) for r in records])


if __name__ == "__main__":
    sys.exit(main())
