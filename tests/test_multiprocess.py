"""Two processes with 4 CPU devices each, started by scripts/launch_local.sh (jax.distributed on the
loopback, collectives through gloo), compute what one process with 8 devices computes on the same mesh
(fp32: rtol 1e-5); scripts/compare_runs.py, which the GPU measurement uses, agrees. Their checkpoints
fall back together: a damaged newest step is passed over by both processes for the one before."""
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import CLI_TINY, cli_env, logged_losses, run_cli

ROOT = Path(__file__).resolve().parents[1]
MESH = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.steps=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, *args: str, log_dir: Path) -> subprocess.CompletedProcess:
    env = cli_env(PORT=str(free_port()), PYTHON=sys.executable, LOG_DIR=str(log_dir))
    return subprocess.run(["bash", str(ROOT / "scripts/launch_local.sh"), str(n), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    one = tmp_path / "one"
    run_cli(*MESH, f"run.dir={one}")

    two = tmp_path / "two"
    proc = launch(2, *CLI_TINY, *MESH, f"run.dir={two}", "run.cpu_devices=4", "checkpoint.every=2",
                  log_dir=tmp_path / "logs")
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout}\n{proc.stderr}\n" + \
        (tmp_path / "logs/process_1.log").read_text()
    assert "2 processes" in proc.stdout, proc.stdout
    log_1 = (tmp_path / "logs/process_1.log").read_text()
    assert "[Gloo]" not in proc.stdout + log_1 and "peer ranks" not in proc.stdout + log_1, proc.stdout

    want, got = logged_losses(one), logged_losses(two)  # only process 0 writes metrics
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)

    cmp = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(one), str(two), "--after", "0",
                          "--rtol", "1e-5"], capture_output=True, text=True)
    assert cmp.returncode == 0 and "losses equal within rtol" in cmp.stdout, cmp.stdout + cmp.stderr

    # Damage what process 1 wrote of the newest step: both processes must pass it over for step 2 together,
    # or the one whose reads succeeded would wait in the digests' collective for the other for ever.
    ckpt = two / "checkpoints"
    for f in (p for p in (ckpt / "4" / "state" / "ocdbt.process_1").rglob("*") if p.is_file() and "/d/" in str(p)):
        f.write_bytes(f.read_bytes()[:64])
    proc = launch(2, *CLI_TINY, *MESH, f"run.dir={two}", "run.cpu_devices=4", "checkpoint.every=2",
                  log_dir=tmp_path / "logs")
    log_1 = (tmp_path / "logs/process_1.log").read_text()
    assert proc.returncode == 0, f"resume failed:\n{proc.stdout}\n{proc.stderr}\n{log_1}"
    assert f"checkpoint step 4 in {ckpt} cannot be used" in proc.stdout and "resumed from step 2" in proc.stdout
    assert "Traceback" not in proc.stderr + log_1
    assert (ckpt / "4.damaged").is_dir() and sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2", "4"]
    got = logged_losses(two)
    np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-5)


def test_compare_runs_fails_on_a_different_loss(tmp_path):
    for name, loss in (("a", 2.0), ("b", 2.1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            f'{{"step": 30, "loss": {loss}, "step_time_s": 0.5, "mfu": 0.4}}\n')
    cmp = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(tmp_path / "a"),
                          str(tmp_path / "b")], capture_output=True, text=True)
    assert cmp.returncode == 1 and "NOT equal" in cmp.stdout, cmp.stdout + cmp.stderr
    assert "1.0000x the reference's step time" in cmp.stdout and "5.00e-02 relative" in cmp.stdout


def test_launcher_exits_non_zero_when_a_process_fails(tmp_path):
    # A bad override fails every process at once; the launcher must return non-zero, not hang.
    proc = launch(2, *CLI_TINY, "train.steps=zero", log_dir=tmp_path / "logs")
    assert proc.returncode != 0
    assert "train.steps" in proc.stderr
