"""Checkpoint and resume, each run a fresh process as after a real stop.

Same mesh: the resumed losses are bitwise equal to an uninterrupted run (the data is f(seed, step)
and the state round-trips exactly). Another mesh: only reduction order changes, so rtol 1e-5.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import CLI_TINY, cli_env, logged_losses, run_cli

MESH_A = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"]
# One learning-rate schedule for every run, as long as the longest (test_sigterm_saves_and_stops): its length is
# compiled into the step, so the runs on a mesh share one compiled program through the session's compilation
# cache instead of each schedule compiling its own.
SCHEDULE = "train.schedule_steps=400"
SIX = ["train.steps=6", SCHEDULE]
TWENTY = ["train.steps=20", SCHEDULE]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """20 steps without a stop; the runs stopped and resumed compare their steps (up to 6 or 20) with these."""
    run_dir = tmp_path_factory.mktemp("full")
    run_cli(*MESH_A, *TWENTY, f"run.dir={run_dir}")
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(1, 21))
    return losses


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory):
    """A run of the shared schedule stopped after step 3 with a checkpoint there."""
    run_dir = tmp_path_factory.mktemp("stopped")
    run_cli(*MESH_A, "train.steps=3", SCHEDULE, "checkpoint.every=3", f"run.dir={run_dir}")
    assert (run_dir / "checkpoints" / "3").is_dir()
    return run_dir


def resume(from_dir: Path, to_dir: Path, *overrides: str) -> tuple[dict[int, float], str]:
    shutil.copytree(from_dir / "checkpoints", to_dir / "checkpoints")
    proc = run_cli(*SIX, "checkpoint.every=3", f"run.dir={to_dir}", *overrides)
    return logged_losses(to_dir), proc.stdout


def test_resume_same_mesh_is_bitwise(uninterrupted, stopped_at_3, tmp_path):
    losses, out = resume(stopped_at_3, tmp_path, *MESH_A)
    assert "resumed from step 3" in out
    assert sorted(losses) == [4, 5, 6]
    assert [losses[s] for s in (4, 5, 6)] == [uninterrupted[s] for s in (4, 5, 6)]
    assert logged_losses(stopped_at_3) == {s: uninterrupted[s] for s in (1, 2, 3)}


def test_resume_onto_another_mesh(uninterrupted, stopped_at_3, tmp_path):
    losses, out = resume(stopped_at_3, tmp_path, "mesh.dp=1", "mesh.fsdp=4", "mesh.tp=2", "train.zero_stage=3")
    assert "resumed from step 3" in out
    np.testing.assert_allclose([losses[s] for s in (4, 5, 6)], [uninterrupted[s] for s in (4, 5, 6)], rtol=1e-5)


def test_resume_with_the_layers_unrolled(uninterrupted, stopped_at_3, tmp_path):
    """The scanned run's checkpoint carries on with `model.scan_layers=false` (the GPU configs unroll; scan_layout.py):
    fp32 losses of the run that never stopped, within the reordering of the same sums."""
    losses, out = resume(stopped_at_3, tmp_path, *MESH_A, "model.scan_layers=false")
    assert "resumed from step 3" in out
    np.testing.assert_allclose([losses[s] for s in (4, 5, 6)], [uninterrupted[s] for s in (4, 5, 6)], rtol=1e-5)


def test_half_written_checkpoint_is_never_loaded(uninterrupted, stopped_at_3, tmp_path):
    """A save killed before its commit leaves only Orbax's temporary directory: resume skips it."""
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(stopped_at_3 / "checkpoints", ckpt)
    partial = ckpt / "5.orbax-checkpoint-tmp-1763780000000000"
    shutil.copytree(ckpt / "3", partial)
    (partial / "state").rename(partial / "state.partial")  # torn: the state is not all there
    proc = run_cli(*MESH_A, *SIX, "checkpoint.every=3", f"run.dir={tmp_path}")
    assert "resumed from step 3" in proc.stdout
    losses = logged_losses(tmp_path)
    assert [losses[s] for s in (4, 5, 6)] == [uninterrupted[s] for s in (4, 5, 6)]
    assert not partial.exists(), "left-over temporary checkpoint directories are cleaned at start"


def committed_steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit())


