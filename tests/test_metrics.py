"""Throughput accounting and the metrics file."""
import json
import re
import statistics

import jax
import jax.numpy as jnp
import pytest

from helpers import make_setup, single_device, tiny_config
from meshtrain import trainer
from meshtrain.config import build_config, validate, with_mesh
from meshtrain.mesh import build_mesh
from meshtrain.metrics import MetricsLog, count_params, flops_per_token, peak_flops
from meshtrain.step.state import init_state


def test_llama1b_parameter_count_and_flops_match_the_peers():
    """The peers' 1.36B shape: same parameter count and the same FLOP formula (6N + 6·L·T·D)."""
    cfg = build_config({}, ["model.preset=llama1b", "data.seq_len=2048", "train.global_batch=8",
                            "mesh.fsdp=1"])
    setup = make_setup(cfg, 1)
    n = count_params(jax.eval_shape(lambda: init_state(setup)).params)
    L, D, F, V = 24, 2048, 5632, 32000
    assert n == 2 * V * D + L * (4 * D * D + 3 * D * F + 2 * D) + D  # 1,364,297,728
    assert flops_per_token(cfg.model, n, 2048) == 6 * n + 6 * L * 2048 * D


def test_no_mfu_peak_on_cpu():
    assert peak_flops(jax.devices()[0]) is None


def test_fresh_run_moves_old_metrics_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    log = MetricsLog(str(tmp_path), total_steps=3, first_step=0, progress=False)
    log.close()
    moved = list(tmp_path.glob("metrics.*.jsonl"))
    assert len(moved) == 1 and json.loads(moved[0].read_text())["loss"] == 9.0
    # Named by the old file's time, readable: metrics.2026-11-23T09-30-12.jsonl
    assert re.fullmatch(r"metrics\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d\.jsonl", moved[0].name), moved[0].name
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resumed_run_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    MetricsLog(str(tmp_path), total_steps=3, first_step=1, progress=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert not list(tmp_path.glob("metrics.*.jsonl"))


# ------------------------------------------------------------------ step time around host-side work

BURN_N, BURN_ROUNDS = 512, 6  # tens of milliseconds of matmuls per step on a CPU core or two


def with_device_work(make_train_step, dispatch: str):
    """make_train_step whose steps also run a chain of matmuls on the device, after the real step and
    before the state and metrics are ready: a step that the host sees finish only tens of milliseconds
    after dispatching it, as on a GPU, where the tiny model's own step would be over at once.

    `dispatch` says when the call returns: "async" at once (as on a GPU); "inline_when_ready" only
    after the step ran if its inputs were ready (as a CPU runtime may run a step whose inputs are ready
    in the calling thread: the step right after the host waited for a checkpoint or an evaluation);
    "inline" always after the step ran."""
    def make(setup):
        step = make_train_step(setup)

        @jax.jit
        def burn(state, metrics):
            x = jnp.full((BURN_N, BURN_N), 1e-3) + state.step.astype(jnp.float32) * 1e-6
            for _ in range(BURN_ROUNDS):
                x = jnp.tanh(x @ x)
            never = jnp.sum(x) > 1e30  # |tanh| <= 1, but XLA cannot know: the outputs wait for the matmuls
            return (state.replace(step=state.step + never.astype(state.step.dtype)),
                    dict(metrics, loss=jnp.where(never, jnp.nan, metrics["loss"])))

        def run(state, batch):
            inline = dispatch == "inline" or (
                dispatch == "inline_when_ready" and all(x.is_ready() for x in jax.tree.leaves(state)))
            out = burn(*step(state, batch))
            return jax.block_until_ready(out) if inline else out
        return run
    return make


@pytest.fixture(scope="module", params=["async", "inline_when_ready", "inline"])
def paused_run(request, tmp_path_factory):
    """One device, every step logged: the trace of steps 2:4 starts once step 2 is done and is written
    once step 4 is, a checkpoint is saved once step 5 is (and 7), an evaluation runs once step 6 is
    (and 7). Each of them lies in the interval of the step after."""
    run_dir = tmp_path_factory.mktemp("paused")
    cfg = single_device(tiny_config("train.steps=7", "train.log_every=1", "run.profile_steps=2:4",
                                    "checkpoint.every=5", "eval.every=6", "eval.batches=1", f"run.dir={run_dir}"))
    degrees = validate(cfg, 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "make_train_step", with_device_work(trainer.make_train_step, request.param))
        return trainer.train(with_mesh(cfg, degrees), build_mesh(degrees, jax.devices()[:1]))


def test_host_work_moves_no_device_time_between_intervals(paused_run):
    """Each interval reports its own step's device time: waiting for the device before the trace is
    written (or a checkpoint saved, or an evaluation run) must not pull the next step's device time
    into this interval and leave the next one empty (the written interval once read 1 ms/step). This
    holds whether the dispatch returns at once, or runs the step inline when its inputs are ready (a CPU
    runtime may, right after such a wait: a checkpoint interval once read twice the step time and the
    next one 2 ms), or always runs it inline."""
    timed = {r["step"]: r for r in paused_run.records if not r["includes_compile"]}
    assert sorted(timed) == [2, 3, 4, 5, 6, 7]
    median = statistics.median(r["step_time_s"] for r in timed.values())
    for s, r in timed.items():
        assert median / 2 < r["step_time_s"] < median * 2, (s, {s: r["step_time_s"] for s, r in timed.items()})
    # The host-side work (starting the trace too) is taken out of the interval it ran in.
    assert all(timed[s]["paused_s"] > 0 for s in (3, 5, 6, 7)), {s: r["paused_s"] for s, r in timed.items()}


def test_the_bars_rate_counts_from_the_end_of_the_first_step(tmp_path, monkeypatch):
    """The first step carries the compile: the bar's rate (and its time left) must not average it in."""
    import sys
    import time

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    log = MetricsLog(str(tmp_path), total_steps=100, first_step=0, progress=True)
    time.sleep(0.5)  # "compiling"
    log.advance()
    for _ in range(3):
        time.sleep(0.01)
        log.advance()
    info = log.bar.format_dict
    assert info["n"] == 4 and info["initial"] == 1
    assert info["elapsed"] < 0.3, info  # the clock restarted after the first step
    assert (info["n"] - info["initial"]) / info["elapsed"] > 20, info  # ~100 steps/s, not ~8
    log.bar.close()
