"""Batches built ahead on a background thread, so the loop only dispatches.

    loop thread:    dispatch s ─ read metrics s-1 ─ dispatch s+1 ─ read metrics s ─ ...
    feed thread:    build+put s+1, s+2 (then waits for room) ─ build+put s+3 ─ ...

Without it the host builds step s+1's batch (numpy rows, then the host->device copy) between reading
step s-1's metrics and dispatching s+1, which is hidden only while that takes less than one device
step. The batch of a step is a pure function of the step (data.py), so building it elsewhere and
earlier changes nothing in what is trained: `get(s)` checks that it hands out step s.

An error while building (a bad token id is a ConfigError) is raised by `get` of that step, in the
loop's thread, as if the batch had been built there. `close()` ends the thread without waiting for
the steps not yet consumed; it is safe to call at any point, also after an error.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterable, TypeVar

T = TypeVar("T")
POLL_S = 0.1  # how often a blocked put/get looks whether the other side has gone


class Prefetcher(Generic[T]):
    def __init__(self, make: Callable[[int], T], steps: Iterable[int], depth: int):
        """`make(step)` for every step of `steps` in order, at most `depth` finished ones waiting."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._make, self._steps = make, steps
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="meshtrain-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        for step in self._steps:
            if self._closed.is_set():
                return
            try:
                item = (step, self._make(step), None)
            except BaseException as e:  # handed to the loop's thread, which raises it
                item = (step, None, e)
            while not self._closed.is_set():
                try:
                    self._ready.put(item, timeout=POLL_S)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def get(self, step: int) -> T:
        while True:
            try:
                got, value, error = self._ready.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError(f"the batch prefetch thread ended before step {step}") from None
        if error is not None:
            raise error
        if got != step:  # the loop asked out of order: a bug, never a silent mismatch of data and step
            raise RuntimeError(f"batch prefetch handed out step {got} when step {step} was asked for")
        return value

    def close(self) -> None:
        self._closed.set()
        while True:  # make room, so a put in flight sees the flag instead of blocking
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        # A make() in progress finishes first (one batch: milliseconds); the thread is a daemon, so a
        # build stuck on I/O cannot keep the process alive either.
        self._thread.join(timeout=60)


class Synchronous(Generic[T]):
    """The same interface without a thread (data.prefetch=0): the batch is built when asked for."""

    def __init__(self, make: Callable[[int], T]):
        self._make = make

    def get(self, step: int) -> T:
        return self._make(step)

    def close(self) -> None:
        pass


def batch_feed(make: Callable[[int], T], steps: Iterable[int], depth: int) -> Prefetcher[T] | Synchronous[T]:
    return Prefetcher(make, steps, depth) if depth > 0 else Synchronous(make)
