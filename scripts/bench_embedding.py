"""Time the embedding table's backward under each `model.embedding_grad` (meshtrain/model/embedding.py) on
one device, for token ids drawn three ways; prints one table, writes JSON.

  PYTHONPATH=. python scripts/bench_embedding.py --out results/embedding.json
  python scripts/bench_embedding.py --small --out /tmp/embedding.json      # CPU check, tiny shapes

What is timed: the vjp of the lookup wrt the fp32 table, given a bf16 cotangent [N, D] (the forward
gather's output is unused, so the compiler drops it): dtable [V, D] fp32 out. Median of `--calls`
synchronized calls after warm-up (scripts/benchtime.py). Ids: `uniform` over V; `byte` from 100
distinct ids (what byte-level data gives a 32k vocabulary); `zipf` with P(rank k) ~ k^-1.1, ranks
mapped to ids by a random permutation. rel_err: ||dtable - fp32 scatter|| / ||fp32 scatter||, where the
reference is autodiff of a gather from the fp32 table with the same cotangent in fp32.
"""
from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchtime import median_seconds
from meshtrain.model.embedding import EMBEDDING_GRADS, embedding_lookup

# (V, D, N tokens, id draws): a Llama-1B-like table at 16k tokens a step, then a Llama-3-8B-like one.
CASES = [(32000, 2048, 16384, ("uniform", "byte", "zipf")), (128256, 4096, 8192, ("zipf",))]
SMALL_CASES = [(512, 64, 2048, ("uniform", "byte", "zipf")), (1024, 128, 1024, ("zipf",))]


def draw_ids(kind: str, vocab: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(0, vocab, n)
    if kind == "byte":
        return rng.choice(rng.choice(vocab, 100, replace=False), n)
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -1.1
    return rng.permutation(vocab)[rng.choice(vocab, n, p=p / p.sum())]


def backward(grad: str, table_vd, tokens_n, g_nd):
    lookup = partial(embedding_lookup, tokens_bt=tokens_n[None], compute_dtype=jnp.bfloat16, grad=grad)
    return jax.vjp(lookup, table_vd)[1](g_nd[None])[0]


def reference(table_vd, tokens_n, g_nd):
    return jax.vjp(lambda t: jnp.take(t, tokens_n, axis=0), table_vd)[1](g_nd.astype(jnp.float32))[0]


def temp_mb(fn, *args) -> float | None:
    try:
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
    except Exception:  # memory_analysis is not available on every backend/version
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per row (the median is reported)")
    ap.add_argument("--modes", default=",".join(EMBEDDING_GRADS), help="comma list of backwards to time")
    a = ap.parse_args()
    modes = a.modes.split(",")
    device = jax.devices()[0].device_kind
    rng = np.random.default_rng(0)
    results = []
    for vocab, d, n, draws in SMALL_CASES if a.small else CASES:
        key_t, key_g = jax.random.split(jax.random.key(vocab))
        table_vd = jax.random.normal(key_t, (vocab, d), jnp.float32)
        g_nd = jax.random.normal(key_g, (n, d), jnp.float32).astype(jnp.bfloat16)  # never zeros
        for draw in draws:
            tokens_n = jnp.asarray(draw_ids(draw, vocab, n, rng), jnp.int32)
            want_vd = jax.jit(reference)(table_vd, tokens_n, g_nd)
            for grad in modes:
                fn = jax.jit(partial(backward, grad))
                got_vd = fn(table_vd, tokens_n, g_nd)
                rec = dict(V=vocab, D=d, N=n, ids=draw, distinct=int(jnp.unique(tokens_n).size), grad=grad,
                           bwd_ms=median_seconds(fn, table_vd, tokens_n, g_nd, calls=a.calls, warmup=3) * 1e3,
                           rel_err=float(jnp.linalg.norm(got_vd - want_vd) / jnp.linalg.norm(want_vd)),
                           temp_mb=temp_mb(fn, table_vd, tokens_n, g_nd), device=device, jax=jax.__version__)
                results.append(rec)
                print(json.dumps(rec), flush=True)
                del got_vd
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))

    print(f"\nembedding backward, bf16 cotangent -> fp32 dtable; {device}, jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; median of {a.calls} calls, ms (rel err vs fp32 scatter)")
    print(f"{'V':>7} {'D':>5} {'N':>6} {'ids':>8} {'distinct':>8} " + "".join(f"{m:>28}" for m in modes))
    rows = {}
    for r in results:
        rows.setdefault((r["V"], r["D"], r["N"], r["ids"], r["distinct"]), {})[r["grad"]] = r
    for (vocab, d, n, draw, distinct), by_mode in rows.items():
        cells = "".join(f"{by_mode[m]['bwd_ms']:.3f} ({by_mode[m]['rel_err']:.1e})".rjust(28) for m in modes)
        print(f"{vocab:>7} {d:>5} {n:>6} {draw:>8} {distinct:>8} {cells}")


if __name__ == "__main__":
    main()
