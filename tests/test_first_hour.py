"""What a new user runs into in the first hour; each test fails on the behaviour it replaced.

- `--help` listed the dataclass defaults while a CPU run applied others (dp=2 fsdp=2 tp=2, 60 steps)
- the progress bar's first frame shared a line with the first printed line
- Ctrl-C without checkpointing printed `done:` and exited 0; Ctrl-C at start-up printed a traceback
- a token id >= vocab_size was reported after the banner and the device set-up
- resuming with a larger train.steps stretched the learning-rate schedule (the rate jumped)
- steps that saved a checkpoint reported the save as step time
"""
import io
import re
import signal
import sys
import time

import jax
import numpy as np
import pytest

from helpers import TINY, single_device, tiny_config
from meshtrain import launch, run, trainer
from meshtrain.checkpoint import Checkpointer
from meshtrain.config import validate, with_mesh
from meshtrain.mesh import build_mesh
from meshtrain.metrics import MetricsLog

SAVE_SLEEP = 1.0


class Terminal(io.StringIO):
    """stdout and stderr of a terminal, interleaved as the user sees them."""

    def isatty(self) -> bool:
        return True


def one_device(cfg):
    degrees = validate(cfg, 1)
    return with_mesh(cfg, degrees), build_mesh(degrees, jax.devices()[:1])


def help_lines(monkeypatch, capsys, on_cpu: bool) -> dict[str, str]:
    monkeypatch.setattr(launch, "cpu_only", lambda _: on_cpu)
    with pytest.raises(SystemExit) as e:
        run.main(["--help"])
    assert e.value.code == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")
            and "." in line.split()[0]}


def test_help_shows_the_defaults_that_apply_here(monkeypatch, capsys):
    lines = help_lines(monkeypatch, capsys, on_cpu=True)
    assert re.search(r"default 2 \(this CPU-only machine's run without --config; 1 otherwise\)", lines["mesh.dp"])
    assert "default 60 " in lines["train.steps"] and "default 2 " in lines["mesh.tp"]
    assert re.search(r"default 128 -- ", lines["model.d_model"])  # unchanged: no note
    lines = help_lines(monkeypatch, capsys, on_cpu=False)
    assert re.search(r"default 1 -- ", lines["mesh.dp"]) and re.search(r"default 100 -- ", lines["train.steps"])


def test_help_describes_every_key_on_one_line_from_the_schema(monkeypatch, capsys):
    """Before: ~100 keys with no descriptions. Each line now carries its field's comment in schema.py."""
    from meshtrain.config.loading import all_keys

    lines = help_lines(monkeypatch, capsys, on_cpu=False)
    assert set(all_keys()) <= set(lines)
    undescribed = [k for k in all_keys() if not re.search(r" -- \S", lines[k])]
    assert not undescribed
    assert lines["checkpoint.keep"].endswith("-- keep the last N committed checkpoints")  # a trailing comment
    assert "-- Which flash-attention kernels the Pallas path runs" in lines["model.attention_kernel"]  # a block above
    assert "(docs/PERFORMANCE.md)." in lines["model.attention_kernel"]  # the whole block, on one line


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Three steps on one device, a checkpoint after each (each save made slow), on a 'terminal'."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg, mesh = one_device(single_device(tiny_config("train.steps=3", "train.log_every=1", "checkpoint.every=1",
                                                     "run.progress=true", f"run.dir={run_dir}")))
    original = Checkpointer.save

    def slow_save(self, *args, **kwargs):
        time.sleep(SAVE_SLEEP)
        return original(self, *args, **kwargs)

    term = Terminal()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Checkpointer, "save", slow_save)
        mp.setattr(sys, "stdout", term)
        mp.setattr(sys, "stderr", term)
        result = trainer.train(cfg, mesh)
    return cfg, run_dir, result, term.getvalue()


def test_progress_bar_never_shares_a_line(saved_run):
    _, _, result, screen = saved_run
    assert "step/s" in screen or "it/s" in screen or "|" in screen  # the bar was drawn
    starts = [m.start() for m in re.finditer(r"meshtrain: |step +\d+ +loss", screen)]
    assert len(starts) == 2 + len(result.records)  # the banner, the first step's compile, the records
    assert re.search(r"fresh start \(state ready in \d+\.\d s\)", screen)
    assert re.search(r"meshtrain: step 1 done \d+\.\d s into the loop \(compiling the step included\)", screen)
    for i in starts:  # every line of ours begins a line: after a newline or the bar's carriage return
        assert i == 0 or screen[i - 1] in "\r\n", repr(screen[max(0, i - 60): i + 20])


