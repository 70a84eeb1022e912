"""Deterministic, resumable batches: the batch of step s is a pure function of (seed, s).

Resuming therefore needs no iterator state and no replay. Each process builds only the rows its own
devices hold and the global array is assembled with `jax.make_array_from_process_local_data`.

Sources:
  synthetic  a learnable corpus: a fixed sparse Markov chain (every token has 4 possible successors),
             so the loss falls from ln(V) towards ln(4) as the model learns the table
  file       a flat token file (.npy, or raw .bin of uint16/uint32, memory-mapped); sequence windows
             of seq_len+1 tokens are visited in a seeded random order, reshuffled every epoch
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from meshtrain.config import ConfigError, DataConfig

SUCCESSORS = 4  # branching factor of the synthetic Markov chain: the loss floor is ln(4) ≈ 1.386


class SyntheticSource:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.next_vc = table_rng.integers(0, vocab_size, size=(vocab_size, SUCCESSORS), dtype=np.int64)

    def rows(self, step: int, row_ids: np.ndarray) -> np.ndarray:
        """Token rows [len(row_ids), seq_len + 1] of global batch `step`."""
        n, t = len(row_ids), self.seq_len + 1
        out = np.empty((n, t), np.int32)
        choice_nt = np.empty((n, t), np.int64)
        for i, r in enumerate(row_ids):
            rng = np.random.default_rng([self.seed, step, int(r)])
            out[i, 0] = rng.integers(0, self.vocab_size)
            choice_nt[i] = rng.integers(0, SUCCESSORS, size=t)
        for j in range(1, t):  # walk all rows' chains together, one position at a time
            out[:, j] = self.next_vc[out[:, j - 1], choice_nt[:, j]]
        return out


class TokenFileSource:
    def __init__(self, path: str, dtype: str, seq_len: int, seed: int, vocab_size: int, global_batch: int):
        p = Path(path)
        try:
            self.tokens = np.load(p, mmap_mode="r") if p.suffix == ".npy" else np.memmap(p, dtype=dtype, mode="r")
        except (OSError, ValueError) as e:  # missing, empty, or a size that is not a whole number of tokens
            raise ConfigError(f"data.path={path!r}: cannot read it as {'.npy' if p.suffix == '.npy' else dtype} "
                              f"tokens ({e}); check data.path and data.dtype") from None
        self.path, self.seq_len, self.seed = path, seq_len, seed
        self.global_batch, self.vocab_size = global_batch, vocab_size
        self.n_windows = (len(self.tokens) - 1) // seq_len
        self._epoch_order: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))
        if self.n_windows < 1:
            raise ConfigError(f"data.path={path!r}: holds {len(self.tokens)} tokens, fewer than "
                              f"data.seq_len+1={seq_len + 1}; use a larger file or a shorter data.seq_len")
        top = int(self.tokens[: min(len(self.tokens), 1 << 20)].max())
        if top >= vocab_size:
            raise ConfigError(f"data.path={path!r}: token id {top} >= model.vocab_size={vocab_size}; "
                              f"set model.vocab_size to at least {top + 1}")

    def _order(self, epoch: int) -> np.ndarray:
        # One epoch's permutation is kept: a step reads consecutive indices, so it is reused for
        # many steps and recomputed only when the epoch changes.
        if self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._epoch_order[1]

    def rows(self, step: int, row_ids: np.ndarray) -> np.ndarray:
        t = self.seq_len
        out = np.empty((len(row_ids), t + 1), np.int32)
        for i, r in enumerate(row_ids):
            idx = step * self.global_batch + int(r)
            w = self._order(idx // self.n_windows)[idx % self.n_windows]
            out[i] = self.tokens[w * t: w * t + t + 1]  # windows overlap by one token: the last label
        # The start-up check samples the file's head; an id outside the table here would be clamped by the
        # embedding gather and train silently on the wrong token.
        if out.min() < 0 or out.max() >= self.vocab_size:
            raise ConfigError(f"data.path={self.path!r}: token ids in [{out.min()}, {out.max()}] at step {step} "
                              f"fall outside model.vocab_size={self.vocab_size}; set model.vocab_size to at least "
                              f"the tokenizer's vocabulary")
        return out


class Batches:
    """`batch(step)` -> global tokens [grad_accum, global_batch / grad_accum, seq_len + 1], sharded."""

    def __init__(self, data: DataConfig, *, vocab_size: int, global_batch: int, grad_accum: int, seed: int,
                 sharding: jax.sharding.NamedSharding):
        self.global_batch, self.grad_accum, self.sharding = global_batch, grad_accum, sharding
        self.shape = (grad_accum, global_batch // grad_accum, data.seq_len + 1)
        if data.source == "synthetic":
            self.source = SyntheticSource(vocab_size, data.seq_len, seed)
        else:
            self.source = TokenFileSource(data.path, data.dtype, data.seq_len, seed, vocab_size, global_batch)
        self._rows = self._local_rows_range()

    def _local_rows_range(self) -> slice:
        """The rows (of every microbatch) this process's devices hold: one contiguous block."""
        idx = self.sharding.addressable_devices_indices_map(self.shape).values()
        rows = [(s[1].start or 0, s[1].stop if s[1].stop is not None else self.shape[1]) for s in idx]
        lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
        covered = sum(b - a for a, b in set(rows))
        if covered != hi - lo:
            raise ConfigError(f"this process's batch rows {sorted(set(rows))} are not contiguous; the mesh "
                              f"must put whole hosts on the batch axes (dp, fsdp)")
        return slice(lo, hi)

    def local_rows(self, step: int) -> np.ndarray:
        """This process's part [A, rows, T+1]. Global row id = microbatch * m + row, as in one big batch."""
        rows, m = self._rows, self.shape[1]
        ids_ar = np.arange(self.grad_accum)[:, None] * m + np.arange(rows.start, rows.stop)[None, :]
        return self.source.rows(step, ids_ar.reshape(-1)).reshape(self.grad_accum, rows.stop - rows.start, -1)

    def batch(self, step: int) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, self.local_rows(step), self.shape)
