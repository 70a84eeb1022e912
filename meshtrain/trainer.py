"""The training loop: restore or init, then step, log, checkpoint until `train.steps`.

The host never waits on the step it just dispatched: it reads the previous step's small metrics
(one step late), so the device always has the next step queued. Logging, checkpointing and the
non-finite check all run on that lagged view. The batches come built and on the devices from a feed
thread (prefetch.py), so the loop itself only dispatches and reads.
"""
from __future__ import annotations

import dataclasses
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import jax

from meshtrain.checkpoint import Checkpointer, abstract_state
from meshtrain.config import Config, ConfigError, MoEConfig, padded_vocab
from meshtrain.evaluation import evaluate, make_eval_step
from meshtrain.hf.config import hf_dir
from meshtrain.metrics import (MetricsLog, Throughput, active_params, count_params, flops_per_token, memory_in_use,
                               peak_flops)
from meshtrain.prefetch import batch_feed
from meshtrain.profile.window import StepTrace
from meshtrain.train_step import (Setup, TrainState, abstract_params, build_setup, init_state, make_batches,
                                  make_train_step, state_from_params)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class RunResult:
    final_step: int
    resumed_from: int | None
    records: list[dict[str, Any]] = field(default_factory=list)
    eval_records: list[dict[str, Any]] = field(default_factory=list)
    stopped_by_signal: int = 0  # the signal number that stopped the run early, 0 if none
    saved_on_stop: bool = False  # a checkpoint holds the step the run stopped at


class _StopFlag:
    """SIGTERM/SIGINT ask the loop to save and stop after the current step (preemption)."""

    def __init__(self) -> None:
        self.raised = False
        self.signum = 0
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.raised:  # a second signal: stop now
            raise KeyboardInterrupt
        self.raised, self.signum = True, signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def restore_or_init(setup: Setup, ckpt: Checkpointer | None) -> tuple[TrainState, int | None]:
    latest = ckpt.latest_step() if ckpt else None
    if latest is None:
        if (directory := hf_dir(setup.cfg.checkpoint.init_from)) is not None:
            from meshtrain.hf.weights import load_params
            params = load_params(directory, setup.cfg.model, abstract_params(setup), setup.state_shardings.params)
            return state_from_params(setup, params), None
        return init_state(setup), None
    check_compatible(setup.cfg, ckpt.saved_config(latest), ckpt.directory, latest)
    shapes = jax.eval_shape(lambda: init_state(setup))  # traced only: no parameters are drawn
    return ckpt.restore(latest, abstract_state(setup.state_shardings, shapes)), latest


# Model fields that decide the parameter tree; the rest (kernels, norms' eps, ...) may change on resume.
SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                "tie_embeddings", "scan_layers")
MOE_SHAPE_FIELDS = ("n_experts", "d_ff_expert", "n_shared", "every")


def check_compatible(cfg: Config, saved: dict, directory, step: int) -> None:
    """Refuse, with the differing fields named, to restore a checkpoint of another model shape."""
    problems = [f"model.{k}={getattr(cfg.model, k)!r} but the checkpoint has {saved['model'][k]!r}"
                for k in SHAPE_FIELDS if saved["model"].get(k) != getattr(cfg.model, k)]
    saved_moe = saved.get("moe", {})  # checkpoints older than the moe section are dense
    problems += [f"moe.{k}={getattr(cfg.moe, k)!r} but the checkpoint has {saved_moe.get(k, getattr(MoEConfig, k))!r}"
                 for k in MOE_SHAPE_FIELDS if saved_moe.get(k, getattr(MoEConfig, k)) != getattr(cfg.moe, k)]
    saved_vocab = padded_vocab(cfg.model, saved["mesh"]["tp"])  # vocab_size itself matched above
    if not problems and saved_vocab != padded_vocab(cfg.model, cfg.mesh.tp):
        problems.append(f"mesh.tp={cfg.mesh.tp} pads model.vocab_size={cfg.model.vocab_size} differently from the "
                        f"checkpoint's mesh.tp={saved['mesh']['tp']} ({saved_vocab} rows); use a tp that pads alike")
    # fp8_delayed keeps amax histories in the state: their presence and length are part of its shape.
    fp8_state = lambda pc: (pc.get("matmul") == "fp8_delayed") and (pc["fp8_amax_history"], pc["fp8_exclude"])  # noqa: E731
    if fp8_state(saved["precision"]) != fp8_state(dataclasses.asdict(cfg.precision)):
        problems.append(f"precision.matmul={cfg.precision.matmul!r} (fp8_amax_history={cfg.precision.fp8_amax_history}, "
                        f"fp8_exclude={cfg.precision.fp8_exclude!r}) keeps other fp8 state than the checkpoint's "
                        f"precision.matmul={saved['precision'].get('matmul', 'bf16')!r}")
    if problems:
        raise ConfigError([f"checkpoint.dir={str(directory)!r} step {step} is another model: {p}; resume with the "
                           f"same model settings or point checkpoint.dir elsewhere" for p in problems])