def test_checkpoint_saves_are_not_step_time(saved_run):
    _, _, result, _ = saved_run
    first, *later = result.records
    assert first["includes_compile"] and len(later) == 2
    for rec in later:  # each interval held the slow save of the step before, none of it counted
        assert not rec["includes_compile"]
        assert rec["paused_s"] >= SAVE_SLEEP
        assert rec["step_time_s"] < SAVE_SLEEP - 0.1
        assert rec["tokens_per_s"] > 16 * 16 / (SAVE_SLEEP - 0.1)


def test_resume_keeps_the_saved_learning_rate_schedule(saved_run, capsys):
    """Saved with a 3-step schedule; resumed to 5 steps: the rate stays at the schedule's end value."""
    cfg, run_dir, _, _ = saved_run
    longer, mesh = one_device(single_device(tiny_config("train.steps=5", "train.log_every=1", f"run.dir={run_dir}")))
    result = trainer.train(longer, mesh)
    out = capsys.readouterr().out
    assert "keeping that schedule (from step 3 on it stays at its final value)" in out
    assert result.resumed_from == 3
    end = cfg.train.lr * cfg.train.min_lr_ratio
    assert [r["lr"] for r in result.records] == pytest.approx([end, end], rel=1e-6)


def test_ctrl_c_without_a_checkpoint_says_so_and_exits_130(monkeypatch, capsys, tmp_path):
    original, pressed = MetricsLog.log, []

    def log_then_interrupt(self, record):
        original(self, record)
        if not pressed:  # once: a second Ctrl-C means "stop now"
            pressed.append(record["step"])
            signal.raise_signal(signal.SIGINT)  # as if the user pressed Ctrl-C now

    monkeypatch.setattr(MetricsLog, "log", log_then_interrupt)
    rc = run.main([*TINY, "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "train.steps=50", "train.log_every=1",
                   "checkpoint.final=false", f"run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 130
    assert re.search(r"stopped by signal after step \d+ \(SIGINT\) WITHOUT a checkpoint", out)
    assert "done:" not in out
    assert int(re.search(r"after step (\d+)", out).group(1)) <= pressed[0] + 2  # stopped soon, not at 50


@pytest.mark.parametrize("final", [True, False])
def test_the_default_run_saves_a_final_checkpoint_and_says_where(capsys, tmp_path, final):
    """checkpoint.every=0 saved nothing and the end line did not say so: evaluate, generate and export on
    that run then failed with "holds no committed checkpoint"."""
    rc = run.main([*TINY, "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "train.steps=2", f"checkpoint.final={final}",
                   f"run.dir={tmp_path}"])
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert rc == 0 and len(done) == 1
    if final:
        assert Checkpointer.exists(str(tmp_path / "checkpoints"))
        assert f"checkpoint of step 2 in {tmp_path / 'checkpoints'}" in done[0]
    else:
        assert not Checkpointer.exists(str(tmp_path / "checkpoints"))
        assert "NO checkpoint saved" in done[0] and "checkpoint.final=true" in done[0]


def test_ctrl_c_at_start_up_is_no_traceback(monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "build_setup", interrupted)
    assert run.main([*TINY, f"run.dir={tmp_path}"]) == 130
    err = capsys.readouterr().err
    assert "interrupted before training started" in err and "Traceback" not in err


def test_bad_token_ids_are_reported_before_the_banner(capsys, tmp_path):
    tokens = np.arange(5000) % 100
    tokens[4321] = 300  # one bad id, deep in the file
    np.save(tmp_path / "tokens.npy", tokens.astype(np.uint16))
    rc = run.main([*TINY, "data.source=file", f"data.path={tmp_path / 'tokens.npy'}", f"run.dir={tmp_path}"])
    captured = capsys.readouterr()
    assert rc == 2
    assert f"data.path='{tmp_path / 'tokens.npy'}': token id 300 >= model.vocab_size=128" in captured.err
    assert "meshtrain: mesh" not in captured.out  # no banner, no device set-up first


@pytest.fixture
def without(monkeypatch):
    """Make the named packages look uninstalled to importlib.util.find_spec."""
    import importlib.util
    real, gone = importlib.util.find_spec, set()

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] in gone else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return gone.update


def test_pallas_attention_without_triton_is_one_config_error_before_the_banner(without, capsys, tmp_path):
    """Before: 69 lines of traceback from inside the first step, after the start-up."""
    without({"triton", "jax_triton"})
    rc = run.main([*TINY, "model.attention=pallas", "mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", f"run.dir={tmp_path}"])
    captured = capsys.readouterr()
    assert rc == 2 and "meshtrain: mesh" not in captured.out and "Traceback" not in captured.err
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("config error: model.attention=pallas (") and line.endswith(
        'needs the triton package: pip install -e ".[triton]"')


def test_missing_optional_packages_name_the_readme_install_line(without, tmp_path):
    import tomllib

    from meshtrain import generate
    from meshtrain.config import ConfigError, build_config
    from meshtrain.config.run_checks import run_problems

    without({"tokenizers", "tensorboardX", "wandb"})
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=re.escape('needs the tokenizers package: pip install -e ".[data]"')):
        generate.pick_tokenizer(None, tmp_path, 256)  # the README's generate on an HF fine-tune
    assert run_problems(build_config({}, ["run.tracker=tensorboard,wandb"])) == [
        'run.tracker=tensorboard needs the tensorboardX package: pip install -e ".[tensorboard]"',
        'run.tracker=wandb needs the wandb package: pip install -e ".[wandb]"']
    extras = tomllib.loads(open("pyproject.toml").read())["project"]["optional-dependencies"]
    assert any(d.startswith("tensorboard>") for d in extras["tensorboard"])  # the viewer the messages name
    assert any(d.startswith("wandb>") for d in extras["wandb"]) and any(d.startswith("wandb>") for d in extras["test"])


