"""Real SIGINTs and SIGTERMs sent to `python -m meshtrain.run` at spread moments of start-up, compile and the
loop: each exits 130/143 (0 after a save) with one line and no traceback; a second SIGINT stops within a second.

Before, the interrupt was raised in-process: real ones segfaulted at exit, were swallowed inside jax's gc
callback (the run went on to the end), or killed the process silently (SIGTERM). The cases run a few at a
time; MESHTRAIN_SIGNAL_REPEAT=N repeats each N times (the local soak: N=4 gives 24 SIGINTs + 8 SIGTERMs).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
         "model.vocab_size=64", "data.seq_len=16", "train.global_batch=4", "train.steps=400", "train.log_every=1",
         "run.cpu_devices=1", "mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", "precision.compute=float32",
         "run.progress=false"]
BAD = ("Traceback", "Fatal Python error", "Segmentation fault", "Aborted", "core dumped")
STOP_LINE = re.compile(r"interrupted|stopped")

# (signal, the output line to wait for (None: the moment the command holds the signals), seconds after it,
# a second SIGINT after s)
CASES = [
    (signal.SIGINT, None, 0.0, None),  # importing
    (signal.SIGINT, None, 1.0, None),  # importing jax
    (signal.SIGINT, "meshtrain: mesh", 0.0, None),  # just after the banner
    (signal.SIGINT, "meshtrain: mesh", 1.0, None),  # building the state
    (signal.SIGINT, "state ready", 0.5, 0.5),  # compiling the first step: a second Ctrl-C stops at once
    (signal.SIGINT, "step      3", 0.0, None),  # in the loop: stops after the step (0 after a save)
    (signal.SIGTERM, None, 0.5, None),
    (signal.SIGTERM, "meshtrain: mesh", 0.5, None),
]


class Proc:
    """A run whose output lines are read as they come, with the moment each came."""

    def __init__(self, run_dir: Path):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("XLA_FLAGS", None)  # the command sets its own device count
        self.p = subprocess.Popen([sys.executable, "-m", "meshtrain.run", *SMALL, f"run.dir={run_dir}"], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.started = time.monotonic()
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                        for s, lines in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self.readers:
            t.start()

    def _read(self, stream, lines) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_handled(self, timeout: float = 60) -> None:
        """Until the process holds its SIGTERM handler (/proc: the interpreter's own start-up is not ours)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.p.poll() is None:
            try:
                caught = int(re.search(r"SigCgt:\s*([0-9a-f]+)", Path(f"/proc/{self.p.pid}/status").read_text())[1], 16)
            except (OSError, TypeError):
                caught = 0
            if caught >> (signal.SIGTERM - 1) & 1:
                return
            time.sleep(0.005)
        raise AssertionError(f"no SIGTERM handler: rc {self.p.poll()}, {self.out + self.err}")

    def wait_line(self, text: str, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while not any(text in line for line in self.out + self.err):
            if self.p.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"never printed {text!r}: rc {self.p.poll()}, {self.out + self.err}")
            time.sleep(0.02)


def one_case(case, run_dir: Path) -> str | None:
    """None when the case behaved, else what went wrong."""
    sig, after, delay, second = case
    proc = Proc(run_dir)
    try:
        proc.wait_handled()
        if after:
            proc.wait_line(after)
        time.sleep(delay)
        proc.p.send_signal(sig)
        sent = time.monotonic()
        if second is not None:
            time.sleep(second)
            proc.p.send_signal(signal.SIGINT)
            sent = time.monotonic()
        try:
            rc = proc.p.wait(timeout=1.5 if second is not None else 120)
        except subprocess.TimeoutExpired:
            proc.p.kill()
            return f"{case}: still running {time.monotonic() - sent:.1f} s after the last signal"
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
        proc.p.wait()
        for t in proc.readers:
            t.join(5)
    text = "\n".join(proc.out + proc.err)
    lines = [line for line in proc.out + proc.err if STOP_LINE.search(line)]
    saved = any("checkpoint saved" in line for line in lines)
    expected = {0} if saved else {130 if second is not None else 128 + sig}
    problems = []
    if rc not in expected:
        problems.append(f"rc {rc}, expected {expected}")
    if any(b in text for b in BAD):
        problems.append("a traceback or crash")
    if len(lines) != 1:
        problems.append(f"{len(lines)} stop lines")
    if "done:" in text:
        problems.append("ran to the end")
    return f"{signal.Signals(sig).name} after {after!r}+{delay}s: {', '.join(problems)}\n{text}" if problems else None


def test_real_signals_at_every_moment_stop_cleanly(tmp_path):
    repeat = int(os.environ.get("MESHTRAIN_SIGNAL_REPEAT", "1"))
    cases = CASES * repeat
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda ic: one_case(ic[1], tmp_path / f"run{ic[0]}"), enumerate(cases)))
    failures = [r for r in results if r]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n\n" + "\n\n".join(failures)
