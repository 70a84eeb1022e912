"""Context and sequence parallelism on 2 GPUs, all measurements from one command (about 8 minutes):

  PYTHONPATH=. python scripts/bench_context.py --out DIR          # 2 GPUs (2xH200)
  PYTHONPATH=. python scripts/bench_context.py --out DIR --tiny   # CPU smoke run, tiny shapes

(a) attention  fwd+bwd throughput per GPU: ring attention (Pallas blocks) over cp=2 on 2 x 16k tokens
    against the single-GPU Pallas flash kernel at 16k; Llama-1B heads (16 x 128), bf16, causal; also
    the all-gather variant. FLOPs count the causal half: 3.5 * 4 * B * H * T^2 * E / 2.
(c) step       the same 32k-token train step of the 1B model on 2 GPUs with cp=2, sp=2 and tp=2 + SP
    (Pallas attention in all three, remat=full, bf16, one sequence): median step time and the
    compiled program's memory per device (arguments + outputs - aliased + temporaries).
(b) longest    the longest sequence (doubling from --start-seq, cap --max-seq) whose train step fits
    one GPU, and cp=2, for the 1B shape (24 layers) and the Llama-3-8B shape cut to --layers-8b
    layers (the full 8B does not fit one GPU's memory with fp32 Adam state at any length). remat=full,
    bf16, fused cross-entropy, one sequence. A length "fits" when the compiled program's memory
    (as in (c)) is below the GPU's; the longest fitting length is then run for one step when its
    estimated time is within --run-limit seconds, otherwise it is reported as not run.
(a) also reports, from the compiled ring program, how many compute ops the scheduler placed between
each collective-permute-start and its done (0 everywhere would mean no overlap of K/V transfer and
block compute). Timing: warm-up, then the median of synchronized calls (docs DESIGN.md section 8). A part that fails
records its error and the rest go on. Results: DIR/bench_context.json and DIR/bench_context.md; the
table is printed last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:  # before jax starts: 8 simulated CPU devices
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from meshtrain.config import build_config, validate, with_mesh  # noqa: E402
from meshtrain.mesh import build_mesh  # noqa: E402
from meshtrain.metrics import count_params, flops_per_token  # noqa: E402
from meshtrain.parallel.sequence.context import context_attention  # noqa: E402
from meshtrain.parallel.sequence.zigzag import sequence_order  # noqa: E402
from meshtrain.sharding import make_rules  # noqa: E402
from meshtrain.step.state import build_setup, init_state, make_batches
from meshtrain.step.train_step import make_train_step  # noqa: E402

from benchtime import median_seconds, time_train_steps  # noqa: E402

GIB = 2.0 ** 30
BF16 = ["precision.compute=bfloat16", "train.global_batch=1", "train.remat=full", "run.progress=false"]
MODELS = {"llama1b": ["model.preset=llama1b"], "llama3_8b": ["model.preset=llama3_8b"]}


def devices_mesh(degrees: dict[str, int]):
    full = {a: 1 for a in ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")} | degrees
    n = int(np.prod(list(full.values())))
    return build_mesh(full, jax.devices()[:n])


# ------------------------------------------------------------------------------ (a) attention


def attention_rows(a) -> list[dict]:
    t, h, e = (256, 2, 32) if a.tiny else (16384, 16, 128)
    dtype = jnp.float32 if a.tiny else jnp.bfloat16
    flops = lambda seq: 3.5 * 4 * h * seq * seq * e / 2  # noqa: E731
    keys = jax.random.split(jax.random.key(0), 4)
    rnd = lambda k, n: jax.random.normal(k, (1, n, h, e), jnp.float32).astype(dtype)  # noqa: E731
    rows = []

    q, k, v, do = (rnd(kk, t) for kk in keys)
    single = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda q, k, v: pk.flash_attention(q, k, v, causal=True, interpret=a.tiny), q, k, v)[1](do))
    s = median_seconds(single, q, k, v, do, calls=a.calls)
    rows.append(dict(part="a", name=f"flash kernel, 1 GPU, T={t}", ms=s * 1e3, tflops_per_gpu=flops(t) / s / 1e12))

    mesh = devices_mesh({"cp": 2})
    rules = make_rules(mesh, zero_stage=1, sequence_parallel=False, n_kv_heads=h).params
    seq_sh = NamedSharding(mesh, P(None, ("cp", "sp")))
    x_sh = NamedSharding(mesh, P(None, ("cp", "sp"), None, None))
    q, k, v, do = (jax.device_put(rnd(kk, 2 * t), x_sh) for kk in keys)
    pos = jax.device_put(jnp.asarray(sequence_order(2 * t, 2), jnp.int32)[None], seq_sh)
    seg = jax.device_put(jnp.zeros((1, 2 * t), jnp.int32), seq_sh)
    for impl in ("ring", "allgather"):
        def fn(q, k, v, do, impl=impl):
            attn = lambda q, k, v: context_attention(q, k, v, pos, seg, impl="pallas", document_mask=False,  # noqa
                                                     cp_impl=impl, cp_layout="zigzag", rules=rules)
            return jax.vjp(attn, q, k, v)[1](do)
        compiled = jax.jit(fn).lower(q, k, v, do).compile()
        s2 = median_seconds(compiled, q, k, v, do, calls=a.calls)
        per_gpu = flops(2 * t) / s2 / 2 / 1e12
        rows.append(dict(part="a", name=f"{impl} attention, cp=2, T=2x{t}", ms=s2 * 1e3, tflops_per_gpu=per_gpu,
                         vs_single=per_gpu / rows[0]["tflops_per_gpu"],
                         permute_overlap=permute_overlap(compiled.as_text())))
    return rows


def permute_overlap(hlo: str) -> list[int]:
    """For each async collective-permute in the scheduled HLO: how many compute ops (fusions, custom
    calls such as the Triton kernels) run between its start and its done. 0 everywhere: no overlap.
    Empty: the permutes are synchronous (the CPU backend)."""
    lines = hlo.splitlines()
    counts = []
    for i, line in enumerate(lines):
        if "collective-permute-start(" not in line:
            continue
        name = line.split("=")[0].split()[-1].lstrip("%")
        for j in range(i + 1, len(lines)):
            if "collective-permute-done(" in lines[j] and f"%{name}" in lines[j]:
                counts.append(sum((" fusion(" in x or "custom-call(" in x) for x in lines[i + 1:j]))
                break
    return counts


# ------------------------------------------------------------------------------ train-step helpers


def setup_for(overrides: list[str], n_devices: int):
    cfg = build_config({}, overrides)
    degrees = validate(cfg, n_devices)
    return build_setup(with_mesh(cfg, degrees), build_mesh(degrees, jax.devices()[:n_devices]))


def compile_step(setup):
    """AOT-compile the train step from shapes alone; returns (compiled, GiB per device)."""
    shapes = jax.eval_shape(lambda: init_state(setup))
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            setup.state_shardings)
    compiled = make_train_step(setup).lower(abstract, setup.abstract_batch()).compile()
    try:
        m = compiled.memory_analysis()
        gib = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes) / GIB
    except Exception:  # not reported on every backend
        gib = None
    return compiled, gib


def run_steps(setup, compiled, steps: int) -> tuple[float, float]:
    """(median step seconds, last loss) of `steps` timed steps after one warm-up step."""
    batches = make_batches(setup)
    data = [batches.batch(i) for i in range(2)]
    run = time_train_steps(compiled, init_state(setup), data, steps, warmup=0)
    return run.median_s, float(run.metrics["loss"])


def device_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_limit"] / GIB if "bytes_limit" in stats else None


# ------------------------------------------------------------------------------ (c) same step


def step_rows(a) -> list[dict]:
    seq = 256 if a.tiny else 32768
    model = ["model.preset=tiny", "model.n_heads=4", "model.n_kv_heads=4"] if a.tiny else MODELS["llama1b"]
    attn = "reference" if a.tiny else "pallas"
    layouts = {"cp=2": ["mesh.cp=2"], "sp=2": ["mesh.sp=2"], "tp=2+SP": ["mesh.tp=2", "parallel.sequence_parallel=true"]}
    rows = []
    for name, mesh in layouts.items():
        row = dict(part="c", name=f"1B step, T={seq}, {name}" if not a.tiny else f"tiny step, T={seq}, {name}")
        try:
            setup = setup_for(model + BF16 + mesh + ["mesh.fsdp=1", f"data.seq_len={seq}", f"model.attention={attn}"],
                              2)
            compiled, gib = compile_step(setup)
            s, loss = run_steps(setup, compiled, a.steps)
            row.update(ms=s * 1e3, program_gib=gib, tokens_per_s=seq / s, loss=loss)
        except Exception as exc:  # keep going: one failing layout must not hide the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=3)
        rows.append(row)
        print(fmt(row), flush=True)
    return rows


# ------------------------------------------------------------------------------ (b) longest sequence


def longest_rows(a, deadline: float) -> list[dict]:
    rows = []
    limit = device_gib()
    models = {"tiny": ["model.preset=tiny"]} if a.tiny else \
        {"llama1b": MODELS["llama1b"], f"llama3_8b ({a.layers_8b} layers)": MODELS["llama3_8b"] +
         [f"model.n_layers={a.layers_8b}"]}
    extra = ["model.attention=reference", "model.loss=reference"] if a.tiny else ["model.loss=fused"]
    for model_name, model in models.items():
        for layout, (mesh, n) in {"1 GPU": (["mesh.fsdp=1"], 1), "cp=2": (["mesh.cp=2", "mesh.fsdp=1"], 2)}.items():
            row = dict(part="b", name=f"longest, {model_name}, {layout}", tried=[])
            seq, best = a.start_seq, None
            while seq <= a.max_seq:
                if time.time() > deadline:
                    row["stopped"] = "time budget"
                    break
                try:
                    setup = setup_for(model + BF16 + mesh + extra + [f"data.seq_len={seq}"], n)
                    compiled, gib = compile_step(setup)
                except Exception as exc:
                    row["tried"].append(dict(seq=seq, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    break
                fits = limit is None or gib is None or gib < limit
                row["tried"].append(dict(seq=seq, program_gib=gib, fits=fits))
                print(f"  {row['name']}: T={seq} program {gib or 0:.1f} GiB of {limit or 0:.0f}: "
                      f"{'fits' if fits else 'does not fit'}", flush=True)
                if not fits:
                    break
                best = (seq, setup, compiled, gib)
                seq *= 2
            if best is not None:
                seq, setup, compiled, gib = best
                row.update(longest_fit=seq, program_gib=gib, capped=seq * 2 > a.max_seq)
                cfg = setup.cfg
                est = flops_per_token(cfg.model, count_params(jax.eval_shape(lambda: init_state(setup)).params), seq) \
                    * seq * 4 / 3 / (400e12 * n)  # 400 TFLOP/s per GPU, remat recomputes the forward
                if a.tiny or (est < a.run_limit and time.time() + 3 * est < deadline):
                    try:
                        s, loss = run_steps(setup, compiled, 1)
                        row.update(ran=True, ms=s * 1e3, loss=loss)
                    except Exception as exc:  # e.g. out of memory after all
                        row.update(ran=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                else:
                    row.update(ran=False, note=f"not run: estimated {est:.0f} s per step")
            rows.append(row)
            print(fmt(row), flush=True)
    return rows


# ------------------------------------------------------------------------------ output


def fmt(row: dict) -> str:
    parts = [f"[{row['part']}] {row['name']:<44}"]
    for key, unit in (("ms", "ms"), ("tflops_per_gpu", "TFLOP/s/GPU"), ("vs_single", "x single"),
                      ("tokens_per_s", "tok/s"), ("program_gib", "GiB/device"), ("longest_fit", "tokens")):
        if row.get(key) is not None:
            parts.append(f"{row[key]:,.2f} {unit}" if isinstance(row[key], float) else f"{row[key]:,} {unit}")
    if "ran" in row:
        parts.append("ran 1 step" if row["ran"] else row.get("note", "did not run"))
    if row.get("capped"):
        parts.append("(cap)")
    if row.get("stopped"):
        parts.append(f"stopped: {row['stopped']}")
    if row.get("permute_overlap") is not None:
        parts.append(f"ops between permute start/done: {row['permute_overlap']}")
    if "error" in row:
        parts.append("ERROR " + row["error"][:120])
    return "  ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for bench_context.json and .md")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on 8 simulated CPU devices (smoke run)")
    p.add_argument("--only", default="a,c,b", help="parts to run, in order")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--start-seq", type=int, default=0, help="default 16384 (tiny: 64)")
    p.add_argument("--max-seq", type=int, default=0, help="default 1048576 (tiny: 256)")
    p.add_argument("--layers-8b", type=int, default=4)
    p.add_argument("--run-limit", type=float, default=60.0, help="longest estimated step (s) that (b) runs")
    p.add_argument("--budget", type=float, default=450.0, help="seconds; (b) stops trying lengths after it")
    a = p.parse_args()
    a.start_seq = a.start_seq or (64 if a.tiny else 16384)
    a.max_seq = a.max_seq or (256 if a.tiny else 1 << 20)
    start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if jax.device_count() < 2:
        sys.exit("bench_context needs 2 devices (2 GPUs, or --tiny on the CPU)")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, n_devices=jax.device_count(), jax=jax.__version__,
                argv=sys.argv[1:], device_gib=device_gib())
    rows: list[dict] = []
    for part in a.only.split(","):
        try:
            if part == "a":
                rows += attention_rows(a)
            elif part == "c":
                rows += step_rows(a)
            elif part == "b":
                rows += longest_rows(a, start + a.budget)
        except Exception as exc:
            rows.append(dict(part=part, name="(part failed)", error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            traceback.print_exc()
    meta["wall_s"] = time.time() - start
    (out / "bench_context.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    table = "\n".join(fmt(r) for r in rows)
    (out / "bench_context.md").write_text(f"{meta}\n\n```\n{table}\n```\n")
    print(f"\n{meta['device']} x{meta['n_devices']}, jax {meta['jax']}, {meta['wall_s']:.0f} s\n{table}")


if __name__ == "__main__":
    main()
