"""The training loop: restore or init, then step, log, checkpoint until `train.steps`.

    for each step:  dispatch it → read the previous step's metrics → maybe save → maybe evaluate → maybe stop

The host never waits on the step it just dispatched: it reads the previous step's small metrics
(one step late), so the device always has the next step queued. Logging, checkpointing and the
non-finite check all run on that lagged view. The batches come built and on the devices from a feed
thread (prefetch.py), so the loop itself only dispatches and reads. Host work that must wait for a
step (a save, an evaluation, a trace) runs off the throughput clock (metrics.Throughput).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain import signals
from meshtrain.checkpoint import Checkpointer
from meshtrain.lock import RunLock
from meshtrain.config import Config
from meshtrain.evaluation import evaluate, make_eval_step
from meshtrain.metrics import (MetricsLog, Throughput, active_params, count_params, flops_per_token, memory_in_use,
                               peak_flops)
from meshtrain.prefetch import batch_feed
from meshtrain.profile.window import StepTrace
from meshtrain.resume import keep_saved_schedule, restore_or_init
from meshtrain.step.state import Setup, TrainState, build_setup, make_batches
from meshtrain.step.train_step import make_train_step
from meshtrain.tracking import open_trackers


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


def train(cfg: Config, mesh: jax.sharding.Mesh, banner: str = "") -> RunResult:
    """`banner`: the start-up lines printed before (launch.banner); the trackers record them with the config."""
    # One run per run.dir and checkpoint.dir: a second one would delete or rotate the first one's steps.
    use_ckpt = cfg.checkpoint.every > 0 or cfg.checkpoint.final or Checkpointer.exists(cfg.checkpoint_dir)
    dirs = [("run.dir", cfg.run.dir)] + ([("checkpoint.dir", cfg.checkpoint_dir)] if use_ckpt else [])
    with RunLock(dirs):
        return _train(cfg, mesh, use_ckpt, banner)


def _train(cfg: Config, mesh: jax.sharding.Mesh, use_ckpt: bool, banner: str) -> RunResult:
    t = cfg.train
    setup = build_setup(cfg, mesh)
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save,
                        timeout_s=cfg.checkpoint.timeout_s) if use_ckpt else None
    began = time.perf_counter()
    state, resumed = restore_or_init(setup, ckpt)
    jax.block_until_ready(state)  # the first step would wait for it anyway; here it can be timed
    state_s = time.perf_counter() - began
    if resumed is not None:
        setup = keep_saved_schedule(setup, ckpt.saved_config(resumed))
    start = int(state.step)
    if start >= t.steps:
        print(f"checkpoint at step {start} already reaches train.steps={t.steps}; nothing to do")
        return RunResult(final_step=start, resumed_from=resumed)

    loop = _Loop(setup, state, ckpt, resumed, state_s, banner)
    with signals.loop() as stop:  # SIGTERM/SIGINT: save and stop after the current step (preemption)
        try:
            for step in range(start, t.steps):
                done = loop.dispatch(step)  # queues the step, then reads the one before: never waits for it
                loop.maybe_save(done)
                if not stop.raised:
                    loop.maybe_evaluate(done)
                if stop.raised:
                    break
            loop.read_previous()  # the last step's metrics
            loop.finish(stop.signum if stop.raised else 0)
        except BaseException:
            loop.close(failed=True)  # the trackers mark the run failed (W&B: its exit code)
            raise
        loop.close()
    return loop.result


class _Loop:
    """The loop's state and its named steps (see the module docstring)."""

    def __init__(self, setup: Setup, state: TrainState, ckpt: Checkpointer | None, resumed: int | None,
                 state_s: float, banner: str):
        cfg, t = setup.cfg, setup.cfg.train
        self.setup, self.state, self.ckpt, self.t = setup, state, ckpt, t
        start = int(state.step)
        self.result = RunResult(final_step=start, resumed_from=resumed)
        self.step_fn = make_train_step(setup)
        eval_batches = make_batches(setup, "eval") if cfg.eval.every else None
        self.eval_batches = eval_batches
        self.eval_step = make_eval_step(setup) if eval_batches else None
        n_params = count_params(state.params)
        n_active = active_params(n_params, cfg.model, cfg.moe)
        self.tokens_per_step = t.global_batch * cfg.data.seq_len
        self.flops_step = flops_per_token(cfg.model, n_active, cfg.data.seq_len) * self.tokens_per_step
        self.peak = peak_flops(setup.mesh.devices.flat[0])
        self.n_dev = setup.mesh.devices.size
        trackers = []
        if jax.process_index() == 0:  # before the progress bar exists, so the two never share a line
            where = f"resumed from step {resumed}" if resumed is not None else (
                f"initialized from {cfg.checkpoint.init_from}" if cfg.checkpoint.init_from else "fresh start")
            active = f" ({n_active / 1e6:.2f}M active)" if n_active != n_params else ""
            line = (f"meshtrain: {n_params / 1e6:.2f}M parameters{active}, {self.tokens_per_step:,} tokens/step, "
                    f"{where} (state ready in {state_s:.1f} s)")
            print(line, flush=True)
            # Only the process that writes metrics tracks them (meshtrain/tracking.py says why).
            trackers = open_trackers(cfg, "\n".join(filter(None, [banner, line])), resumed=start > 0)
        self.log = MetricsLog(cfg.run.dir, total_steps=t.steps, first_step=start, progress=cfg.run.progress,
                              trackers=trackers)
        self.timer = Throughput()
        self.trace = StepTrace(cfg.run, start, self.log.write)
        self.feed = batch_feed(make_batches(setup).batch, range(start, t.steps), cfg.data.prefetch)
        self.done = start  # steps dispatched
        self.nonfinite_run = 0  # consecutive non-finite steps up to the last step read
        self.pending: tuple[int, dict] | None = None  # (step number, device metrics) not yet read by the host

    def dispatch(self, step: int) -> int:
        """Queue step `step` on the devices, then read the previous step's metrics; returns the number of
        steps dispatched."""
        # Starting a trace waits for the state, which the read after this dispatch waits for anyway.
        self.timer.pause(self.trace.begin(step, wait=lambda: self.wait_for(step, self.state)))
        batch = self.feed.get(step)
        with self.trace.step(step):
            self.state, metrics = self.step_fn(self.state, batch)
        self.done = step + 1
        self.timer.watch(self.done, jax.tree.leaves(metrics)[0])  # the step's end, seen as it happens
        self.read_previous()
        self.pending = (self.done, metrics)
        if self.trace.active:  # the program: the same signature as the step just run, a cache hit
            done, state = self.done, self.state
            self.timer.pause(self.trace.after(step, wait=lambda: self.wait_for(done, (state, metrics)),
                                              program=lambda: self.step_fn.lower(state, batch).compile().as_text()))
        self.log.advance()
        return self.done

    def read_previous(self) -> None:
        """Read the metrics of the step before the one just dispatched (the host is one step behind)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.record(*pending)

    def maybe_save(self, done: int) -> None:
        """Save at checkpoint.every and (checkpoint.final) after the last step, unless step `done` is part of a
        non-finite streak: its parameters are the last good step's, but saving it would rotate a finite step
        out and (if the streak stops the run) leave a step that only reproduces the streak as the newest."""
        if not self.ckpt:
            return
        self.ckpt.check()  # a failed async write stops the run at the next step, not at the next save
        every, final = self.setup.cfg.checkpoint.every, self.setup.cfg.checkpoint.final
        if (every and done % every == 0) or ((every or final) and done == self.t.steps):
            self.read_previous()  # the save waits for this step anyway; its metrics say whether it was finite
            if self.nonfinite_run:
                self.log.write(f"meshtrain: step {done} not saved: {self.nonfinite_run} non-finite step(s) in a row; "
                               f"the newest checkpoint stays the last finite one")
                return
            self.paused(self.ckpt.save, done, self.state, self.setup.cfg.to_dict(), self.setup.layers_order)

    def maybe_evaluate(self, done: int) -> None:
        every = self.setup.cfg.eval.every
        if self.eval_step and (done % every == 0 or done == self.t.steps):
            rec = dict(step=done, **self.paused(evaluate, self.eval_step, self.state.params, self.eval_batches,
                                                self.setup.cfg.eval.batches))
            self.log.log_eval(rec)
            self.result.eval_records.append(rec)

    def finish(self, signum: int) -> None:
        """The run ends: at train.steps, or stopped by a signal (then saved, and the log says whether it
        can be resumed)."""
        result = self.result
        result.final_step = int(self.state.step)
        if not signum:
            return
        result.stopped_by_signal = signum
        if self.ckpt and result.final_step not in self.ckpt.all_steps() and not self.nonfinite_run:
            self.ckpt.save(result.final_step, self.state, self.setup.cfg.to_dict(), self.setup.layers_order)
        result.saved_on_stop = self.ckpt is not None and not self.nonfinite_run
        name = signal.Signals(signum).name
        if self.ckpt and self.nonfinite_run:
            self.log.write(f"stopped by signal after step {result.final_step} ({name}) in a non-finite streak: not "
                           f"saved; {self.ckpt.directory} keeps the last finite step: run the same command to resume")
        elif self.ckpt:
            self.log.write(f"stopped by signal after step {result.final_step} ({name}); checkpoint saved in "
                           f"{self.ckpt.directory}: run the same command to resume")
        else:
            self.log.write(f"stopped by signal after step {result.final_step} ({name}) WITHOUT a checkpoint "
                           f"(checkpoint.every=0, checkpoint.final=false): this run cannot be resumed; set "
                           f"checkpoint.final=true or checkpoint.every to make it so")

    def close(self, failed: bool = False) -> None:
        self.feed.close()
        self.timer.close()
        self.trace.stop()
        self.log.close(failed)
        if self.ckpt:
            try:
                self.ckpt.wait()
            finally:
                self.ckpt.close()

    def nonfinite_advice(self) -> str:
        """What to change, by the likelier cause: weights that are not finite themselves (an import), the
        fp16 loss scale backing off (each back-off is a skipped step), or the optimization diverging."""
        cfg = self.setup.cfg
        finite = jax.jit(lambda p: jax.tree.reduce(lambda a, x: a & jnp.isfinite(x).all(), p, jnp.bool_(True)))
        if not bool(finite(self.state.params)):
            source = cfg.checkpoint.init_from or f"the checkpoint in {cfg.checkpoint_dir}"
            return f"The parameters themselves hold NaN or inf (from {source}): check those weights."
        if cfg.precision.compute == "float16":
            return ("With precision.compute=float16 these steps overflowed at the smallest loss scale (1): the "
                    "values themselves leave fp16's range; lower train.lr or use bfloat16.")
        return "Lower train.lr, raise train.warmup_steps, or check the data."

    # ----------------------------------------------------------------------------- the clock

    def wait_for(self, step_no: int, outputs) -> None:
        """Wait for step `step_no`'s outputs; the moment they exist ends that step's interval."""
        jax.block_until_ready(outputs)
        self.timer.finished(step_no)

    def paused(self, work, *args):
        """Run host-side work (save, eval) off the throughput clock; the step it waits for stays on it."""
        self.wait_for(self.done, self.state)
        began = time.perf_counter()
        out = work(*args)
        self.timer.pause(time.perf_counter() - began)
        return out

    # ----------------------------------------------------------------------------- the record

    def record(self, step_no: int, metrics: dict) -> None:
        """Check, log and keep the metrics of step `step_no`."""
        t, timer = self.t, self.timer
        m = jax.device_get(metrics)
        self.nonfinite_run = int(m["nonfinite_run"])
        if int(m["nonfinite_run"]) >= t.max_nonfinite:
            raise NonFiniteError(
                f"step {step_no}: {int(m['nonfinite_run'])} consecutive steps had a non-finite loss or gradient "
                f"(train.max_nonfinite={t.max_nonfinite}); parameters were left at the last good step. "
                f"{self.nonfinite_advice()}")
        first = timer.mark is None  # nothing finished before: this step compiled, which can take minutes
        if first:
            self.log.write(f"meshtrain: step {step_no} done {time.perf_counter() - timer.started:.1f} s into the "
                           f"loop (compiling the step included)")
        if step_no % t.log_every and step_no != t.steps:
            if first:
                timer.first_step_done(step_no)
            return
        dt, paused_s = timer.seconds_per_step(step_no)
        flops_s = self.flops_step / dt / self.n_dev
        rec = dict(step=step_no, loss=float(m["loss"]), grad_norm=float(m["grad_norm"]), lr=float(m["lr"]),
                   tokens_per_s=self.tokens_per_step / dt, step_time_s=dt, tflops_per_device=flops_s / 1e12,
                   mfu=(flops_s / self.peak) if self.peak else None, nonfinite_run=int(m["nonfinite_run"]),
                   includes_compile=first, paused_s=paused_s, **memory_in_use())
        moe = {k: float(v) for k, v in m.items() if k.startswith("moe_")}
        if moe:  # `loss` stays the cross-entropy; `objective` adds the weighted auxiliary losses
            rec.update(objective=float(m["objective"]), **moe)
        self.log.log(rec)
        self.result.records.append(rec)
