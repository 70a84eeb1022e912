"""Benchmark the pallas_kernels on one GPU against cuDNN / plain XLA; prints one table, writes JSON.

  PYTHONPATH=. python3 scripts/bench_kernels.py --out results.json [--quick] [--sweep]
  PYTHONPATH=. python3 scripts/bench_kernels.py --only fp8_cast --sweep --out results.json
  PYTHONPATH=. python3 scripts/bench_kernels.py --only gemm --out results.json   # the layer's GEMMs, apart and stacked

Timing: each function is jitted and warmed up (compile + 2 runs); then `--batches` batches of
`--calls` back-to-back asynchronous calls are timed on the host clock, each batch ended by
block_until_ready; the figure is the median over batches of batch time / calls. Inputs are
random normal (never zeros), and calls alternate between two input sets so no input sits in L2.
FLOPs: attention fwd 4*B*H*T*S*E (halved when causal), fwd+bwd 3.5x fwd. Bytes: the minimum
traffic (each input read once, each output written once). Memory: the compiled program's
`memory_analysis()` temp bytes. `--profile DIR` also traces the default Mosaic and cuDNN attention
forward+backward (5 calls each) and lists their kernels with the time of each per call.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import statistics
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import (FlashAttentionBlockSizes, Fp8CastBlockSizes, MosaicBlockSizes, cast_transpose,
                            cast_transpose_reference, flash_attention, flash_attention_reference,
                            linear_cross_entropy, linear_cross_entropy_reference, RmsNormBlockSizes, rms_norm,
                            rms_norm_reference)


def bench(fn, input_sets, *, calls: int, batches: int) -> float:
    """Median seconds per call of an already-jitted fn, alternating between input sets."""
    for args in input_sets:
        jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*input_sets[0]))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*input_sets[i % len(input_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def kernel_times(fn, args, trace_dir: Path, calls: int = 5) -> list[dict]:
    """The kernels of `calls` traced calls of an already-warm fn: name and ms per call, longest first."""
    from meshtrain.profile.table import profile_report  # the same trace reader as the training profiles
    jax.profiler.start_trace(str(trace_dir))
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    top = profile_report(trace_dir, steps=calls, top_kernels=8)["top_kernels"]  # totals over the trace
    return [dict(name=t["name"], ms=t["ms"] / calls, per_call=t["count"] / calls) for t in top]


def temp_bytes(fn, *args):
    try:
        return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # memory_analysis is not available on every backend/version
        return None


def randn(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def attention_rows(args, results):
    shapes = [(4, 4096, 16, 16, 128, True), (4, 4096, 16, 16, 128, False), (2, 8192, 16, 16, 128, True),
              (1, 16384, 16, 16, 128, True), (1, 16384, 16, 16, 128, False),
              (4, 4096, 16, 4, 128, True), (4, 4096, 32, 8, 64, True)]
    if args.quick:
        shapes = [shapes[0], shapes[5]]
    impls = {
        "mosaic": lambda causal, bs: functools.partial(flash_attention, causal=causal, block_sizes=bs,
                                                       backend="mosaic"),
        "triton": lambda causal, bs: functools.partial(flash_attention, causal=causal, block_sizes=bs,
                                                       backend="triton"),
        "cudnn": lambda causal, bs: functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                      implementation="cudnn"),
        "xla_ref": lambda causal, bs: functools.partial(flash_attention_reference, causal=causal),
    }
    configs = {impl: [("default", None)] for impl in impls}
    if args.sweep or args.sweep_all:
        fab, mbs = FlashAttentionBlockSizes, MosaicBlockSizes
        # Triton variants as changes to the head dim's defaults (tiles are query x key).
        tvariant = lambda **kw: lambda e: dataclasses.replace(fab.for_head_dim(e), **kw)  # noqa: E731
        configs["triton"] += [
            ("fwd128x128", tvariant(block_k=128)),
            ("dkdv32x64_dq64x32_w4", tvariant(block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                                              num_warps_dkdv=4, num_warps_dq=4)),  # the defaults until 2026-11-26
            ("bwd_stages2", tvariant(num_stages_dkdv=2, num_stages_dq=2)),
            ("bwd_stages4", tvariant(num_stages_dkdv=4, num_stages_dq=4)),
        ]
        # Mosaic variants as changes to the head dim's defaults.
        variant = lambda **kw: lambda e: dataclasses.replace(mbs.for_head_dim(e), **kw)  # noqa: E731
        configs["mosaic"] += [
            ("dq_kernel", variant(dq_atomic=False)),
            ("dq_kernel_dq128", variant(dq_atomic=False, block_k_dq=128)),
            ("dq_kernel_dkv128", variant(dq_atomic=False, block_q_dkv=128)),
        ]
    for b, s, h, kh, e, causal in shapes:
        flops_fwd = 4 * b * h * s * s * e / (2 if causal else 1)
        sets = []
        for seed in range(2):
            ks = jax.random.split(jax.random.PRNGKey(seed), 4)
            sets.append((randn(ks[0], (b, s, h, e), jnp.bfloat16), randn(ks[1], (b, s, kh, e), jnp.bfloat16),
                         randn(ks[2], (b, s, kh, e), jnp.bfloat16), randn(ks[3], (b, s, h, e), jnp.bfloat16)))
        for impl, make in impls.items():
            if impl == "xla_ref" and s > 8192:
                continue  # [B, H, S, S] fp32 scores: 17 GB per copy at S=16384
            if impl not in args.impls.split(","):
                continue
            swept = args.sweep_all or ((b, s, causal) == (4, 4096, True) and e == 128)  # causal MHA and GQA
            for cname, bs in (configs[impl] if swept else configs[impl][:1]):
                fn = make(causal, bs(e) if callable(bs) else bs)
                name = f"attn {'causal' if causal else 'full'} B{b} S{s} H{h} K{kh} E{e} {impl}"
                if cname != "default":
                    name += f" [{cname}]"
                fwd = jax.jit(lambda q, k, v, do, fn=fn: fn(q, k, v))
                fwdbwd = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
                for mode, f, flops in (("fwd", fwd, flops_fwd), ("fwd+bwd", fwdbwd, 3.5 * flops_fwd)):
                    row = {"kernel": "attention", "name": name, "mode": mode}
                    profiled = args.profile and mode == "fwd+bwd" and cname == "default" and impl in ("mosaic", "cudnn")

                    def profile(row):  # called within this iteration: f and name are this variant's
                        row["kernels"] = kernel_times(f, sets[0], Path(args.profile) / name.replace(" ", "_"))
                        for kern in row["kernels"]:
                            print(f"    {kern['ms']:8.3f} ms  x{kern['per_call']:g}  {kern['name'][:90]}")
                    timed_row(results, row, f, sets, calls=args.calls, batches=args.batches,
                              figures=lambda t: dict(tflops=flops / t / 1e12),
                              then=profile if profiled else None)


def rms_rows(args, results):
    n, d = 16384, 2048
    elt = 2
    sets = []
    for seed in range(2):
        ks = jax.random.split(jax.random.PRNGKey(10 + seed), 5)
        sets.append((randn(ks[0], (n, d), jnp.bfloat16), randn(ks[1], (n, d), jnp.bfloat16),
                     randn(ks[2], (d,), jnp.bfloat16, 0.1) + 1, randn(ks[3], (n, d), jnp.bfloat16),
                     randn(ks[4], (n, d), jnp.bfloat16)))
    # Copy ceiling on a 4x larger array (256 MiB each way) so launch gaps do not count.
    big = [(randn(jax.random.PRNGKey(30 + i), (4 * n, d), jnp.bfloat16),) for i in range(2)]
    copy = jax.jit(lambda x: x * 2)
    t = bench(copy, big, calls=args.calls * 4, batches=args.batches)
    row = {"kernel": "copy", "name": f"copy (x*2) {4 * n}x{d} bf16", "mode": "fwd", "ms": t * 1e3,
           "gbps": 2 * 4 * n * d * elt / t / 1e9}
    results.append(row)
    print(fmt(row), flush=True)
    torch_row = torch_copy_row(4 * n * d * elt)
    if torch_row:
        results.append(torch_row)
        print(fmt(torch_row), flush=True)
    impls = [("triton", rms_norm), ("jnp", rms_norm_reference)]
    if args.sweep:
        for cfg in ((2, 16, 2, 8, 4), (4, 32, 2, 8, 4), (4, 16, 1, 8, 4), (4, 16, 2, 8, 2), (4, 32, 4, 8, 8),
                    (4, 64, 4, 8, 8), (4, 32, 2, 8, 8), (4, 16, 4, 8, 4), (4, 64, 8, 8, 8), (8, 32, 4, 16, 8),
                    (4, 8, 2, 8, 4), (4, 8, 1, 8, 2)):
            bs = RmsNormBlockSizes(*cfg)
            impls.append((f"triton [{'/'.join(map(str, cfg))}]", functools.partial(rms_norm, block_sizes=bs)))
    for impl, fn in impls:
        fwd = jax.jit(lambda x, r, w, dy, ds, fn=fn: fn(x, w, residual=r))
        # dresidual is the same array as dx (d(x + r)/dr = d(x + r)/dx): return it once, as a
        # training step consumes it, so no output copy is timed.
        fwdbwd = jax.jit(lambda x, r, w, dy, ds, fn=fn: jax.vjp(
            lambda x, r, w: fn(x, w, residual=r), x, r, w)[1]((dy, ds))[::2])
        # fwd: read x, r; write y, s. bwd: read s, dy, ds; write dx (dresidual is the same array).
        # bwd alone: the vjp closure (holding the forward's residuals) is a pytree, so it can be
        # an argument of a jitted function.
        vjps = [(jax.vjp(lambda x, r, w, fn=fn: fn(x, w, residual=r), x, r, w)[1], (dy, ds))
                for x, r, w, dy, ds in sets]
        bwd = jax.jit(lambda vjp, cts: vjp(cts)[::2])
        for mode, f, f_sets, nbytes in (("fwd", fwd, sets, 4 * n * d * elt),
                                        ("bwd", bwd, vjps, 4 * n * d * elt),
                                        ("fwd+bwd", fwdbwd, sets, 8 * n * d * elt)):
            row = {"kernel": "rms_norm", "name": f"rms_norm+residual {n}x{d} bf16 {impl}", "mode": mode}
            timed_row(results, row, f, f_sets, calls=args.calls * 4, batches=args.batches,
                      figures=lambda t: dict(
                          gbps=nbytes / t / 1e9, temp_mib=_mib(temp_bytes(f, *f_sets[0]))))


def torch_copy_row(nbytes: int):
    """Device-to-device copy ceiling through torch (cudaMemcpy, timed with CUDA events), when torch
    with CUDA is installed: XLA's elementwise x*2 is a kernel, not the copy engine's ceiling."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dst = torch.empty_like(src[0])
    for i in range(3):
        dst.copy_(src[i % 2])
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(10):
            dst.copy_(src[i % 2])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    t = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"kernel": "copy", "name": f"torch copy_ {nbytes >> 20} MiB", "mode": "fwd", "ms": t * 1e3,
            "gbps": 2 * nbytes / t / 1e9}


