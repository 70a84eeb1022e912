"""run.tracker=tensorboard,wandb: a run and its resumption log every record to both trackers, and W&B
holds the run's config and start-up banner. W&B runs offline (WANDB_MODE=offline, everything under
tmp); what it logged is read back from its own transaction log (tests/wandb_records.py)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import CLI_TINY, cli_env
from meshtrain.config import ConfigError, build_config, validate
from wandb_records import read_run

TRACKED = ["run.tracker=tensorboard,wandb", "run.wandb_project=meshtrain-tests", "eval.every=3", "eval.batches=1",
           "run.cpu_devices=1", "mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1"]


def run(run_dir, wandb_home, *overrides):
    env = cli_env(WANDB_MODE="offline", WANDB_DIR=str(wandb_home), WANDB_CONFIG_DIR=str(wandb_home / "config"),
                  WANDB_CACHE_DIR=str(wandb_home / "cache"), WANDB_SILENT="true")
    args = [*CLI_TINY, *TRACKED, f"run.dir={run_dir}", *overrides]
    proc = subprocess.run([sys.executable, "-m", "meshtrain.run", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Three steps, then the same command resumed to five."""
    tmp = tmp_path_factory.mktemp("tracked")
    run_dir, wandb_home = tmp / "first-run", tmp / "wandb_home"
    first = run(run_dir, wandb_home, "train.steps=3")
    run(run_dir, wandb_home, "train.steps=5")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    offline = sorted((wandb_home / "wandb").glob("offline-run-*"))
    return run_dir, first.stdout, records, offline


@pytest.mark.slow
def test_wandb_holds_every_record_of_both_runs_in_one_run(tracked):
    run_dir, _, records, offline = tracked
    assert len(offline) == 2, offline  # one directory per process start, W&B's layout
    runs = [read_run(next(d.glob("run-*.wandb"))) for d in offline]
    # The resumed start continues the same W&B run (its id kept in run.dir).
    assert runs[0].run_id == runs[1].run_id == (run_dir / "wandb_run_id").read_text()
    assert runs[0].project == "meshtrain-tests" and runs[0].name == "first-run"  # run.dir's last part

    train = {r["step"]: r for r in records if "loss" in r}
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(train) == [1, 2, 3, 4, 5] and sorted(evals) == [3, 5]
    rows = [row for r in runs for row in r.history]
    logged = {}
    for row in rows:
        logged.setdefault(row["_step"], {}).update(row)
    assert sorted(logged) == [1, 2, 3, 4, 5]
    for step, rec in train.items():  # JSON both ways: the same floats, bit for bit
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
            assert logged[step][f"train/{key}"] == rec[key], (step, key)
    for step, rec in evals.items():
        assert logged[step]["eval/loss"] == rec["eval_loss"] and logged[step]["eval/ppl"] == rec["eval_ppl"]


@pytest.mark.slow
def test_wandb_records_the_config_and_the_banner(tracked):
    _, stdout, _, offline = tracked
    first = read_run(next(offline[0].glob("run-*.wandb")))
    assert first.config["run"]["tracker"] == "tensorboard,wandb"
    assert first.config["model"]["d_model"] == 64 and first.config["train"]["steps"] == 3
    assert first.config["data"]["seq_len"] == 16 and first.config["mesh"]["fsdp"] == 1
    banner = first.summary["banner"]
    printed = [line for line in stdout.splitlines() if line.startswith("meshtrain: mesh")]
    assert len(printed) == 1 and printed[0] in banner.splitlines()
    assert "parameters" in banner and "fresh start" in banner
    assert (offline[0] / "files" / "banner.txt").read_text() == banner + "\n"


@pytest.mark.slow
def test_tensorboard_holds_every_record_and_the_config(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, records, _ = tracked
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    for tag, key in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("eval/loss", "eval_loss")):
        logged = [(r["step"], r[key]) for r in records if key in r]
        events = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in events] == [s for s, _ in logged]
        np.testing.assert_allclose([v for _, v in events], [v for _, v in logged], rtol=1e-6)  # stored as fp32
    texts = {t: acc.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in acc.Tags()["tensors"]}
    assert "tracker: tensorboard,wandb" in texts["config/text_summary"]
    assert "meshtrain: mesh" in texts["banner/text_summary"]


def test_tracker_names_are_checked():
    with pytest.raises(ConfigError, match=r"run.tracker='tensorboard,mlflow': unknown tracker 'mlflow'; a comma list "
                                          r"of tensorboard, wandb, or empty for none"):
        validate(build_config({}, ["run.tracker=tensorboard,mlflow"]), 8)


def test_the_old_tensorboard_switch_reads_as_a_tracker(capsys):
    assert build_config({}, ["run.tensorboard=true"]).run.tracker == "tensorboard"
    assert "run.tensorboard=true is now run.tracker=tensorboard" in capsys.readouterr().err
    assert build_config({"run": {"tensorboard": True, "tracker": "wandb"}}, []).run.tracker == "wandb,tensorboard"
    assert build_config({"run": {"tensorboard": False}}, []).run.tracker == ""  # a saved config of an older run


def test_an_online_wandb_run_without_a_login_is_one_config_error(tmp_path, monkeypatch):
    from meshtrain.tracking import open_trackers

    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    # No login anywhere W&B looks (~/.netrc, its settings): the key check fails before any network access.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = build_config({}, [f"run.dir={tmp_path / 'run'}", "run.tracker=tensorboard,wandb"])
    with pytest.raises(ConfigError) as e:
        open_trackers(cfg, "banner", resumed=False)
    (line,) = e.value.problems
    assert line.startswith("run.tracker=wandb: W&B could not start a run (") and "WANDB_MODE=offline" in line
