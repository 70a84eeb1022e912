"""Time meshtrain's jitted train step the way the peers time theirs: warm up, then the median of
individually synchronized steps. Prints one line (and appends it as JSON to --out).

  python scripts/bench_step.py [--config configs/llama1b_h100.yaml] [key=value ...] [--steps 10] [--out f.jsonl]
"""
from __future__ import annotations

import argparse
import json

import jax

from benchtime import time_train_steps
from meshtrain import xla_flags
from meshtrain.config import load_config, validate, with_mesh
from meshtrain.mesh import build_mesh
from meshtrain.metrics import count_params, flops_per_token, memory_in_use, peak_flops
from meshtrain.step.state import build_setup, init_state, make_batches
from meshtrain.step.train_step import make_train_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()  # overrides may stand before and after the options
    cfg = load_config(a.config, a.overrides)
    xla_flags.apply_config(cfg)  # as `python -m meshtrain.run` does, before jax starts its backend
    degrees = validate(cfg, jax.device_count())
    cfg = with_mesh(cfg, degrees)
    mesh = build_mesh(degrees)
    setup = build_setup(cfg, mesh)
    batches = make_batches(setup)
    state = init_state(setup)
    step = make_train_step(setup)
    batch = [batches.batch(i) for i in range(4)]  # data off the clock: the step alone is timed
    run = time_train_steps(step, state, batch, a.steps)
    state, m, times, compile_s, dt = run.state, run.metrics, run.times, run.first_s, run.median_s
    n = count_params(state.params)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    flops = flops_per_token(cfg.model, n, cfg.data.seq_len) * tokens
    peak = peak_flops(jax.devices()[0])
    ndev = jax.device_count()
    rec = dict(label=a.label, overrides=a.overrides, params=n, step_ms=dt * 1e3, step_ms_min=min(times) * 1e3,
               step_ms_back_to_back=run.back_to_back_s * 1e3, dispatch_ms=run.dispatch_s * 1e3,
               tokens_per_s=tokens / dt, mfu=flops / dt / ndev / peak if peak else None,
               compile_s=compile_s, loss=float(m["loss"]), device=jax.devices()[0].device_kind,
               jax=jax.__version__, **memory_in_use())
    mfu = f"MFU {rec['mfu'] * 100:.1f}%" if rec["mfu"] else ""
    print(f"meshtrain {a.label} params {n / 1e9:.3f}B compile+first {compile_s:.1f}s step {dt * 1e3:.1f} ms "
          f"(back to back {run.back_to_back_s * 1e3:.1f} ms) "
          f"tok/s {tokens / dt:,.0f} {mfu} peak_mem {rec.get('peak_mem_gib', 0):.1f} GiB loss {rec['loss']:.3f}",
          flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
