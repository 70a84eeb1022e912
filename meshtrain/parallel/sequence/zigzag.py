"""Sequence layouts for context parallelism: which token positions each cp rank holds.

The sequence axis of every batch array is sharded over cp in contiguous blocks, so the layout is
chosen by permuting the sequence on the host before it is sharded. Cut the sequence into 2n chunks
(n = cp). Under a causal mask chunk c attends to chunks 0..c, so a rank's work is the sum of (c + 1)
over its chunks. Contiguous blocks give rank i chunks 2i and 2i+1: work 4i + 3, from 3 to 4n - 1.
Zig-zag gives rank i chunks i and 2n-1-i, one cheap and one dear: work 2n + 1 on every rank.

    cp = 2, chunks 0..3        contiguous: rank0 [0 1]  rank1 [2 3]
                               zig-zag:    rank0 [0 3]  rank1 [1 2]

The permutation is applied alike to tokens, targets, positions and segment ids, so attention
(which masks by position and segment, not by index) and the loss (a sum over tokens) never see it.
Pure numpy: the data loader uses it on the host.
"""
from __future__ import annotations

import numpy as np

LAYOUTS = ("zigzag", "contiguous")


def sequence_order(seq_len: int, cp: int, layout: str = "zigzag") -> np.ndarray:
    """order[j] = the original position stored at index j of the laid-out sequence."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: must be one of {', '.join(LAYOUTS)}")
    if cp == 1 or layout == "contiguous":
        return np.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2*cp={2 * cp} for the zig-zag layout")
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    ranks = [np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)]
    return np.concatenate(ranks)
