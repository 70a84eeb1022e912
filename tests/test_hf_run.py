"""A run started from a Hugging Face directory on fsdp=2 x tp=4, with eval and TensorBoard on, and the
tools that read what it left: evaluate, plot, the TensorBoard reader, export.

One two-step run (module fixture, in this process) serves every test here.
"""
import json
import math
import re

import jax
import numpy as np
import pytest

from helpers import FIXTURES, make_setup
from meshtrain import evaluate as evaluate_cli
from meshtrain import run
from meshtrain.config import build_config
from meshtrain.hf.weights import load_params
from meshtrain.step.loss import loss_sum_fn
from meshtrain.step.state import abstract_params, make_batches

HF = FIXTURES / "llama_sharded"
RUN = [f"checkpoint.init_from=hf:{HF}", "train.steps=2", "train.global_batch=8", "data.seq_len=16",
       "precision.compute=float32", "train.log_every=1", "eval.every=1", "eval.batches=2", "checkpoint.every=2",
       "run.tracker=tensorboard", "run.progress=false", "train.lr=1e-2", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf_run")
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run.main([*RUN, "mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", f"run.dir={run_dir}"])
    assert rc == 0, out.getvalue()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, out.getvalue(), records


def test_two_steps_from_hf_on_fsdp2_tp4(hf_run):
    run_dir, stdout, records = hf_run
    assert f"initialized from hf:{HF}" in stdout and "fsdp=2 x tp=4" in stdout
    train = {r["step"]: r for r in records if "loss" in r}
    assert sorted(train) == [1, 2]
    # Step 1 reports the loss of the Hugging Face weights themselves: the same number on one device.
    cfg = build_config({}, [*RUN, "mesh.fsdp=1"])
    setup = make_setup(cfg, 1)
    params = load_params(HF, cfg.model, abstract_params(setup), setup.state_shardings.params)
    loss, n, _ = jax.jit(loss_sum_fn(setup.model))(params, make_batches(setup).batch(0).microbatch(0))
    np.testing.assert_allclose(train[1]["loss"], float(loss / n), rtol=1e-5)
    assert train[2]["loss"] < train[1]["loss"]
    assert (run_dir / "checkpoints" / "2").is_dir()


def test_eval_records_and_the_evaluate_command_agree(hf_run, capsys):
    run_dir, stdout, records = hf_run
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evals) == [1, 2]
    assert evals[2]["eval_loss"] < evals[1]["eval_loss"]  # the step at lr 1e-2 helps on held-out data too
    for r in evals.values():
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
        assert r["eval_tokens"] == 2 * 8 * 16
    assert re.search(r"eval +2 +loss \d\.\d{4} +ppl", stdout)
    # The saved model, evaluated by the command on another mesh, gives the step-2 eval loss.
    assert evaluate_cli.main(["--checkpoint", str(run_dir), "mesh.fsdp=8"]) == 0
    printed = float(re.search(r"eval loss (\S+)", capsys.readouterr().out).group(1))
    np.testing.assert_allclose(printed, evals[2]["eval_loss"], rtol=1e-5)


def test_tensorboard_events_hold_every_metric(hf_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir, _, records = hf_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/step_time_s",
            "eval/loss", "eval/ppl"} <= tags
    for tag, key, group in (("train/loss", "loss", "loss"), ("eval/loss", "eval_loss", "eval_loss"),
                            ("train/lr", "lr", "loss")):
        logged = [(r["step"], r[key]) for r in records if group in r]
        events = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in events] == [s for s, _ in logged]
        np.testing.assert_allclose([v for _, v in events], [v for _, v in logged], rtol=1e-6)  # stored as fp32


def test_plot_draws_each_run_from_its_metrics(hf_run, tmp_path):
    from PIL import Image

    from meshtrain import plot
    run_dir, _, records = hf_run
    other = tmp_path / "other"
    other.mkdir()
    fake = [dict(step=s, loss=5.0 - s / 10, tokens_per_s=100.0 * s, step_time_s=0.1, mem_gib=1.0, peak_mem_gib=2.0)
            for s in (10, 20, 30)]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fake))
    out = tmp_path / "curves.png"
    assert plot.main([str(run_dir), str(other), "--out", str(out), "--width", "800", "--height", "600"]) == 0
    with Image.open(out) as img:
        assert img.size == (800, 600) and img.format == "PNG"
    fig = plot.plot_runs([str(run_dir), str(other)], tmp_path / "again.png", width=800, height=600)
    loss_ax, tok_ax, mem_ax = fig.axes
    lines = {line.get_label(): line.get_xydata().tolist() for line in loss_ax.lines}
    train = [[r["step"], r["loss"]] for r in records if "loss" in r]
    evals = [[r["step"], r["eval_loss"]] for r in records if "eval_loss" in r]
    assert lines[f"{run_dir.name} train"] == train and lines[f"{run_dir.name} eval"] == evals
    assert lines["other train"] == [[10, 4.0], [20, 3.0], [30, 2.0]]
    assert {line.get_label(): line.get_xydata().tolist() for line in mem_ax.lines} == {
        "other in use": [[10, 1.0], [20, 1.0], [30, 1.0]], "other peak": [[10, 2.0], [20, 2.0], [30, 2.0]]}
    # The compiling interval is no throughput; later intervals are drawn.
    assert [p[0] for p in tok_ax.lines[0].get_xydata()] == [r["step"] for r in records
                                                             if "loss" in r and not r["includes_compile"]]
