"""A single-node SLURM cluster on localhost for one test: munged, slurmctld and slurmd from Debian's
slurm-wlm packages (scripts/ci_slurm_setup.sh installs them), everything in a temporary directory.

Containers have no systemd and often no writable cgroup hierarchy, so the configuration asks for nothing
that needs one: processes are tracked through /proc (proctrack/linuxproc), tasks are not bound
(task/none), nothing is accounted. Both daemons run as root (SlurmUser, SlurmdUser) in the foreground,
children of the test, on free ports; clients find the cluster through SLURM_CONF and munge through its
socket (AuthInfo). `stop` cancels the jobs and ends the daemons it started, by their process ids.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

NODE = "localhost"  # the node's name, and its address: slurmd -N names itself so on any host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(d: Path, cpus: int) -> str:
    return f"""\
ClusterName=meshtrain-test
SlurmctldHost={NODE}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
# No time limit of its own: a job asking for the script's #SBATCH --time (4 h) would wait for ever.
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, directory: Path, cpus: int = 2):
        self.dir = directory
        self.env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []
        self.cpus = cpus

    def start(self, timeout_s: float = 60) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "plugstack.conf").write_text("")  # not the system's: no SPANK plugins
        (d / "slurm.conf").write_text(slurm_conf(d, self.cpus))
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        # --force: without it munged refuses a key, log or socket whose directories it finds insecure (a
        # group- or world-writable TMPDIR, say); the key here lives for one test.
        self._daemon("munged", ["munged", "-F", "--force", f"--socket={d}/munge.socket", f"--key-file={key}",
                                f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
                                f"--log-file={d}/munged.log"])
        self._wait(lambda: (d / "munge.socket").exists(), timeout_s, "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D"])
        self._daemon("slurmd", ["slurmd", "-D", "-N", NODE])
        self._wait(lambda: self.run(["sinfo", "-h", "-o", "%t"], check=False).stdout.strip() == "idle", timeout_s,
                   f"node {NODE} idle")

    def run(self, args: list[str], *, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(args, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n"
                                 f"{self.logs()}")
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        if self.daemons and len(self.daemons) == 3:
            self.run(["scancel", "--full", "--quiet", "--partition=test"], check=False)
            self._wait(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), 30, "jobs gone",
                       fail=False)
        for p in reversed(self.daemons):  # slurmd, slurmctld, munged
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        self.daemons = []

    def _daemon(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "w")
        self.daemons.append(subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def _wait(self, ready, timeout_s: float, what: str, fail: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            if any(p.poll() is not None for p in self.daemons):
                break  # a daemon died: say so now, with its log
            time.sleep(0.5)
        if fail:
            outs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.dir.glob("*.out")))
            raise AssertionError(f"SLURM test cluster: no {what} within {timeout_s:.0f} s\n{outs}\n{self.logs()}")