def test_banner_names_the_data_source_and_the_matmul_recipe(capsys):
    from meshtrain.resolve import resolve_for_mesh

    def banner(*overrides):
        cfg, mesh = one_device(single_device(tiny_config(*overrides)))
        launch.banner(cfg, mesh, resolve_for_mesh(cfg, mesh))
        return capsys.readouterr().out

    out = banner()
    assert "matmul plain" in out and "data synthetic corpus (data.source=synthetic), lr 0.01" in out
    out = banner("precision.matmul=fp8_delayed", "precision.fp8_exclude=lm_head")
    assert "matmul fp8_delayed (plain: lm_head)" in out


def test_exported_files_are_readable_like_any_new_file(saved_run, tmp_path):
    """The safetensors writer left model.safetensors at 0600."""
    import os

    from meshtrain.export import export

    _, run_dir, _, _ = saved_run
    _, files = export(str(run_dir), tmp_path / "hf", step=3)  # the module's own save (a later test resumes it)
    umask = os.umask(0)
    os.umask(umask)
    assert "model.safetensors" in files
    assert {f: oct((tmp_path / "hf" / f).stat().st_mode & 0o777) for f in files} == {
        f: oct(0o666 & ~umask) for f in files}


@pytest.mark.parametrize("command", ["export", "plot"])
def test_help_says_the_whole_description(command, capsys):
    """export --help and plot --help stopped mid-sentence (the first line of a paragraph)."""
    import importlib

    module = importlib.import_module(f"meshtrain.{command}")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    paragraph = " ".join(module.__doc__.split("\n\n")[1].split())
    assert paragraph.endswith(".") and paragraph in out


def test_plot_of_cpu_runs_has_no_empty_memory_panel(saved_run, tmp_path):
    pytest.importorskip("matplotlib")
    from meshtrain import plot

    _, run_dir, _, _ = saved_run
    fig = plot.plot_runs([str(run_dir)], tmp_path / "curves.png", width=400, height=300)
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "tokens/s"]


def test_python_dash_m_meshtrain_lists_the_commands():
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "meshtrain"], capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "python -m meshtrain.<command>" in proc.stdout
    assert "meshtrain run " in proc.stdout and "meshtrain generate " in proc.stdout
