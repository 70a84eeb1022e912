"""Ctrl-C and SIGTERM for a command process, installed before jax starts.

Python runs a signal handler only when the main thread next executes bytecode: never while it waits
inside XLA (a compile, a device wait), and a KeyboardInterrupt raised inside one of jax's callbacks (its
gc hook) is swallowed, while unwinding through live XLA threads can crash the interpreter at exit. So
a command process does not raise at all: the C-level handler writes the signal number to a pipe
(signal.set_wakeup_fd), and a watcher thread acts on it at once, whatever the main thread is doing:

    outside the loop   nothing to save: one line, then os._exit(128 + signal)
    in the loop        the first signal asks the loop to stop after the current step (and save);
                       a second one: one line, then os._exit(130) at once

Library use (tests, notebooks) installs nothing: trainer.train then takes the signals for the loop's
duration in the main thread (the stop flag and, on a second signal, KeyboardInterrupt).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Stop:
    """What the loop reads: whether a signal asked it to stop, and which."""

    def __init__(self) -> None:
        self.raised = False
        self.signum = 0


class _Watcher:
    def __init__(self, outside_loop: str) -> None:
        self.outside_loop = outside_loop  # the line printed when a signal stops the process outside the loop
        self.stop: Stop | None = None  # set while the loop runs
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._r = r
        for sig in HANDLED:
            signal.signal(sig, lambda signum, frame: None)  # the watcher acts; the main thread never raises
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="meshtrain-signals", daemon=True).start()

    def _watch(self) -> None:
        while True:
            data = os.read(self._r, 64)
            for signum in data:
                if signum in HANDLED:
                    self._on(signum)

    def _on(self, signum: int) -> None:
        stop = self.stop
        if stop is not None and not stop.raised:  # the loop stops after this step and says so itself
            stop.raised, stop.signum = True, signum
            return
        name = signal.Signals(signum).name
        if stop is not None:
            leave(f"stopped at once by a second signal ({name}); steps since the last checkpoint are lost", 130)
        leave(f"{self.outside_loop} ({name})", 128 + signum)


_watcher: _Watcher | None = None


def leave(line: str, code: int) -> None:
    """One line on stderr, then exit now: no unwinding through jax's threads, no interpreter teardown."""
    _flush(sys.stdout)
    os.write(2, f"\n{line}\n".encode())
    os._exit(code)


def _flush(stream) -> None:
    # Another thread may hold the stream's lock (it is then mid-write): wait a little, never forever.
    t = threading.Thread(target=lambda: _try(stream.flush), daemon=True)
    t.start()
    t.join(0.2)


def _try(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001  (a closed or broken stream: nothing more to show)
        pass


def install(outside_loop: str = "interrupted: stopped without saving") -> None:
    """Take SIGINT and SIGTERM for this process (call from a command's entry, before jax is imported)."""
    global _watcher
    if _watcher is None and threading.current_thread() is threading.main_thread():
        _watcher = _Watcher(outside_loop)


def installed() -> bool:
    return _watcher is not None


class loop:
    """`with signals.loop() as stop:` — while the loop runs, a first signal sets stop.raised; outside it
    (and with a second signal) the process stops as the module docstring says."""

    def __enter__(self) -> Stop:
        self.stop = Stop()
        self._old = {}
        if _watcher is not None:
            _watcher.stop = self.stop
            return self.stop
        for sig in HANDLED:  # library use: the main thread's own handler for the loop's duration
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self.stop

    def _handle(self, signum, frame) -> None:
        if self.stop.raised:  # a second signal: stop now
            raise KeyboardInterrupt
        self.stop.raised, self.stop.signum = True, signum

    def __exit__(self, *exc) -> None:
        if _watcher is not None:
            _watcher.stop = None
            _watcher.outside_loop = "interrupted after the loop ended"
        for sig, old in self._old.items():
            signal.signal(sig, old)