@pytest.mark.slow
def test_process_killed_while_saving_resumes_from_last_commit(uninterrupted, tmp_path):
    """SIGKILL a run that saves every step; the restart continues from the last committed step and
    matches an uninterrupted run bitwise from there on."""
    steps, full = TWENTY, uninterrupted
    killed_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "meshtrain.run", *CLI_TINY, *MESH_A, *steps, "checkpoint.every=1",
           "checkpoint.keep=2", f"run.dir={killed_dir}"]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(s >= 5 for s in committed_steps(killed_dir / "checkpoints")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = committed_steps(killed_dir / "checkpoints")
    assert before and before[-1] < 20

    out = run_cli(*MESH_A, *steps, "checkpoint.every=10", f"run.dir={killed_dir}").stdout
    resumed = int(re.search(r"resumed from step (\d+)", out).group(1))
    assert resumed == before[-1]
    losses = logged_losses(killed_dir)
    later = [s for s in range(resumed + 1, 21)]
    assert [losses[s] for s in later] == [full[s] for s in later]


@pytest.mark.slow
def test_sigterm_saves_and_stops(tmp_path):
    """Preemption: SIGTERM makes the run save the step it reached and exit 0; a restart resumes there."""
    steps = ["train.steps=400", SCHEDULE]
    cmd = [sys.executable, "-m", "meshtrain.run", *CLI_TINY, *MESH_A, *steps, "checkpoint.every=1000",
           f"run.dir={tmp_path}"]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    stopped = int(re.search(r"stopped by signal after step (\d+)", out).group(1))
    assert 3 <= stopped < 400
    assert committed_steps(tmp_path / "checkpoints") == [stopped]
    out = run_cli(*MESH_A, f"train.steps={stopped + 2}", SCHEDULE, f"run.dir={tmp_path}").stdout
    assert f"resumed from step {stopped}" in out
    assert max(logged_losses(tmp_path)) == stopped + 2


def test_resuming_another_model_shape_is_a_config_error(stopped_at_3, tmp_path):
    shutil.copytree(stopped_at_3 / "checkpoints", tmp_path / "checkpoints")
    proc = run_cli(*MESH_A, *SIX, "model.d_model=32", f"run.dir={tmp_path}", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model.d_model=32 but the checkpoint has 64" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_damaged_newest_step_resumes_from_the_one_before(uninterrupted, stopped_at_3, tmp_path):
    """A newer step whose data file was cut short: resume says so, falls back to step 3, sets the damaged
    step aside and goes on bitwise equal to an uninterrupted run."""
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(stopped_at_3 / "checkpoints", ckpt)
    shutil.copytree(ckpt / "3", ckpt / "5")
    data = max((p for p in (ckpt / "5" / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])
    proc = run_cli(*MESH_A, *SIX, "checkpoint.every=3", f"run.dir={tmp_path}")
    assert f"checkpoint step 5 in {ckpt} cannot be used" in proc.stdout and "falling back to step 3" in proc.stdout
    assert "resumed from step 3" in proc.stdout and "Traceback" not in proc.stderr
    losses = logged_losses(tmp_path)
    assert [losses[s] for s in (4, 5, 6)] == [uninterrupted[s] for s in (4, 5, 6)]
    assert committed_steps(ckpt) == [3, 6] and (ckpt / "5.damaged").is_dir()


def test_resuming_with_another_seed_is_refused_unless_allowed(stopped_at_3, tmp_path):
    shutil.copytree(stopped_at_3 / "checkpoints", tmp_path / "checkpoints")
    proc = run_cli(*MESH_A, *SIX, "train.seed=1", f"run.dir={tmp_path}", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and lines[0].startswith("config error: train.seed=1 but checkpoint.dir=")
    assert "checkpoint.allow_data_change=true" in lines[0] and "Traceback" not in proc.stderr


def test_fp8_state_is_compared_by_the_sites_it_keeps_not_the_patterns_spelling(tmp_path):
    """A checkpoint saved under the older fp8_exclude default ("embedding,lm_head,*router": two patterns that
    matched no site) keeps the same amax histories as today's default, so it resumes; one that keeps another
    site's does not."""
    from helpers import tiny_config
    from meshtrain.config import ConfigError
    from meshtrain.resume import check_compatible

    cfg = tiny_config("precision.matmul=fp8_delayed")
    saved = cfg.to_dict()
    saved["precision"]["fp8_exclude"] = "embedding,lm_head,*router"
    check_compatible(cfg, saved, tmp_path, 3)  # the same sites keep histories: no error
    saved["precision"]["fp8_exclude"] = "lm_head,attn.wo"
    with pytest.raises(ConfigError, match="keeps other fp8 state"):
        check_compatible(cfg, saved, tmp_path, 3)


def test_an_interleaved_pipeline_saves_in_its_stages_order_and_resumes_elsewhere(tmp_path):
    """The trainer at interleaved pp=2 keeps the layer stack in its stages' order; its eval loss, and its checkpoint
    resumed at dp·fsdp·tp, carry on the run of one that never pipelined (4 layers: two chunks per stage)."""
    four = ["model.n_layers=4", "train.steps=6", SCHEDULE, "eval.every=3", "eval.batches=1"]
    run_cli(*MESH_A, *four, f"run.dir={tmp_path / 'full'}")
    pipelined = ["mesh.pp=2", "mesh.dp=1", "mesh.fsdp=2", "mesh.tp=2", "pipeline.schedule=interleaved",
                 "pipeline.virtual_stages=2", "train.grad_accum=2"]
    run_cli(*pipelined, *four[:1], "train.steps=3", *four[2:], "checkpoint.every=3", f"run.dir={tmp_path / 'pp'}")
    losses, out = resume(tmp_path / "pp", tmp_path / "back", *MESH_A, *four)
    assert "resumed from step 3" in out
    full = logged_losses(tmp_path / "full")
    got = {**logged_losses(tmp_path / "pp"), **losses}
    assert sorted(got) == list(range(1, 7))
    np.testing.assert_allclose([got[s] for s in range(1, 7)], [full[s] for s in range(1, 7)], rtol=1e-5)
    np.testing.assert_allclose(logged_losses(tmp_path / "pp", "eval_loss")[3],
                               logged_losses(tmp_path / "full", "eval_loss")[3], rtol=1e-5)
