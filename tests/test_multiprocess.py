"""Two processes with 4 CPU devices each (jax.distributed on loopback, collectives through gloo)
compute what one process with 8 devices computes on the same mesh (fp32: rtol 1e-5)."""
import socket
import subprocess
import sys

import numpy as np
import pytest

from helpers import CLI_TINY, cli_env, logged_losses, run_cli

MESH = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.steps=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    one = tmp_path / "one"
    run_cli(*MESH, f"run.dir={one}")

    two = tmp_path / "two"
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "meshtrain.run", *CLI_TINY, *MESH, f"run.dir={two}", "run.cpu_devices=4",
         f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2", f"distributed.process_id={i}"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out}"
    assert "2 processes" in outs[0], outs[0]

    want, got = logged_losses(one), logged_losses(two)  # only process 0 writes metrics
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
