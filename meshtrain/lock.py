"""One run per directory: an advisory lock on run.dir and checkpoint.dir while a run trains in them.

Two runs in one directory destroy each other's checkpoints (the second one's start-up removes the first
one's in-flight temporary step; rotation deletes a step the other is restoring). `RunLock` takes an
exclusive `flock` on `<dir>/.meshtrain.lock` and writes the holder (host and process id) into it. The
kernel drops a flock when its process dies, however it dies, so a lock file left behind by a killed run
is stale by construction and the next run simply takes it. Only process 0 of a multi-process run locks
(the others share its directories). A file system without flock (some network mounts) is not locked.
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from meshtrain.config import ConfigError

LOCK_NAME = ".meshtrain.lock"


class RunLock:
    def __init__(self, dirs: list[tuple[str, str]]):
        """`dirs`: (config field, directory); the same directory named twice is locked once."""
        seen, self.dirs = set(), []
        for field, d in dirs:
            p = Path(d).absolute()
            if p not in seen:
                seen.add(p)
                self.dirs.append((field, p))
        self.fds: list[int] = []

    def __enter__(self) -> "RunLock":
        import jax
        if jax.process_index() != 0:
            return self
        try:
            for field, d in self.dirs:
                self.fds.append(self._take(field, d))
        except BaseException:
            self.release()
            raise
        return self

    @staticmethod
    def _take(field: str, d: Path) -> int:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"{field}={str(d)!r} is in use by another meshtrain run ({holder}); wait for it to "
                              f"finish, stop it, or give this run another {field}") from None
        except OSError:  # no flock on this file system: run unlocked rather than not at all
            return fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)  # closing drops the flock; the file stays (a stale one is harmless)
        self.fds = []

    def __exit__(self, *exc) -> None:
        self.release()