def keep_saved_schedule(setup: Setup, saved: dict) -> Setup:
    """On resume, the learning-rate schedule stays the checkpoint's unless train.schedule_steps is given:
    a larger train.steps alone would otherwise stretch the cosine and make the rate jump."""
    t = setup.cfg.train
    saved_len = saved["train"].get("schedule_steps") or saved["train"]["steps"]
    if t.schedule_steps or saved_len == t.total_schedule_steps:
        return setup
    if jax.process_index() == 0:
        past = f" (from step {saved_len} on it stays at its final value)" if t.steps > saved_len else ""
        print(f"meshtrain: train.steps={t.steps} but the checkpoint was trained on a {saved_len}-step learning-rate "
              f"schedule: keeping that schedule{past}; set train.schedule_steps={t.steps} to stretch it instead",
              flush=True)
    cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(t, schedule_steps=saved_len))
    return dataclasses.replace(setup, cfg=cfg)


def train(cfg: Config, mesh: jax.sharding.Mesh) -> RunResult:
    t = cfg.train
    setup = build_setup(cfg, mesh)
    batches = make_batches(setup)
    eval_batches = make_batches(setup, "eval") if cfg.eval.every else None
    use_ckpt = cfg.checkpoint.every > 0 or Checkpointer.exists(cfg.checkpoint_dir)
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save) \
        if use_ckpt else None
    began = time.perf_counter()
    state, resumed = restore_or_init(setup, ckpt)
    jax.block_until_ready(state)  # the first step would wait for it anyway; here it can be timed
    state_s = time.perf_counter() - began
    if resumed is not None:
        setup = keep_saved_schedule(setup, ckpt.saved_config(resumed))
    start = int(state.step)
    result = RunResult(final_step=start, resumed_from=resumed)
    if start >= t.steps:
        print(f"checkpoint at step {start} already reaches train.steps={t.steps}; nothing to do")
        return result

    step_fn = make_train_step(setup)
    eval_step = make_eval_step(setup) if eval_batches else None
    n_params = count_params(state.params)
    n_active = active_params(n_params, cfg.model, cfg.moe)
    tokens_per_step = t.global_batch * cfg.data.seq_len
    flops_step = flops_per_token(cfg.model, n_active, cfg.data.seq_len) * tokens_per_step
    peak = peak_flops(mesh.devices.flat[0])
    n_dev = mesh.devices.size
    if jax.process_index() == 0:  # before the progress bar exists, so the two never share a line
        where = f"resumed from step {resumed}" if resumed is not None else (
            f"initialized from {cfg.checkpoint.init_from}" if cfg.checkpoint.init_from else "fresh start")
        active = f" ({n_active / 1e6:.2f}M active)" if n_active != n_params else ""
        print(f"meshtrain: {n_params / 1e6:.2f}M parameters{active}, {tokens_per_step:,} tokens/step, {where} "
              f"(state ready in {state_s:.1f} s)", flush=True)
    log = MetricsLog(cfg.run.dir, total_steps=t.steps, first_step=start, progress=cfg.run.progress,
                     tensorboard=cfg.run.tensorboard)

    timer = Throughput()

    def wait_for(step_no: int, outputs) -> None:
        """Wait for step `step_no`'s outputs; the moment they exist ends that step's interval."""
        jax.block_until_ready(outputs)
        timer.finished(step_no)

    def paused(work, *args):
        """Run host-side work (save, eval) off the throughput clock; the step it waits for stays on it."""
        wait_for(done, state)
        began = time.perf_counter()
        out = work(*args)
        timer.pause(time.perf_counter() - began)
        return out
    pending: tuple[int, dict] | None = None  # (step number, device metrics) not yet read by the host

    def read(step_no: int, metrics: dict) -> None:
        m = jax.device_get(metrics)
        if int(m["nonfinite_run"]) >= t.max_nonfinite:
            raise NonFiniteError(
                f"step {step_no}: {int(m['nonfinite_run'])} consecutive steps had a non-finite loss or gradient "
                f"(train.max_nonfinite={t.max_nonfinite}); parameters were left at the last good step. Lower "
                f"train.lr, raise train.warmup_steps, or check the data.")
        first = timer.mark is None  # nothing finished before: this step compiled, which can take minutes
        if first:
            log.write(f"meshtrain: step {step_no} done {time.perf_counter() - timer.started:.1f} s into the loop "
                      f"(compiling the step included)")
        if step_no % t.log_every and step_no != t.steps:
            if first:
                timer.first_step_done(step_no)
            return
        includes_compile = first
        dt, paused_s = timer.seconds_per_step(step_no)
        rec = dict(step=step_no, loss=float(m["loss"]), grad_norm=float(m["grad_norm"]), lr=float(m["lr"]),
                   tokens_per_s=tokens_per_step / dt, step_time_s=dt,
                   tflops_per_device=flops_step / dt / n_dev / 1e12,
                   mfu=(flops_step / dt / n_dev / peak) if peak else None, nonfinite_run=int(m["nonfinite_run"]),
                   includes_compile=includes_compile, paused_s=paused_s, **memory_in_use())
        moe = {k: float(v) for k, v in m.items() if k.startswith("moe_")}
        if moe:  # `loss` stays the cross-entropy; `objective` adds the weighted auxiliary losses
            rec.update(objective=float(m["objective"]), **moe)
        log.log(rec)
        result.records.append(rec)

    trace = StepTrace(cfg.run, start, log.write)
    feed = batch_feed(batches.batch, range(start, t.steps), cfg.data.prefetch)
    with _StopFlag() as stop:
        try:
            for step in range(start, t.steps):
                # Starting a trace waits for `state`, which the read below waits for anyway.
                timer.pause(trace.begin(step, wait=lambda: wait_for(step, state)))
                batch = feed.get(step)
                with trace.step(step):
                    state, metrics = step_fn(state, batch)
                done = step + 1
                if jax.tree.leaves(metrics)[0].is_ready():  # run inline by the dispatch (a CPU may)
                    timer.finished(done)
                if pending is not None:
                    read(*pending)
                pending = (done, metrics)
                if trace.active:  # the program: the same signature as the step just run, a cache hit
                    timer.pause(trace.after(step, wait=lambda: wait_for(done, (state, metrics)),
                                            program=lambda: step_fn.lower(state, batch).compile().as_text()))
                log.advance()
                if ckpt and cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == t.steps):
                    paused(ckpt.save, done, state, setup.cfg.to_dict())
                if eval_step and not stop.raised and (done % cfg.eval.every == 0 or done == t.steps):
                    rec = dict(step=done, **paused(evaluate, eval_step, state.params, eval_batches, cfg.eval.batches))
                    log.log_eval(rec)
                    result.eval_records.append(rec)
                if stop.raised:
                    break
            if pending is not None:
                read(*pending)
            result.final_step = int(state.step)
            if stop.raised:
                result.stopped_by_signal = stop.signum
                if ckpt and result.final_step not in ckpt.all_steps():
                    ckpt.save(result.final_step, state, setup.cfg.to_dict())
                result.saved_on_stop = ckpt is not None
                name = signal.Signals(stop.signum).name
                if ckpt:
                    log.write(f"stopped by signal after step {result.final_step} ({name}); checkpoint saved in "
                              f"{ckpt.directory}: run the same command to resume")
                else:
                    log.write(f"stopped by signal after step {result.final_step} ({name}) WITHOUT a checkpoint "
                              f"(checkpoint.every=0): this run cannot be resumed; set checkpoint.every to make it so")
        finally:
            feed.close()
            trace.stop()
            log.close()
            if ckpt:
                ckpt.wait()
                ckpt.close()
    return result
