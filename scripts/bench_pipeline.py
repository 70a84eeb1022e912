"""Pipeline schedules on the GPU: step time, and the measured bubble against the formula's.

For each schedule, at pp = --pp over the first pp devices (the 1.36B Llama shape by default):

  step_ms      median train step (warm-up first; data off the clock), each step synchronized
  b2b_ms       a step's share of as many steps dispatched back to back (as a training loop runs them, and
               as the peers' logged step times count them)
  dispatch_ms  how long the host's call of the step lasts (the executor's switches make the host wait for
               the device: XLA reads each branch index back before launching the branch)
  pipe_ms      the pipeline's share of it: step minus the optimizer update timed alone
  ops          every op the stages run (F, B, W of a first / middle / last chunk), jitted and timed
               alone on one device: the same stages run without the pipeline
  bubble       measured  p·pipe_ms / Σ_stages busy_ms - 1, where busy = the stage's ops timed alone
               lockstep  the same from the measured op times put on the executor's ticks (a tick
                         lasts its slowest stage's lanes): what the executor's program alone predicts
               formula   schedules.bubble_ratio (free-running stages, F = 1, B = 2 or B = W = 1)
  overhead     p·pipe_ms / (m · plain_ms) - 1: against one microbatch's ordinary forward + backward
               of the whole model on one device (no recomputation), i.e. everything the pipeline
               costs beyond ideal p-way scaling: bubble, recomputation in B and W, transfers

  python scripts/bench_pipeline.py --out DIR                 # 2 GPUs: llama1b, pp=2, m=8
  python scripts/bench_pipeline.py --out DIR --tiny          # CPU smoke run: tiny model, 2 simulated devices
  python scripts/bench_pipeline.py --out DIR --schedules 1f1b,zb_h1 --microbatches 16 model.n_layers=16

Writes DIR/bench_pipeline.json (everything) and DIR/bench_pipeline.md (the table), prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SCHEDULES = {"afab": 1, "1f1b": 1, "interleaved": 2, "zb_h1": 1, "dualpipe_v": 2}  # kind -> virtual stages


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for bench_pipeline.json / .md")
    ap.add_argument("--tiny", action="store_true", help="tiny model on 2 simulated CPU devices (smoke run)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layers=16")
    return ap.parse_intermixed_args()  # overrides may stand before and after the options


def main() -> None:
    a = parse()
    if a.tiny:  # before jax starts: the CPU device count is read once
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={a.pp}"
    import jax

    from meshtrain.config import MESH_AXES, load_config, validate, with_mesh
    from meshtrain.mesh import build_mesh

    base = (["model.preset=tiny", "model.n_layers=4", "model.d_model=64", "model.d_ff=128", "data.seq_len=32",
             "precision.compute=float32"] if a.tiny else
            ["model.preset=llama1b", "data.seq_len=2048", "precision.compute=bfloat16", "model.attention=cudnn"])
    m, b = a.microbatches, a.micro_batch
    common = base + ["model.scan_layers=true", "train.remat=none", f"train.grad_accum={m}",
                     f"train.global_batch={m * b}", "run.progress=false"] + a.overrides
    devices = jax.devices()[:a.pp]
    records = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def setup_for(extra: list[str], devs):
        cfg = load_config(None, common + extra)
        degrees = validate(cfg, len(devs))
        from meshtrain.step.state import build_setup
        return build_setup(with_mesh(cfg, degrees), build_mesh(degrees, devs))

    one = {f"mesh.{ax}=1" for ax in MESH_AXES}
    single = setup_for(sorted(one) + ["train.grad_accum=1", f"train.global_batch={b}"], devices[:1])
    plain_ms, op_ms = time_single_device(single, a)
    print(f"plain forward+backward of one microbatch, whole model, one device: {plain_ms:.2f} ms", flush=True)

    update_ms = None
    for kind in a.schedules.split(","):
        v = SCHEDULES[kind]
        mesh_args = sorted(one - {"mesh.pp=1"}) + [f"mesh.pp={a.pp}", f"pipeline.schedule={kind}",
                                                   f"pipeline.virtual_stages={v}"]
        setup = setup_for(mesh_args, devices)
        step_ms, b2b_ms, dispatch_ms, compile_s, update = time_step(setup, a.steps, need_update=update_ms is None)
        update_ms = update if update is not None else update_ms
        rec = analyse(setup, kind, v, step_ms, update_ms, plain_ms, op_ms)
        rec.update(step_ms_back_to_back=b2b_ms, dispatch_ms=dispatch_ms, compile_s=compile_s, device=devices[0].device_kind, jax=jax.__version__,
                   config=common + mesh_args)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        (out / "bench_pipeline.json").write_text(json.dumps(records, indent=1) + "\n")

    table = markdown(records, a, plain_ms, update_ms)
    (out / "bench_pipeline.md").write_text(table + "\n")
    print(table)


def median_ms(fn, *args, steps: int) -> float:
    from benchtime import median_seconds

    return median_seconds(fn, *args, calls=steps) * 1e3


def time_single_device(setup, a):
    """The plain step's forward+backward of one microbatch, and a function timing the pipeline
    ops of a config's chunks on the same device (cached by chunk size and split)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from meshtrain.config.pipeline import last_chunk_remat
    from meshtrain.step.pipeline.ops import Stash, chunk_ops, chunk_weights
    from meshtrain.step.pipeline.ticks import B, F, FIRST, LAST, W
    from meshtrain.step.accumulate import make_grad_fn
    from meshtrain.step.state import make_batches

    c = setup.cfg
    tokens = jnp.zeros((a.micro_batch, c.data.seq_len), jnp.int32)
    params = jax.jit(lambda key: nn.unbox(setup.model.init(key, tokens, tokens, tokens)["params"]))(jax.random.key(0))
    batch = make_batches(setup).batch(0)
    plain_ms = median_ms(jax.jit(make_grad_fn(setup)), params, batch, steps=a.steps)
    shared = {k: v for k, v in params.items() if k != "layers"}
    mb = batch.microbatch(0)
    x = jax.random.normal(jax.random.key(1), (a.micro_batch, c.data.seq_len, c.model.d_model),
                          setup.model.policy.compute_dtype)
    dy = x * 1e-3
    scale = jnp.ones((), jnp.float32)
    cache: dict = {}

    def op_ms(k: int, split: bool, key: tuple[int, int]) -> float:
        """Median ms of op `key` = (kind, position) on a chunk of k layers, timed once."""
        if (k, split, key) not in cache:
            lp = chunk_weights(setup.model, jax.tree.map(lambda arr: arr[:k], params["layers"]), k)
            ops, stash, _ = chunk_ops(setup.model, k, split, (lp, x, mb),
                                      last_remat=last_chunk_remat(c.pipeline.last_chunk_remat, c.train.remat))
            kind, pos = key
            kept = []  # what a B or W spends: the stash its chunk's F fills (and a split B, for W)
            if kind != F and pos != LAST:
                kept = jax.jit(ops[F, pos])(lp, shared, x, dy, mb, scale, []).kept
            if kind == W and pos != FIRST:  # a split B leaves the sites' output gradients (the last's: inputs too)
                kept = kept or [jnp.zeros(buf.shape, buf.dtype) for buf in stash.buffers]
                kept = Stash.written(kept, jax.jit(ops[B, pos])(lp, shared, x, dy, mb, scale, kept).kept)
            cache[(k, split, key)] = median_ms(jax.jit(ops[key]), lp, shared, x, dy, mb, scale, kept,
                                               steps=a.steps)
        return cache[(k, split, key)]

    return plain_ms, op_ms


