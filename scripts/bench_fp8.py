"""bf16 against each fp8 recipe on one GPU: train-step time, memory, loss after N steps, and which GEMMs
each recipe compiled to; plus one 8192^3 GEMM per recipe. Writes results.json and results.md to --out and
prints the table last.

  PYTHONPATH=. python scripts/bench_fp8.py --out DIR --shapes 1b             # 4 runs + the GEMM benchmark
  PYTHONPATH=. python scripts/bench_fp8.py --out DIR --shapes 8b --no-gemm    # 4 runs
  PYTHONPATH=. python scripts/bench_fp8.py --out DIR --tiny --steps 5         # CPU smoke run, tiny shapes
  PYTHONPATH=. python scripts/bench_fp8.py --out DIR --shapes ''              # the GEMM benchmark alone
  ... --profile 40:43                    # also a time-by-category table of steps 40-42 of every run

Measured on one H100 (2026-11-25, --steps 96): a 1B run takes 60-135 s (state ready after ~10 s, the
unrolled step compiles in 20-35 s for bf16 and 40-85 s for the fp8 recipes), an 8B-shaped run 40-55 s;
one shape per device call stays within 8 minutes with the default --timeout.

Shapes: `1b` is configs/llama1b_h100.yaml (24 layers, d_model 2048, seq 2048, batch 8); `8b` is a Llama-3-8B
stack cut to --layers-8b layers (d_model 4096, 32/8 heads, ffn 14336, vocab 128256, seq 4096, batch
--batch-8b) so that it fits one 80 GB GPU with fp32 master weights and Adam. Every (shape, recipe) runs in
its own process, so peak memory is its own and an OOM loses one row.

Timing: compile, 4 warm-up steps, then --steps steps dispatched back to back as the trainer runs them, in
blocks of --block steps each timed from its first dispatch to its last result; the step time is the
median over blocks (DESIGN.md §8). The loss is the one after --steps + 4 steps on the same data for every
recipe (synthetic, or --data). GEMMs: counts by kind in the optimized HLO (gemm_report in
meshtrain/planning/hlo.py): fp8 GEMMs, how many are K-major, bf16 GEMMs left.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPES = ("bf16", "fp8", "fp8_delayed", "fp8_blockwise")
SHAPES = {
    "1b": ("configs/llama1b_h100.yaml", []),
    "8b": (None, ["model.preset=llama3_8b", "data.seq_len=4096", "model.attention=auto", "train.remat=save_dots",
                  "train.lr=3e-4", "train.warmup_steps=10", "precision.compute=bfloat16", "mesh.fsdp=-1"]),
}
TINY = ["model.preset=tiny", "data.seq_len=64", "train.global_batch=4", "model.attention=reference",
        "model.scan_layers=true", "mesh.fsdp=-1"]


T_START = time.perf_counter()  # the child's start: phases are timed from here


def phase(what: str) -> None:
    """A progress line the parent keeps (in the record, or in the error if this process runs out of time):
    where a slow start-up goes."""
    print(f"PHASE {what} at {time.perf_counter() - T_START:.1f} s", flush=True)


def one_run(a) -> dict:
    """Child process: build, compile, time and train one (shape, recipe)."""
    from meshtrain import xla_flags

    xla_flags.apply(xla_flags.flags_for(a.recipe))  # as `python -m meshtrain.run` does, before jax starts its backend
    import jax
    import numpy as np

    jax.devices()  # starts the backend
    phase("backend up")

    from meshtrain.config import load_config, profile_range, validate, with_mesh
    from meshtrain.planning.hlo import gemm_report
    from meshtrain.mesh import build_mesh
    from meshtrain.metrics import count_params, flops_per_token, memory_in_use, peak_flops
    from meshtrain.profile.table import format_table, profile_report
    from meshtrain.profile.trace import STEP_MARKER
    from meshtrain.step.state import build_setup, init_state, make_batches
    from meshtrain.step.train_step import make_train_step

    path, overrides = SHAPES[a.shape]
    overrides = list(overrides)
    if a.shape == "8b":
        overrides += [f"model.n_layers={a.layers_8b}", f"train.global_batch={a.batch_8b}"]
    if a.tiny:
        path, overrides = None, list(TINY)
    if a.data:
        overrides += ["data.source=file", f"data.path={a.data}"]
    steps_total = a.steps + 4
    overrides += [f"precision.matmul={a.recipe}", f"train.steps={steps_total}", "run.progress=false", *a.overrides]
    cfg = load_config(path, overrides)
    degrees = validate(cfg, jax.device_count())
    cfg = with_mesh(cfg, degrees)
    setup = build_setup(cfg, build_mesh(degrees))
    batches = make_batches(setup)
    phase("setup built")
    state = jax.block_until_ready(init_state(setup))
    phase("state ready (init compiled and run)")
    step = make_train_step(setup)
    t0 = time.perf_counter()
    lowered = step.lower(state, batches.batch(0))
    phase("step lowered")
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    phase("step compiled")
    hlo = compiled.as_text()
    gemms = gemm_report(hlo)
    out_dir = Path(a.out)
    with gzip.open(out_dir / f"hlo_{a.shape}_{a.recipe}.txt.gz", "wt") as f:
        f.write(hlo)
    mem = compiled.memory_analysis()
    window = profile_range(a.profile) if a.profile else (steps_total, steps_total)
    trace_dir = out_dir / f"trace_{a.shape}_{a.recipe}"
    # Steps run as the trainer runs them, dispatched back to back, so the host's dispatch and the next
    # batch overlap the device's work; each block of --block steps is timed from its first dispatch to
    # its last result. The warm-up steps and the profiled window are blocks of their own.
    edges = sorted({*range(0, 5), *range(4, steps_total, a.block), *window, steps_total}
                   & set(range(steps_total + 1)))
    blocks, losses = [], []
    for lo, hi in zip(edges, edges[1:]):
        if a.profile and lo == window[0]:
            jax.profiler.start_trace(str(trace_dir))
        t = time.perf_counter()
        pending = []
        for i in range(lo, hi):
            with jax.profiler.StepTraceAnnotation(STEP_MARKER, step_num=i):
                state, m = compiled(state, batches.batch(i))
            pending.append(m["loss"])
        losses += [float(x) for x in pending]  # waits for the block's last step
        blocks.append((lo, hi, (time.perf_counter() - t) / (hi - lo)))
        if a.profile and hi == window[1]:
            jax.profiler.stop_trace()
        if hi in (1, 4):
            phase(f"step {hi - 1} done")
    # Traced steps run slower (the profiler's own work) and stay out of the median.
    timed = [dt for lo, hi, dt in blocks if lo >= 4 and not window[0] <= lo < window[1]] or [b[2] for b in blocks]
    dt = statistics.median(timed)
    profile = None
    if a.profile:
        report = profile_report(trace_dir, top_kernels=40, program=hlo)
        profile = dict(steps=a.profile, table=format_table(report), categories=report["categories"],
                       top_kernels=report["top_kernels"])
        shutil.rmtree(trace_dir)  # the table is what comes back; a trace is tens of MB
    n = count_params(state.params)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    flops = flops_per_token(cfg.model, n, cfg.data.seq_len) * tokens
    peak = peak_flops(jax.devices()[0])
    return dict(shape=a.shape, recipe=a.recipe, params=n, layers=cfg.model.n_layers, tokens_per_step=tokens,
                compile_s=compile_s, step_ms=dt * 1e3, step_ms_min=min(timed) * 1e3, block=a.block,
                tokens_per_s=tokens / dt,
                mfu_bf16_peak=flops / dt / peak if peak else None, loss_first=losses[0], loss_last=losses[-1],
                steps=steps_total, nonfinite=int(not np.isfinite(losses[-1])),
                temp_gib=getattr(mem, "temp_size_in_bytes", 0) / 2 ** 30 if mem else None, gemms=gemms,
                profile=profile,
                device=jax.devices()[0].device_kind, jax=jax.__version__, **memory_in_use())


def gemm_bench(a) -> list[dict]:
    """One M=N=K GEMM per recipe: forward only and forward+backward, TFLOP/s (2MNK per GEMM)."""
    import jax
    import jax.numpy as jnp

    from meshtrain import fp8
    from meshtrain.planning.hlo import gemm_report
    from meshtrain.precision import Precision

    n = 256 if a.tiny else 8192
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), jnp.bfloat16)
    w = jax.random.normal(kw, (n, n), jnp.float32) * 0.02
    xq, wq_nk = x.astype(fp8.E4M3), w.T.astype(fp8.E4M3)
    rows = []

    def timed(name, fn, args, gemms):
        fn = jax.jit(fn)
        hlo = gemm_report(fn.lower(*args).compile().as_text())
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        meds = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(10):
                out = fn(*args)
            jax.block_until_ready(out)
            meds.append((time.perf_counter() - t) / 10)
        dt = statistics.median(meds)
        rows.append(dict(name=name, n=n, ms=dt * 1e3, tflops=gemms * 2 * n ** 3 / dt / 1e12, gemms=hlo))

    timed("raw e4m3 dot, K-major (x . w^T)", lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16), (xq, wq_nk), 1)
    timed("raw e4m3 dot, weight contracting on dim 0", lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16), (xq, wq_nk.T), 1)
    for recipe in RECIPES:
        policy = Precision.from_names("bfloat16", matmul=recipe)
        meta = fp8.init_history(16) if recipe == "fp8_delayed" else None
        fwd = lambda x, w, meta, p=policy: p.einsum("md,dn->mn", x, w, site="mlp.w_up", meta=meta)  # noqa: E731
        timed(f"{recipe} forward (quantize + GEMM)", fwd, (x, w, meta), 1)
        # A loss that needs y (a plain sum would let XLA drop the forward GEMM from the gradient program).
        loss = lambda x, w, meta, f=fwd: jnp.sum(jnp.square(f(x, w, meta).astype(jnp.float32)))  # noqa: E731
        timed(f"{recipe} forward + backward (3 GEMMs)", jax.grad(loss, argnums=(0, 1, 2)), (x, w, meta), 3)
    return rows


def table(runs: list[dict], gemm_rows: list[dict]) -> str:
    lines = ["| shape | recipe | step ms | tokens/s | vs bf16 | peak GiB | loss after | fp8 GEMMs (K-major) | bf16 GEMMs |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {r["shape"]: r for r in runs if r.get("recipe") == "bf16" and "error" not in r}
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['recipe']} | failed: {r['error'][-120:]} |||||||")
            continue
        b = base.get(r["shape"])
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.3f}x" if b else "-"
        g = r["gemms"]
        lines.append(f"| {r['shape']} ({r['layers']} layers) | {r['recipe']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {speed} | {r.get('peak_mem_gib', float('nan')):.1f} | "
                     f"{r['loss_last']:.4f} ({r['steps']} steps) | {g['fp8']} ({g['fp8_k_major']}) | {g['bf16']} |")
    lines += ["", "| GEMM (M=N=K) | ms | TFLOP/s | compiled to |", "|---|---|---|---|"]
    for g in gemm_rows:
        lines.append(f"| {g['name']} ({g['n']}) | {g['ms']:.3f} | {g['tflops']:.1f} | {g['gemms']['kinds']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on any backend (CPU smoke run)")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=100, help="timed steps; the loss is reported after steps + 4")
    ap.add_argument("--layers-8b", type=int, default=10)
    ap.add_argument("--batch-8b", type=int, default=2)
    ap.add_argument("--block", type=int, default=8, help="steps dispatched back to back per timed block")
    ap.add_argument("--data", metavar="TOKENS", help="train on this token file (data.source=file, uint16) "
                    "instead of the synthetic chain, whose 128k-token table the 8B shape cannot learn in 100 steps")
    ap.add_argument("--no-gemm", action="store_true", help="skip the single-GEMM micro-benchmark")
    ap.add_argument("--timeout", type=int, default=190, help="seconds per (shape, recipe) process")
    ap.add_argument("--profile", metavar="START:END", help="trace these steps of every run (kept out of the "
                    "median) and add the time-by-category table (meshtrain.profile) to its record")
    ap.add_argument("overrides", nargs="*", help="section.key=value applied to every run, e.g. "
                    "precision.fp8_exclude=moe.* (lm_head in fp8)")
    ap.add_argument("--one", nargs=2, metavar=("SHAPE", "RECIPE"), help=argparse.SUPPRESS)
    a = ap.parse_intermixed_args()  # overrides may stand before and after the options
    if a.profile:
        from meshtrain.config import profile_range  # no jax: the parent only launches the runs

        window = profile_range(a.profile)
        if not (window and 4 <= window[0] < window[1] <= a.steps + 4):
            ap.error(f"--profile {a.profile}: give START:END with 4 <= START < END <= steps + 4 = {a.steps + 4} "
                     f"(the first 4 steps are warm-up)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if a.one:
        a.shape, a.recipe = a.one
        print("RESULT " + json.dumps(one_run(a)), flush=True)
        return 0

    runs = []
    for shape in [s for s in a.shapes.split(",") if s]:  # --shapes '': the GEMM benchmark alone
        for recipe in a.recipes.split(","):
            cmd = [sys.executable, __file__, "--out", a.out, "--one", shape, recipe, "--steps", str(a.steps),
                   "--layers-8b", str(a.layers_8b), "--batch-8b", str(a.batch_8b), "--block", str(a.block)] \
                + (["--tiny"] if a.tiny else []) + (["--profile", a.profile] if a.profile else []) \
                + (["--data", a.data] if a.data else []) + a.overrides
            t0 = time.time()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                rec = json.loads(line[-1][7:]) if line else dict(shape=shape, recipe=recipe, error=p.stderr[-2000:])
                rec["phases"] = [ln[6:] for ln in p.stdout.splitlines() if ln.startswith("PHASE ")]
            except subprocess.TimeoutExpired as e:
                child_out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                phases = [ln[6:] for ln in child_out.splitlines() if ln.startswith("PHASE ")]
                rec = dict(shape=shape, recipe=recipe, error=f"timed out after {a.timeout} s; last phase: "
                           f"{phases[-1] if phases else 'none (still building or lowering)'}")
            rec["wall_s"] = time.time() - t0
            runs.append(rec)
            (out / "results.json").write_text(json.dumps(dict(runs=runs, gemm=[]), indent=1))  # kept if cut short
            status = rec.get("error", "")[-300:] or (f"step {rec['step_ms']:.1f} ms, loss {rec['loss_last']:.4f}, "
                                                     f"gemms {rec['gemms']}")
            print(f"[{shape} {recipe}] {rec['wall_s']:.0f}s {status}", flush=True)
            if rec.get("phases"):
                print(f"    phases: {'; '.join(rec['phases'])}", flush=True)
            if rec.get("profile"):
                print(rec["profile"]["table"], flush=True)
    gemm_rows = [] if a.no_gemm else gemm_bench(a)
    (out / "results.json").write_text(json.dumps(dict(runs=runs, gemm=gemm_rows), indent=1))
    md = table(runs, gemm_rows)
    (out / "results.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
