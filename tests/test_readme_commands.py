"""Every command of the README, in order, as a new user types them on the README's install (`slow`).

Nothing is installed here: CI runs it on its own fresh install of the README's extras. Each command runs
as written, in a scratch directory that holds the checkout's configs/, scripts/ and tests/fixtures, with
a small train.steps (and the checkpoint/eval intervals scaled down with it) where the README allows an
override; the commands for GPUs (their configs, their benchmarks, the multi-process launch) are skipped,
and so are the install and test-suite lines.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_env import CPU_COMPILE_FLAGS
from meshtrain.launch import on_cpu

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = ("_h100", "llama3_8b", "bench_moe.py", "launch_local.sh", "compare_runs.py runs/one_process", "[gpu]")
SMALL = {"train.steps": "4", "checkpoint.every": "2", "eval.every": "2"}
# Commands for a SLURM cluster: tests/test_slurm.py runs the CPU one on a cluster of its own.
CLUSTER_ONLY = ("sbatch ",)
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")  # `WANDB_MODE=offline python -m ...`


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            for part in cmd.split("  #")[0].split(" && "):  # the set-up line chains venv, pip and the run
                part = part.strip()
                if part and not part.startswith(("#", "python3 -m venv", ". .venv", "pip ", "python -m pytest")):
                    commands.append(part)
    return commands


def small(cmd: str) -> list[str]:
    """The command's arguments, with its run shortened (the README's own values replaced, others added); the
    environment assignments before it stay in front."""
    args = shlex.split(cmd)
    n_env = next((i for i, a in enumerate(args) if not ENV_ASSIGNMENT.fullmatch(a)), len(args))
    if n_env:
        return args[:n_env] + small(shlex.join(args[n_env:]))
    if args[:3] != ["python", "-m", "meshtrain.run"] or {"--help", "--print-config"} & set(args):
        return args
    given = {a.split("=")[0] for a in args if "=" in a}
    args = [f"{a.split('=')[0]}={SMALL[a.split('=')[0]]}" if a.split("=")[0] in SMALL else a for a in args]
    return args + [f"{k}={v}" for k, v in SMALL.items() if k == "train.steps" and k not in given]


def scratch(tmp: Path) -> Path:
    for name in ("configs", "scripts"):
        (tmp / name).symlink_to(ROOT / name)
    (tmp / "tests").mkdir()
    (tmp / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("Once upon a time there was a mesh of devices. " * 200)
    (tmp / "tokenizer.json").symlink_to(ROOT / "tests" / "fixtures" / "hf" / "llama31_tied" / "tokenizer.json")
    return tmp


@pytest.mark.slow
@pytest.mark.skipif(not on_cpu(), reason="the CPU walk-through; the GPU commands are the GPU's")
def test_every_readme_command_works_as_written(tmp_path):
    cwd = scratch(tmp_path)
    # Each command sets its own devices; all of them compile as the suite does (a command that sets XLA_FLAGS
    # itself replaces this).
    env = {**os.environ, "XLA_FLAGS": CPU_COMPILE_FLAGS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    ran = []
    for cmd in readme_commands():
        if any(g in cmd for g in GPU_ONLY + CLUSTER_ONLY):
            continue
        args = small(cmd)
        n_env = next(i for i, a in enumerate(args) if not ENV_ASSIGNMENT.fullmatch(a))
        args[n_env] = sys.executable if args[n_env] == "python" else args[n_env]
        shell = " ".join(shlex.quote(a) if "*" not in a else a for a in args)  # corpus/*.txt: the shell's glob
        proc = subprocess.run(shell, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        ran.append(cmd)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{cmd}\n{proc.stderr[-3000:]}"
    assert any("meshtrain.generate" in c for c in ran) and any("meshtrain.export" in c for c in ran)