def ce_rows(args, results):
    n, d, v = 16384, 2048, 32000
    sets = []
    for seed in range(2):
        ks = jax.random.split(jax.random.PRNGKey(20 + seed), 4)
        sets.append((randn(ks[0], (n, d), jnp.bfloat16), randn(ks[1], (d, v), jnp.bfloat16, d ** -0.5),
                     jax.random.randint(ks[2], (n,), 0, v), jax.random.normal(ks[3], (n,), jnp.float32)))
    flops = 3 * 2 * n * d * v  # the useful work: logits, dh, dw
    for impl, fn in (("blocked", linear_cross_entropy), ("jnp", linear_cross_entropy_reference)):
        f = jax.jit(lambda h, w, l, g, fn=fn: jax.vjp(lambda h, w: fn(h, w, l), h, w)[1](g))
        row = {"kernel": "cross_entropy", "name": f"linear_ce N{n} D{d} V{v} bf16 {impl}", "mode": "loss+grads"}
        timed_row(results, row, f, sets, calls=max(2, args.calls // 4), batches=args.batches,
                  figures=lambda t: dict(tflops=flops / t / 1e12, temp_mib=_mib(temp_bytes(f, *sets[0]))))


def _mib(x):
    return None if x is None else x / 2 ** 20


def fp8_rows(args, results):
    """The one-pass fp8 cast (both layouts) against XLA's, alone and inside the fp8 recipes' GEMMs.

    Cast rows: GB/s of the minimum traffic (x read once, both fp8 layouts written), and how many bytes of q
    and qT differ from XLA's (must be 0; -0 against +0 counts). GEMM rows: fp8.per_tensor_matmul forward+backward (3 GEMMs,
    6*M*K*N FLOP) of the Llama-3-8B layer shapes at 8192 tokens, with each cast."""
    from meshtrain import fp8
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    cases = [("activation", (8192, 4096), jnp.bfloat16, e4m3), ("activation", (8192, 14336), jnp.bfloat16, e4m3),
             ("gradient", (8192, 14336), jnp.bfloat16, e5m2), ("weight", (4096, 14336), jnp.float32, e4m3),
             ("weight", (14336, 4096), jnp.float32, e4m3)]
    blocks = [Fp8CastBlockSizes()]
    if args.sweep:
        blocks += [Fp8CastBlockSizes(*c) for c in ((128, 128, 8), (64, 64, 4), (128, 64, 4), (32, 128, 4),
                                                   (64, 128, 8), (128, 128, 4), (64, 256, 8), (32, 64, 2))]
    scale = jnp.float32(0.5)
    for what, shape, dtype, fp8_dtype in cases:
        sets = [(randn(jax.random.PRNGKey(40 + i), shape, dtype, 30.0),) for i in range(2)]
        nbytes = shape[0] * shape[1] * (jnp.dtype(dtype).itemsize + 2)
        ref = jax.jit(lambda x, d=fp8_dtype: cast_transpose_reference(x, scale, d)[:2])
        want = ref(*sets[0])
        impls = [("xla", ref)] + [(f"triton [{b.block_rows}/{b.block_cols}/{b.num_warps}]",
                                   jax.jit(lambda x, d=fp8_dtype, b=b: cast_transpose(x, scale, d, block_sizes=b)[:2]))
                                  for b in blocks]
        for impl, f in impls:
            row = {"kernel": "fp8_cast", "name": f"{what} {shape[0]}x{shape[1]} {jnp.dtype(dtype).name} {impl}",
                   "mode": "cast"}

            def mismatches(row):
                row["mismatches"] = int(sum(jnp.sum(jax.lax.bitcast_convert_type(g, jnp.uint8)
                                                    != jax.lax.bitcast_convert_type(w, jnp.uint8))
                                            for g, w in zip(f(*sets[0]), want)))
            timed_row(results, row, f, sets, calls=args.calls * 4, batches=args.batches,
                      figures=lambda t: dict(gbps=nbytes / t / 1e9), check=mismatches)
    m = 8192
    for k, n in ((4096, 14336), (14336, 4096), (4096, 4096)):
        sets = [(randn(jax.random.PRNGKey(50 + i), (m, k), jnp.bfloat16), randn(jax.random.PRNGKey(60 + i), (k, n),
                 jnp.float32, 0.02), randn(jax.random.PRNGKey(70 + i), (m, n), jnp.bfloat16)) for i in range(2)]
        meta = {key: jnp.full((16,), 4.0, jnp.float32) for key in fp8.HISTORY_KEYS}
        for recipe in ("fp8", "fp8_delayed"):
            for cast in ("xla", "triton"):
                def step(x, w, g, cast=cast, recipe=recipe):
                    mt = meta if recipe == "fp8_delayed" else None
                    y, vjp = jax.vjp(lambda x, w: fp8.per_tensor_matmul(x, w, mt, jnp.bfloat16, cast), x, w)
                    return y, *vjp(g)  # y too, or the forward GEMM would be dead code
                row = {"kernel": "fp8_matmul", "name": f"{recipe} {m}x{k}x{n} cast={cast}", "mode": "fwd+bwd"}
                timed_row(results, row, jax.jit(step), sets, calls=args.calls, batches=args.batches,
                          figures=lambda t: dict(tflops=6 * m * k * n / t / 1e12))


def gemm_rows(args, results):
    """A layer's projections forward+backward (y = x @ w, dx, dw: 6*M*K*N FLOP), each weight apart and the
    weights that read the same x stacked into one GEMM (q|k|v, gate|up), the stacking and the gradients'
    split inside the timed function as a step would run them. Shapes: the 1.36B (llama1b, 16,384 tokens)
    and Llama-3-8B (24,576 tokens: 6 sequences of 4096)."""
    shapes = {"1b": dict(m=16384, d=2048, q=2048, kv=2048, f=5632),
              "8b": dict(m=24576, d=4096, q=4096, kv=1024, f=14336)}
    for shape, s in shapes.items():
        m, d = s["m"], s["d"]
        groups = {"qkv": [s["q"], s["kv"], s["kv"]], "gate_up": [s["f"], s["f"]], "o": [d], "down": None}
        for group, widths in groups.items():
            k_dim, widths = (s["f"], [d]) if widths is None else (d, widths)
            n_total = sum(widths)
            sets = []
            for seed in range(2):
                ks = jax.random.split(jax.random.PRNGKey(80 + seed), 2 + 2 * len(widths))
                ws = tuple(randn(ks[2 + i], (k_dim, n), jnp.bfloat16, k_dim ** -0.5) for i, n in enumerate(widths))
                gs = tuple(randn(ks[2 + len(widths) + i], (m, n), jnp.bfloat16) for i, n in enumerate(widths))
                sets.append((randn(ks[0], (m, k_dim), jnp.bfloat16), ws, gs))

            def apart(x, ws, gs):
                ys, vjp = jax.vjp(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.bfloat16) for w in ws], x, ws)
                return ys, vjp(list(gs))

            def stacked(x, ws, gs):
                def f(x, ws):
                    y = jnp.dot(x, jnp.concatenate(ws, axis=1), preferred_element_type=jnp.bfloat16)
                    return jnp.split(y, list(itertools.accumulate(w.shape[1] for w in ws[:-1])), axis=1)
                ys, vjp = jax.vjp(f, x, ws)
                return ys, vjp(list(gs))

            impls = [("apart", apart)] + ([("stacked", stacked)] if len(widths) > 1 else [])
            for impl, fn in impls:
                row = {"kernel": "gemm", "name": f"{shape} {group} M{m} K{k_dim} N{'+'.join(map(str, widths))} {impl}",
                       "mode": "fwd+bwd"}
                timed_row(results, row, jax.jit(fn), sets, calls=args.calls, batches=args.batches,
                          figures=lambda t: dict(tflops=6 * m * k_dim * n_total / t / 1e12))


