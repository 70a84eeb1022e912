"""The token count of every document of a source, kept in a file under data.cache_dir so that a resumed run
finds where its rows start without tokenizing the documents before them again.

One int32 per document, -1 while unknown; a .npy memory-mapped for update. Entries are only ever set to the one
value the tokenizer gives, so processes sharing the file cannot write conflicting values: the worst a lost
write (or an unwritable directory, which falls back to memory) costs is counting that document again.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

UNKNOWN = -1


def open_counts(path: Path | None, n: int) -> np.ndarray:
    """[n] int32 counts backed by `path` (created full of UNKNOWN), or in memory when it cannot be used."""
    if path is not None:
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
                fresh = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(n,))
                fresh[:] = UNKNOWN
                fresh.flush()
                del fresh
                os.replace(tmp, path)  # whole or absent: another process may be creating it too
            counts = np.lib.format.open_memmap(path, mode="r+")
            if counts.shape == (n,) and counts.dtype == np.int32:
                return counts
        except (OSError, ValueError):
            pass
    return np.full(n, UNKNOWN, np.int32)
