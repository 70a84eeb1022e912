"""MoE step benchmark: an MoE model, the same model with its expert exchanges replaced by local copies
(to price the all-to-alls), and a dense model of the same active size, each timed as the peers are
timed (warm-up, then the median of individually synchronized steps). Writes DIR/bench_moe.json and
DIR/bench_moe.md and prints a table last.

  # one GPU: olmoe_1b7b, then the dense model of equal active size (d_ff = top_k · d_ff_expert)
  PYTHONPATH=. python scripts/bench_moe.py --devices 1 --out results/moe1
  # two GPUs: experts over ep=2 (with the exchange priced), the dense model over fsdp=2
  PYTHONPATH=. python scripts/bench_moe.py --devices 2 --out results/moe2
  # CPU smoke run of the same code path (simulated devices, tiny_moe)
  python scripts/bench_moe.py --tiny --devices 2 --out /tmp/moe_tiny
  # the experts' grouped GEMM alone (one GPU): Pallas gmm vs jax.lax.ragged_dot at the OLMoE shape
  PYTHONPATH=. python scripts/bench_moe.py --moe-gemm --out results/moe_gemm

The exchange's share is measured by timing: the `exchange-free` row runs the same step with every
collective of parallel/expert.py (all-to-alls, or the all-gathers and the reduce-scatter) replaced by a
local copy of the same shape, so the compute and memory traffic stay and only the communication goes (its numbers are
not a valid training step). share = 1 - t(exchange-free) / t(MoE). The compiled HLO's all-to-all ops
and their operand sizes are listed beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import re
import sys
import time
from pathlib import Path
from unittest import mock


DEFAULT_GEMM_SHAPE = "65536,64,2048,1024"  # OLMoE: 8192 tokens x top-8 rows, 64 experts, d 2048, ffn 1024


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for bench_moe.json and bench_moe.md")
    ap.add_argument("--devices", type=int, default=1, help="1: one device; N > 1: experts over ep=N")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny_moe, short sequences, 3 steps")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration (median reported)")
    ap.add_argument("--skip", default="", help="comma list of rows to skip: moe, exchange_free, dense")
    ap.add_argument("--moe-gemm", action="store_true",
                    help="only the grouped-GEMM micro-benchmark (gmm vs ragged_dot, forward and forward+backward)")
    ap.add_argument("--gemm-shape", default=DEFAULT_GEMM_SHAPE,
                    help="--moe-gemm M,G,K,N: rows (tokens x top-k), groups (experts), in and out width")
    ap.add_argument("--gemm-blocks", default="", help="--moe-gemm: GroupedMatmulBlockSizes fields, e.g. "
                                                      "block_m=64,block_k=32,num_warps=4")
    ap.add_argument("--gemm-impls", default="pallas,ragged_dot", help="--moe-gemm: which to time")
    ap.add_argument("overrides", nargs="*", help="section.key=value applied to every row")
    return ap.parse_intermixed_args()  # overrides may stand before and after the options


def base_overrides(a: argparse.Namespace) -> list[str]:
    if a.tiny:
        return ["model.preset=tiny_moe", "data.seq_len=64", f"train.global_batch={4 * a.devices}",
                "precision.compute=bfloat16", "train.steps=100", "run.progress=false"]
    # OLMoE-1B-7B: 6.9B parameters (fp32 master + Adam ≈ 110 GB on one device), so recompute blocks.
    return ["model.preset=olmoe_1b7b", "data.seq_len=2048", f"train.global_batch={4 * a.devices}",
            "precision.compute=bfloat16", "train.remat=full", "train.steps=100", "run.progress=false"]


def rows(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    n = a.devices
    moe_mesh = ["mesh.fsdp=1", f"mesh.ep={n}"]
    dense_mesh = [f"mesh.fsdp={n}", "mesh.ep=1"]
    out = [("moe", moe_mesh)]
    if n > 1:
        out.append(("exchange_free", moe_mesh))
    out.append(("dense", dense_mesh + ["moe.n_experts=0", "DENSE_FF"]))
    skip = set(filter(None, a.skip.split(",")))
    return [(name, o) for name, o in out if name not in skip]


@contextlib.contextmanager
def exchanges_local(ep: int):
    """While tracing: every all-to-all, all-gather and reduce-scatter of the expert exchange becomes a local
    copy of the same shape, so the step keeps its compute and memory traffic but moves nothing between
    devices. Only these explicit calls are patched: the collectives the partitioner inserts (the gradient
    reduction over ep, for one) stay, and the bench's configs call no other explicit collective."""
    import jax
    import jax.numpy as jnp

    def all_to_all(x, axis_name, split_axis, concat_axis, tiled=False, **kw):
        return x  # dispatch uses tiled split 0 / concat 0: the result has the operand's shape

    def all_gather(x, axis_name, *, axis=0, tiled=False, **kw):
        return jnp.concatenate([x] * ep, axis) if tiled else jnp.stack([x] * ep, axis)

    def psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False, **kw):
        return jax.lax.slice_in_dim(x, 0, x.shape[scatter_dimension] // ep, axis=scatter_dimension)

    with mock.patch.object(jax.lax, "all_to_all", all_to_all), \
            mock.patch.object(jax.lax, "all_gather", all_gather), \
            mock.patch.object(jax.lax, "psum_scatter", psum_scatter):
        yield


def hlo_all_to_alls(compiled_text: str) -> list[str]:
    """The all-to-all, all-gather and reduce-scatter instructions of a compiled HLO module: their result shapes."""
    found = []
    for line in compiled_text.splitlines():
        # GPUs run collectives asynchronously: count the `-start` half, never the `-done` half.
        m = re.search(r"=\s*(.+?)\s+(all-to-all|all-gather|reduce-scatter)(-start)?\(", line)
        if m:
            found.append(f"{m.group(2)} -> {m.group(1)}")
    return found


def measure(name: str, overrides: list[str], a: argparse.Namespace) -> dict:
    import jax

    from benchtime import time_train_steps
    from meshtrain.config import load_config, validate, with_mesh
    from meshtrain.mesh import build_mesh
    from meshtrain.metrics import active_params, count_params, flops_per_token, memory_in_use, peak_flops
    from meshtrain.step.state import build_setup, init_state, make_batches
    from meshtrain.step.train_step import make_train_step

    cfg = load_config(None, overrides)
    degrees = validate(cfg, a.devices)
    cfg = with_mesh(cfg, degrees)
    mesh = build_mesh(degrees, jax.devices()[: a.devices])
    setup = build_setup(cfg, mesh)
    batches = make_batches(setup)
    state = init_state(setup)
    step = make_train_step(setup)
    batch = [batches.batch(i) for i in range(4)]  # data off the clock
    t0 = time.perf_counter()
    with exchanges_local(a.devices) if name == "exchange_free" else contextlib.nullcontext():
        compiled = step.lower(state, batch[0]).compile()
    step = compiled  # the timed steps run exactly what was compiled (and patched) here
    compile_s = time.perf_counter() - t0
    a2a = hlo_all_to_alls(compiled.as_text())
    run = time_train_steps(step, state, batch, a.steps, warmup=2)  # the first call is a third warm-up
    state, m, times, dt = run.state, run.metrics, run.times, run.median_s
    n_params = count_params(state.params)
    n_active = active_params(n_params, cfg.model, cfg.moe)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    flops = flops_per_token(cfg.model, n_active, cfg.data.seq_len) * tokens
    peak = peak_flops(jax.devices()[0])
    rec = dict(row=name, overrides=overrides, devices=a.devices, mesh={k: v for k, v in degrees.items() if v > 1},
               params=n_params, active_params=n_active, step_ms=dt * 1e3, step_ms_min=min(times) * 1e3,
               tokens_per_s=tokens / dt, mfu_active=flops / dt / a.devices / peak if peak else None,
               compile_s=compile_s, loss=float(m["loss"]), all_to_alls=a2a,
               moe_load_max=float(m["moe_load_max"]) if "moe_load_max" in m else None,
               device=jax.devices()[0].device_kind, jax=jax.__version__, **memory_in_use())
    del state, step, compiled, batch
    gc.collect()
    return rec


def bench_gemm(a: argparse.Namespace, out_dir: Path) -> None:
    """The experts' grouped GEMM alone: out [M, N] = rows of group g @ W[g] (bf16, fp32 accumulation),
    forward and forward+backward (d_lhs, d_rhs), for two group-size draws: even (M/G each) and skewed
    (Dirichlet(1) shares, the 2nd group emptied). Useful FLOPs: 2·M·K·N per GEMM, 3 GEMMs fwd+bwd."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchtime import median_seconds
    from pallas_kernels import GroupedMatmulBlockSizes, gmm

    shape = "512,8,64,64" if a.tiny and a.gemm_shape == DEFAULT_GEMM_SHAPE else a.gemm_shape  # CPU: interpret
    m, g, k, n = (int(v) for v in shape.split(","))
    blocks = GroupedMatmulBlockSizes(**{kv.split("=")[0]: int(kv.split("=")[1])
                                        for kv in filter(None, a.gemm_blocks.split(","))})
    impls = {"pallas": lambda x, w, s: gmm(x, w, s, block_sizes=blocks),
             "ragged_dot": lambda x, w, s: jax.lax.ragged_dot(x, w, s)}
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    rng = np.random.default_rng(0)
    skewed = rng.multinomial(m, rng.dirichlet(np.ones(g)))
    skewed[0], skewed[1] = skewed[0] + skewed[1], 0
    draws = {"even": np.full(g, m // g) + (np.arange(g) < m % g), "skewed": skewed}
    flops = 2.0 * m * k * n
    results, outs = [], {}
    for draw, sizes in draws.items():
        s = jnp.asarray(sizes, jnp.int32)
        for name in filter(None, a.gemm_impls.split(",")):
            f = impls[name]
            fwd = jax.jit(f)
            fwd_bwd = jax.jit(lambda x, w, s, dy, f=f: jax.vjp(lambda x, w: f(x, w, s), x, w)[1](dy))
            rec = dict(impl=name, groups=draw, shape=dict(M=m, G=g, K=k, N=n), max_group=int(sizes.max()),
                       blocks=dataclasses.asdict(blocks) if name == "pallas" else None,
                       device=jax.devices()[0].device_kind, jax=jax.__version__)
            try:
                outs[draw, name] = np.asarray(fwd(x, w, s), np.float32)
                rec["fwd_ms"] = median_seconds(fwd, x, w, s, calls=a.steps, warmup=3) * 1e3
                rec["fwd_bwd_ms"] = median_seconds(fwd_bwd, x, w, s, dy, calls=a.steps, warmup=3) * 1e3
                rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
                rec["fwd_bwd_tflops"] = 3 * flops / rec["fwd_bwd_ms"] / 1e9
            except Exception as e:  # ragged_dot's dense rewrite may not fit: keep the other rows
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results.append(rec)
            print(json.dumps(rec), flush=True)
            gc.collect()
    for rec in results:  # compared once both outputs are there (pallas runs first)
        ref, got = outs.get((rec["groups"], "ragged_dot")), outs.get((rec["groups"], rec["impl"]))
        if rec["impl"] != "ragged_dot" and ref is not None and got is not None:
            rec["rel_err_vs_ragged_dot"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    (out_dir / "bench_moe_gemm.json").write_text(json.dumps(results, indent=1))
    lines = [f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}, "
             f"M={m} G={g} K={k} N={n} bf16, blocks {blocks}", "",
             "| impl | groups | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | rel err vs ragged_dot |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['groups']} | error: {r['error'][:120]} | | | | |")
            continue
        err = f"{r['rel_err_vs_ragged_dot']:.1e}" if "rel_err_vs_ragged_dot" in r else "-"
        lines.append(f"| {r['impl']} | {r['groups']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.0f} | {err} |")
    (out_dir / "bench_moe_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    a = parse_args()
    if a.tiny and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={a.devices}").strip()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax

    from meshtrain.config import load_config

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.moe_gemm:
        return bench_gemm(a, out_dir)
    base = base_overrides(a)
    probe = load_config(None, base + a.overrides)
    dense_ff = f"model.d_ff={probe.moe.top_k * probe.moe.expert_ffn(probe.model)}"
    results = []
    for name, extra in rows(a):
        overrides = base + [dense_ff if o == "DENSE_FF" else o for o in extra] + a.overrides
        t = time.perf_counter()
        try:
            rec = measure(name, overrides, a)
        except Exception as e:  # one failing row (e.g. out of memory) must not lose the others
            rec = dict(row=name, overrides=overrides, error=f"{type(e).__name__}: {str(e)[:400]}")
        rec["wall_s"] = time.perf_counter() - t
        results.append(rec)
        print(json.dumps(rec), flush=True)
        (out_dir / "bench_moe.json").write_text(json.dumps(results, indent=1))
    by = {r["row"]: r for r in results}
    if "moe" in by and "exchange_free" in by and "step_ms" in by["moe"] and "step_ms" in by["exchange_free"]:
        share = 1 - by["exchange_free"]["step_ms"] / by["moe"]["step_ms"]
        by["moe"]["exchange_share"] = share
        (out_dir / "bench_moe.json").write_text(json.dumps(results, indent=1))
    lines = [f"device {jax.devices()[0].device_kind} x{a.devices}, jax {jax.__version__}, "
             f"{time.strftime('%Y-%m-%d')}, base overrides: {' '.join(base + a.overrides)}", "",
             "| row | mesh | params | active | step ms | tokens/s | MFU (active) | peak GiB | exchange share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:120]} | | | | | | | |")
            continue
        mfu = f"{r['mfu_active'] * 100:.1f}%" if r.get("mfu_active") else "-"
        share = f"{r['exchange_share'] * 100:.1f}%" if "exchange_share" in r else "-"
        lines.append(f"| {r['row']} | {r['mesh'] or 'one device'} | {r['params'] / 1e6:,.1f}M | "
                     f"{r['active_params'] / 1e6:,.1f}M | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r.get('peak_mem_gib', 0):.1f} | {share} |")
    a2a = next((r["all_to_alls"] for r in results if r.get("row") == "moe" and "all_to_alls" in r), [])
    lines += ["", f"collectives of the exchange in the compiled MoE step ({len(a2a)}): " + "; ".join(sorted(set(a2a)))[:1500]]
    (out_dir / "bench_moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