def timed_row(results, row, f, sets, *, calls: int, batches: int, figures, check=None, then=None):
    """Time f over sets into row: ms, and figures(seconds a call) (TFLOP/s, GB/s, temp MiB). check(row) runs before
    the timing and then(row) after it; an exception in any of them becomes the row's error, so one failing variant
    does not hide the rest. The row is recorded and printed either way."""
    try:
        if check:
            check(row)
        t = bench(f, sets, calls=calls, batches=batches)
        row.update(ms=t * 1e3, **figures(t))
        if then:
            then(row)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc(limit=2)
    results.append(row)
    print(fmt(row), flush=True)


def fmt(row):
    if "error" in row:
        return f"{row['name']:<58} {row['mode']:<10} ERROR {row['error'][:120]}"
    parts = [f"{row['name']:<58} {row['mode']:<10} {row['ms']:9.3f} ms"]
    if "tflops" in row:
        parts.append(f"{row['tflops']:7.1f} TFLOP/s")
    if "gbps" in row:
        parts.append(f"{row['gbps']:7.0f} GB/s")
    if "mismatches" in row:
        parts.append(f"{row['mismatches']} bytes unlike XLA's")
    if row.get("temp_mib") is not None:
        parts.append(f"temp {row['temp_mib']:9.1f} MiB")
    return "  ".join(parts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_kernels.json")
    p.add_argument("--quick", action="store_true", help="one attention shape each of MHA/GQA")
    p.add_argument("--sweep", action="store_true",
                   help="also try a few attention block configs (causal B4 S4096 E128, MHA and GQA)")
    p.add_argument("--only", default="attention,rms_norm,cross_entropy",
                   help="comma-separated: attention, rms_norm, cross_entropy, fp8_cast (the one-pass fp8 cast), "
                        "gemm (a layer's projections apart and stacked)")
    p.add_argument("--impls", default="mosaic,triton,cudnn,xla_ref", help="the attention implementations to time")
    p.add_argument("--sweep-all", action="store_true", help="the --sweep configs on every attention case")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="trace the default Mosaic and cuDNN attention fwd+bwd into DIR and list their kernels")
    args = p.parse_args()
    dev = jax.devices()[0]
    meta = {"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": vars(args)}
    print(meta, flush=True)
    results = []
    only = args.only.split(",")
    for name, fn in (("attention", attention_rows), ("rms_norm", rms_rows), ("cross_entropy", ce_rows),
                     ("fp8_cast", fp8_rows), ("gemm", gemm_rows)):
        if name in only:
            fn(args, results)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print("\n==== summary", meta["device"], "jax", meta["jax"], meta["date"])
    for row in results:
        print(fmt(row))


if __name__ == "__main__":
    main()
