"""scripts/slurm_train.sh under a real SLURM (`slow`): sbatch on a single-node cluster on localhost
(tests/slurm_cluster.py), two tasks of 4 CPU devices each, trains to the losses of one process with 8
devices on the same mesh (fp32: rtol 1e-5, as tests/test_multiprocess.py).

The packages come from scripts/ci_slurm_setup.sh (apt-get on a fresh CI machine, about 30 s; nothing when
installed). A machine without root or apt-get skips, saying why.
"""
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import CLI_TINY, cli_env, logged_losses, run_cli
from slurm_cluster import Cluster, free_port

ROOT = Path(__file__).resolve().parents[1]
MESH = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.steps=4"]
NO_ROOT_OR_APT = 3  # ci_slurm_setup.sh's exit status when it cannot install


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    began = time.monotonic()
    setup = subprocess.run(["bash", str(ROOT / "scripts/ci_slurm_setup.sh")], capture_output=True, text=True,
                           timeout=900)
    if setup.returncode == NO_ROOT_OR_APT:
        pytest.skip(setup.stderr.strip())
    assert setup.returncode == 0, f"installing slurm failed:\n{setup.stdout}\n{setup.stderr}"
    print(f"{setup.stdout.strip()} (setup script {time.monotonic() - began:.0f} s)")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_sbatch_two_tasks_match_one_process(cluster, tmp_path):
    one = tmp_path / "one"
    run_cli(*MESH, f"run.dir={one}")

    two = tmp_path / "two"
    out = tmp_path / "job.out"
    # The script's #SBATCH lines ask for 2 GPU nodes; the command line's options win over them.
    env = cli_env(SLURM_CONF=cluster.env["SLURM_CONF"], GPUS_PER_NODE="0", CONFIG="", PYTHON=sys.executable,
                  JAX_COORDINATOR_PORT=str(free_port()))
    submit = ["sbatch", "--wait", "--parsable", "--job-name=meshtrain-test", "--nodes=1", "--ntasks-per-node=2",
              "--cpus-per-task=1", "--gpus-per-node=0", "--time=10", f"--output={out}", f"--chdir={ROOT}",
              str(ROOT / "scripts/slurm_train.sh"), *CLI_TINY, *MESH, "run.cpu_devices=4", f"run.dir={two}"]
    try:
        job = cluster.run(submit, env=env, check=False, timeout=420)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job ran past 420 s:\n{out.read_text() if out.exists() else ''}\n{cluster.logs()}")
    log = out.read_text() if out.exists() else ""
    assert job.returncode == 0, f"sbatch: {job.returncode}\n{job.stdout}\n{job.stderr}\n{log}\n{cluster.logs()}"
    assert "meshtrain: 2 tasks on 1 node(s), CPU devices, coordinator localhost:" in log, log
    assert "2 processes" in log, log  # jax.distributed joined the two tasks

    want, got = logged_losses(one), logged_losses(two)  # only process 0 writes metrics
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
    acct = cluster.run(["scontrol", "show", "job", job.stdout.strip().split(";")[0]], check=False).stdout
    assert not acct or "JobState=COMPLETED" in acct, acct


def test_the_script_refuses_to_run_outside_slurm():
    env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_train.sh")], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "submit this with sbatch" in proc.stderr