def time_step(setup, steps: int, need_update: bool):
    """Median train-step time, back-to-back step time, the host's call of a step, compile seconds, and (once) the
    optimizer update alone."""
    import jax
    import optax

    from benchtime import time_train_steps
    from meshtrain.step.state import init_state, make_batches
    from meshtrain.step.train_step import make_train_step

    batches = make_batches(setup)
    run = time_train_steps(make_train_step(setup), init_state(setup), [batches.batch(i) for i in range(2)], steps,
                           warmup=2)
    state = run.state
    update_ms = None
    if need_update:  # the step's optimizer part, same shardings for every schedule
        def update(params, opt_state, grads):
            updates, opt_state = setup.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        update_ms = median_ms(jax.jit(update), state.params, state.opt_state, state.params, steps=steps)
    return run.median_s * 1e3, run.back_to_back_s * 1e3, run.dispatch_s * 1e3, run.first_s, update_ms


def analyse(setup, kind, v, step_ms, update_ms, plain_ms, op_ms) -> dict:
    from meshtrain.step.pipeline.ticks import tick_tables
    from meshtrain.step.pipeline.schedules import make_schedule

    p, m = setup.mesh.shape["pp"], setup.cfg.train.grad_accum
    s = make_schedule(kind, p, m, v)
    ticks = tick_tables(s)
    k = setup.cfg.model.n_layers // (p * v)
    used = sorted({(int(kd), int(pos)) for kd, pos in zip(ticks.kind.ravel(), ticks.position.ravel()) if kd})
    ops = {key: op_ms(k, s.split_backward, key) for key in used}

    def cost(t, st):  # a stage runs its lanes one after the other
        return sum(ops[(int(kd), int(pos))] for kd, pos in zip(ticks.kind[t, st], ticks.position[t, st]) if kd)

    busy = [sum(cost(t, st) for t in range(ticks.n_ticks)) for st in range(p)]
    lockstep_ms = sum(max(cost(t, st) for st in range(p)) for t in range(ticks.n_ticks))
    pipe_ms = step_ms - update_ms
    return dict(schedule=kind, pp=p, microbatches=m, virtual_stages=v, step_ms=step_ms, pipe_ms=pipe_ms,
                update_ms=update_ms, busy_ms=busy, lockstep_ms=lockstep_ms, ticks=ticks.n_ticks,
                pool_slots=ticks.n_slots, lanes=ticks.n_lanes, program_makespan=ticks.makespan,
                schedule_makespan=s.makespan, bubble_measured=p * pipe_ms / sum(busy) - 1,
                bubble_lockstep=p * lockstep_ms / sum(busy) - 1, bubble_formula=s.bubble_ratio,
                overhead_vs_plain=p * pipe_ms / (m * plain_ms) - 1,
                op_ms={f"{'.FBW'[kd]}-{('first', 'mid', 'last')[pos]}": t for (kd, pos), t in ops.items()})


def markdown(records, a, plain_ms, update_ms) -> str:
    head = (f"pp={a.pp}, m={a.microbatches} microbatches of {a.micro_batch}; plain fwd+bwd of one microbatch "
            f"{plain_ms:.2f} ms; optimizer update {update_ms:.2f} ms\n\n"
            "| schedule | step ms | back to back ms | dispatch ms | pipeline ms | bubble measured | lockstep prediction | formula | "
            "overhead vs plain | ticks | pool slots |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['schedule']}{' v=2' if r['virtual_stages'] > 1 else ''} | {r['step_ms']:.1f} | "
            f"{r['step_ms_back_to_back']:.1f} | {r['dispatch_ms']:.1f} | "
            f"{r['pipe_ms']:.1f} | {r['bubble_measured']:.3f} | {r['bubble_lockstep']:.3f} | "
            f"{r['bubble_formula']:.3f} | {r['overhead_vs_plain']:.3f} | {r['ticks']} | {r['pool_slots']} |"
            for r in records]
    return "\n".join([head] + rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, local code first
    main()
