"""What a `lax.switch` inside a scan costs on one GPU (the pipeline executor runs one per lane and tick).

A loop of N ticks whose body runs two branches' worth of work, K (matmul [D, D] bf16, tanh, add) each, either
through two switches indexed by the scan's input, as the executor's are, or inline. Prints JSON: the median ms of
each (twice, interleaved) and the cost of one switch in microseconds.

  PYTHONPATH=. python3 scripts/bench_switch.py [--ticks 64] [--d 2048] [--kernels 12]
  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python3 scripts/bench_switch.py   # CUDA graphs off
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax


def program(kind: str, k: int):
    def work(x, w, scale):
        for _ in range(k):
            x = jnp.tanh(x @ w) * scale + x
        return x

    def tick(carry, index):
        x, w = carry
        branches = [lambda x: work(x, w, 0.5), lambda x: work(x, w, 0.25)]
        if kind == "switch":
            x = lax.switch(index[0], branches, x)
            x = lax.switch(index[1], branches, x)
        else:
            x = branches[1](branches[0](x))
        return (x, w), None

    @jax.jit
    def run(x, w, index):
        return lax.scan(tick, (x, w), index)[0][0]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ticks", type=int, default=64)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--kernels", type=int, default=12, help="matmuls per branch")
    a = ap.parse_args()
    x = jax.random.normal(jax.random.key(0), (a.d, a.d), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (a.d, a.d), jnp.bfloat16) * 0.01
    index = jnp.stack([jnp.arange(a.ticks) % 2, (jnp.arange(a.ticks) + 1) % 2], axis=1).astype(jnp.int32)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for kind in ("inline", "switch", "inline", "switch"):
        run = program(kind, a.kernels)
        for _ in range(2):
            run(x, w, index).block_until_ready()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            run(x, w, index).block_until_ready()
            times.append(time.perf_counter() - t0)
        out.setdefault(f"{kind}_ms", []).append(statistics.median(times) * 1e3)
    out["per_switch_us"] = (min(out["switch_ms"]) - min(out["inline_ms"])) / (2 * a.ticks) * 1e3
    print(json.dumps(out))


if __name__ == "__main__":
    main()
