"""A device trace of a window of training steps (`run.profile_steps=START:END`).

The window is counted like the state's step counter: START:END traces the steps that take it from
START to END (the steps logged as START+1 .. END). Before the first one the host waits for the work
already queued, so the trace starts clean; after the last one it waits for that step's outputs, so
the trace holds its device work, then stops. Starting and writing the trace are kept off the logged
step time; the two waits stay on it, being the steps' own device time (the trainer passes them in, as
each also ends its step's interval: metrics.Throughput). Steps outside the window run exactly as without it: a few comparisons per step.

The trace is what `jax.profiler` writes: `<run.dir>/profile/plugins/profile/<time>/<host>.trace.json.gz`
(Chrome trace format, read by `python -m meshtrain.profile`), a `perfetto_trace.json.gz` beside it
for ui.perfetto.dev, and the `.xplane.pb` that TensorBoard's profile plugin reads. Beside them goes
`<run.dir>/profile/step.hlo.txt`, the traced step's optimized HLO (from jit's compilation cache, so it
costs no compile): it tells the table (profile/table.py) which fused kernels are the optimizer's.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import jax

from meshtrain.config import RunConfig, profile_range
# The names the trace and its reader share: the host annotation around each traced step, and the file
# holding the traced step's optimized HLO (trace.py imports nothing but the standard library).
from meshtrain.profile.trace import PROGRAM_FILE, STEP_MARKER


class StepTrace:
    def __init__(self, run: RunConfig, first_step: int, write):
        """`write(line)`: the run's console (MetricsLog.write: process 0 only, clear of the progress bar)."""
        self.window = profile_range(run.profile_steps) if run.profile_steps else None
        # One directory per process: jax names the file after the host, so processes sharing a host
        # would overwrite each other's trace.
        base = Path(run.dir) / "profile"
        self.directory = base if jax.process_count() == 1 else base / f"process_{jax.process_index()}"
        self.active = False
        self.last = first_step - 1
        self._write = write
        if self.window and first_step >= self.window[1]:
            write(f"meshtrain: run.profile_steps={run.profile_steps} lies before the resumed step {first_step}: "
                  f"no trace is taken")
            self.window = None
        elif self.window and first_step > self.window[0]:  # resumed inside the window: trace what is left
            self.window = (first_step, self.window[1])

    def begin(self, step: int, wait: Callable[[], None]) -> float:
        """Called before dispatching step `step` (0-based, as the step counter before it runs): at the
        window's first step, calls `wait` (which waits for the state the previous steps produced), then
        starts the trace. Returns the host seconds spent starting it, to be kept off the throughput clock."""
        if self.active or self.window is None or not self.window[0] <= step < self.window[1]:
            return 0.0
        wait()
        began = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active = True
        return time.perf_counter() - began

    def step(self, step: int):
        """Context around dispatching step `step`: its marker in the trace while one is being taken."""
        return self._traced(step) if self.active else contextlib.nullcontext()

    @contextlib.contextmanager
    def _traced(self, step: int):
        with jax.profiler.StepTraceAnnotation(STEP_MARKER, step_num=step):
            yield
        self.last = step  # dispatched: an early stop's trace reaches this far

    def after(self, step: int, wait: Callable[[], None], program: Callable[[], str] | None = None) -> float:
        """Called after dispatching step `step`: once the window's last step is dispatched, calls `wait`
        (which waits for that step's outputs), stops the trace and writes `program()` (the step's
        optimized HLO text) beside it as PROGRAM_FILE. Returns the host seconds spent writing both, to be
        kept off the throughput clock (the wait is not among them: it is that step's device time)."""
        if not (self.active and step + 1 >= self.window[1]):
            return 0.0
        wait()
        began = time.perf_counter()
        self.stop()
        if program is not None:
            try:  # a profile without it is still a profile: its optimizer kernels count as elementwise
                (self.directory / PROGRAM_FILE).write_text(program())
            except Exception as e:  # noqa: BLE001 - whatever lowering raises, the run goes on
                self._write(f"meshtrain: the step's program was not written beside the trace ({e}); "
                            f"the profile table will count the optimizer's kernels as elementwise")
        return time.perf_counter() - began

    def stop(self) -> None:
        """Stop and say where the trace went (also on an early exit, with what was traced so far)."""
        if not self.active:
            return
        self.active = False
        jax.profiler.stop_trace()
        lo, hi = self.window[0], self.last + 1  # an early stop ends the window where the run ended
        self._write(f"meshtrain: profiled steps {lo}:{hi} into {self.directory}; table: python -m "
                    f"meshtrain.profile {self.directory} (timeline: its perfetto_trace.json.gz in "
                    f"ui.perfetto.dev, or tensorboard --logdir {self.directory})")
