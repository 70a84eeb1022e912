"""How the bench scripts in this folder time things: warm up, then the median of individually
synchronized calls (docs/PERFORMANCE.md). A step is synchronized on its metrics, the last thing it
produces, so each timed interval holds exactly one step. Imported by the scripts beside it (run as
`python scripts/NAME.py`, whose folder is then first on sys.path); meshtrain never imports it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax


def median_seconds(fn: Callable, *args, calls: int, warmup: int = 2) -> float:
    """Median seconds of `calls` synchronized calls of fn(*args), after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclass
class StepTimes:
    first_s: float  # the first call: the compile, unless the step came compiled
    times: list[float]  # seconds of each timed step
    back_to_back_s: float  # seconds a step, `steps` steps dispatched back to back and synchronized once
    dispatch_s: float  # median seconds the host spent in the step's call itself (not waiting for its outputs)
    state: Any  # the train state after the last step
    metrics: dict  # the last step's metrics

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def time_train_steps(step: Callable, state: Any, batches: list, steps: int, warmup: int = 3) -> StepTimes:
    """Run `step(state, batch)`: one first call, `warmup` untimed calls, then `steps` timed ones, cycling
    through `batches` (built beforehand, so the data is off the clock). Then `steps` more dispatched back to
    back, as a training loop and the peers' logged step times run them (the host prepares step i+1 while the
    device runs step i): their mean is `back_to_back_s`, which holds no per-step dispatch wait."""
    t = time.perf_counter()
    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    first_s = time.perf_counter() - t
    for i in range(warmup):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    times, calls = [], []
    for i in range(steps):
        t = time.perf_counter()
        state, metrics = step(state, batches[i % len(batches)])
        calls.append(time.perf_counter() - t)  # near zero unless the runtime waits for the device in the call
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    back_to_back_s = (time.perf_counter() - t) / steps
    return StepTimes(first_s, times, back_to_back_s, statistics.median(calls), state, metrics)
