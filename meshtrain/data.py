"""Deterministic, resumable batches: the batch of step s is a pure function of (seed, s).

Resuming therefore needs no iterator state and no replay. Each process builds only the rows its own
devices hold and the global arrays are assembled with `jax.make_array_from_process_local_data`.

A batch is a `Batch` of four [A microbatches, B/A rows, T] int32 arrays built on the host from token
rows of T+1: tokens (inputs), targets (next tokens, IGNORE where no loss), positions (RoPE) and
segment ids (attention only within a segment). Without `data.document_mask` a row is one segment with
positions 0..T-1; with it, a row is split after every `data.eos_id`: positions restart, segment ids
count documents, and the target of an end-of-document token (the next document's first token, which
it cannot predict) is ignored. With context parallelism the sequence is then permuted into the cp
layout (zig-zag by default, parallel/sequence/zigzag.py), the same permutation for all four arrays.

Sources:
  synthetic  a learnable corpus: a fixed sparse Markov chain (every token has 4 possible successors),
             so the loss falls from ln(V) towards ln(4) as the model learns the table
  file       a flat token file (.npy, or raw .bin of uint16/uint32, memory-mapped); sequence windows
             of seq_len+1 tokens are visited in a seeded random order, reshuffled every epoch
  hf         text documents (a saved `datasets` directory, parquet or JSONL; data.path or a weighted
             data.mixture) tokenized on the fly and packed with data.eos_id between documents
             (meshtrain/documents: how a row is found without tokenizing the corpus first, and its cost)
"""
from __future__ import annotations

from pathlib import Path

import flax.struct
import jax
import numpy as np

from meshtrain.config import ConfigError, DataConfig
from meshtrain.documents import TextSource
from meshtrain.model.loss import IGNORE
from meshtrain.parallel.sequence.zigzag import sequence_order

SUCCESSORS = 4  # branching factor of the synthetic Markov chain: the loss floor is ln(4) ≈ 1.386


EVAL_STREAM = 0xE7A1  # the synthetic corpus's eval rows come from a random stream of their own


class SyntheticSource:
    def __init__(self, vocab_size: int, seq_len: int, seed: int, eval_split: bool = False):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.stream = [EVAL_STREAM] if eval_split else []
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.next_vc = table_rng.integers(0, vocab_size, size=(vocab_size, SUCCESSORS), dtype=np.int64)

    def rows(self, step: int, row_ids: np.ndarray) -> np.ndarray:
        """Token rows [len(row_ids), seq_len + 1] of global batch `step`."""
        n, t = len(row_ids), self.seq_len + 1
        out = np.empty((n, t), np.int32)
        choice_nt = np.empty((n, t), np.int64)
        for i, r in enumerate(row_ids):
            rng = np.random.default_rng([self.seed, *self.stream, step, int(r)])
            out[i, 0] = rng.integers(0, self.vocab_size)
            choice_nt[i] = rng.integers(0, SUCCESSORS, size=t)
        for j in range(1, t):  # walk all rows' chains together, one position at a time
            out[:, j] = self.next_vc[out[:, j - 1], choice_nt[:, j]]
        return out


class TokenFileSource:
    """Windows [first, first + n) of a token file: shuffled per epoch (training) or in file order (eval)."""

    def __init__(self, path: str, dtype: str, seq_len: int, seed: int, vocab_size: int, global_batch: int,
                 part: str = "train", eval_fraction: float = 0.0):
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
        # data.eval_fraction holds out the file's last windows: "train" reads the rest, shuffled; "eval"
        # reads those in order, so every evaluation sees the same tokens.
        n_eval = max(1, round(self.n_windows * eval_fraction)) if eval_fraction else 0
        if n_eval and n_eval >= self.n_windows:
            raise ConfigError(f"data.eval_fraction={eval_fraction}: data.path={path!r} has {self.n_windows} windows "
                              f"of data.seq_len+1 tokens, too few to hold some out; lower it or use data.eval_path")
        self.first = self.n_windows - n_eval if part == "eval" else 0
        self.n_windows = n_eval if part == "eval" else self.n_windows - n_eval
        self.shuffle = part == "train"
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
            w = self.first + (self._order(idx // self.n_windows)[idx % self.n_windows] if self.shuffle
                              else idx % self.n_windows)
            out[i] = self.tokens[w * t: w * t + t + 1]  # windows overlap by one token: the last label
        # The start-up check samples the file's head; an id outside the table here would be clamped by the
        # embedding gather and train silently on the wrong token.
        if out.min() < 0 or out.max() >= self.vocab_size:
            raise ConfigError(f"data.path={self.path!r}: token ids in [{out.min()}, {out.max()}] at step {step} "
                              f"fall outside model.vocab_size={self.vocab_size}; set model.vocab_size to at least "
                              f"the tokenizer's vocabulary")
        return out


@flax.struct.dataclass
class Batch:
    """What the step consumes; every field [A, B/A, T] int32 (or [B, T] for one microbatch)."""

    tokens: jax.Array
    targets: jax.Array
    positions: jax.Array
    segment_ids: jax.Array

    def microbatch(self, i) -> "Batch":
        return jax.tree.map(lambda x: x[i], self)


def batch_fields(rows_nt1: np.ndarray, *, document_mask: bool = False, eos_id: int = -1, cp: int = 1,
                 cp_layout: str = "zigzag") -> dict[str, np.ndarray]:
    """Token rows [N, T+1] -> the four Batch fields [N, T] as numpy arrays (see the module docstring)."""
    tokens_nt = np.ascontiguousarray(rows_nt1[:, :-1], dtype=np.int32)
    targets_nt = np.array(rows_nt1[:, 1:], dtype=np.int32)
    n, t = tokens_nt.shape
    if document_mask:
        ends_nt = tokens_nt == eos_id
        segment_ids_nt = (np.cumsum(ends_nt, axis=1) - ends_nt).astype(np.int32)  # eos closes its own document
        starts_nt = np.ones((n, t), bool)
        starts_nt[:, 1:] = segment_ids_nt[:, 1:] != segment_ids_nt[:, :-1]
        # Position = distance to the latest segment start at or before it.
        start_index_nt = np.maximum.accumulate(np.where(starts_nt, np.arange(t)[None, :], 0), axis=1)
        positions_nt = (np.arange(t)[None, :] - start_index_nt).astype(np.int32)
        targets_nt[ends_nt] = IGNORE
    else:
        segment_ids_nt = np.zeros((n, t), np.int32)
        positions_nt = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t))
    order_t = sequence_order(t, cp, cp_layout)
    return {name: np.ascontiguousarray(a[:, order_t]) for name, a in
            (("tokens", tokens_nt), ("targets", targets_nt), ("positions", positions_nt),
             ("segment_ids", segment_ids_nt))}


class Batches:
    """`batch(step)` -> the global `Batch` of step `step`, every field [grad_accum, global_batch / grad_accum,
    seq_len], sharded."""

    def __init__(self, data: DataConfig, *, vocab_size: int, global_batch: int, grad_accum: int, seed: int,
                 sharding: jax.sharding.NamedSharding, cp: int = 1, cp_layout: str = "zigzag", split: str = "train",
                 cache_dir: str | Path = ""):
        """`split`: "train", "eval" (the held-out data: data.eval_path, the data.eval_fraction end of
        data.path, or the synthetic eval stream) or "all" (every window of data.path, in order).
        `cache_dir`: data.source=hf's Arrow copies and token counts (default data.cache_dir)."""
        self.global_batch, self.grad_accum, self.sharding = global_batch, grad_accum, sharding
        self.data, self.cp, self.cp_layout = data, cp, cp_layout
        self.shape = (grad_accum, global_batch // grad_accum, data.seq_len)
        if data.source == "synthetic":
            self.source = SyntheticSource(vocab_size, data.seq_len, seed, eval_split=split != "train")
        elif data.source == "hf":
            self.source = TextSource(data, vocab_size=vocab_size, seed=seed, global_batch=global_batch,
                                     cache_dir=Path(cache_dir or text_cache_dir(data, ".")), split=split)
        elif split == "eval" and data.eval_path:
            self.source = TokenFileSource(data.eval_path, data.dtype, data.seq_len, seed, vocab_size, global_batch,
                                          part="all")
        else:  # data.path: its training windows, its held-out end, or all of it in order
            fraction = 0.0 if data.eval_path or split == "all" else data.eval_fraction
            if split == "eval" and not fraction:
                raise ConfigError("evaluation needs held-out data: set data.eval_fraction (the end of data.path) or "
                                  "data.eval_path")
            self.source = TokenFileSource(data.path, data.dtype, data.seq_len, seed, vocab_size, global_batch,
                                          part=split, eval_fraction=fraction)
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
        """This process's token rows [A, rows, T+1]. Global row id = microbatch * m + row, as in one big batch."""
        rows, m = self._rows, self.shape[1]
        ids_ar = np.arange(self.grad_accum)[:, None] * m + np.arange(rows.start, rows.stop)[None, :]
        return self.source.rows(step, ids_ar.reshape(-1)).reshape(self.grad_accum, rows.stop - rows.start, -1)

    def local_fields(self, step: int) -> dict[str, np.ndarray]:
        """This process's part of the four Batch fields, each [A, rows, T]."""
        rows_ar1 = self.local_rows(step)
        a, r, t1 = rows_ar1.shape
        fields = batch_fields(rows_ar1.reshape(a * r, t1), document_mask=self.data.document_mask,
                              eos_id=self.data.eos_id, cp=self.cp, cp_layout=self.cp_layout)
        return {k: v.reshape(a, r, t1 - 1) for k, v in fields.items()}

    def batch(self, step: int) -> Batch:
        put = lambda x: jax.make_array_from_process_local_data(self.sharding, x, self.shape)  # noqa: E731
        return Batch(**{k: put(v) for k, v in self.local_fields(step).items()})


def text_cache_dir(data: DataConfig, run_dir: str) -> Path:
    """Where data.source=hf keeps its Arrow copies and token counts: data.cache_dir, else <run.dir>/data_cache."""
    return Path(data.cache_dir) if data.cache_dir else Path(run_dir) / "data_cache"


FULL_SCAN_TOKENS = 1 << 30  # files up to this size are scanned whole at start; larger ones are sampled


def check_token_files(data: DataConfig, vocab_size: int) -> list[str]:
    """The token files (data.path, data.eval_path) as the run will read them, checked before any device work:
    a 1-D integer array (a .npy's shape and dtype; a raw .bin's length a whole number of data.dtype words),
    every id in [0, vocab_size), and a raw uint16 file that is really uint32 (every high half zero).

    A file of up to 2^30 tokens is read whole (about a second per GB); a larger one in 64 blocks of
    1M tokens spread over it (each batch is still checked as it is read)."""
    problems = []
    for field, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if data.source != "file" or not path or not Path(path).is_file():
            continue  # validate() reports a missing file
        problem = _token_file_problem(Path(path), data.dtype, vocab_size)
        if problem:
            problems.append(f"{field}={path!r}: {problem}")
    return problems


def _token_file_problem(p: Path, dtype: str, vocab_size: int) -> str | None:
    try:
        if p.suffix == ".npy":
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        else:
            size, word = p.stat().st_size, np.dtype(dtype).itemsize
            if size % word:
                return (f"{size} bytes is not a whole number of data.dtype={dtype} tokens ({word} bytes each); "
                        f"check data.dtype or the file")
            tokens = np.memmap(p, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        return f"cannot read it as {dtype} tokens ({e}); check it and data.dtype"
    if p.suffix == ".npy":
        if tokens.ndim != 1:
            return f"a .npy of shape {tokens.shape}: token files hold one flat array of ids; save tokens.reshape(-1)"
        if not np.issubdtype(tokens.dtype, np.integer):
            return (f"a .npy of {tokens.dtype} values: token ids must be integers; save them as uint16/uint32 "
                    f"(e.g. np.save(path, ids.astype(np.uint32)))")
    n, block = len(tokens), 1 << 20
    if n == 0:
        return "holds no tokens"
    if n <= FULL_SCAN_TOKENS:
        block = 1 << 26
        starts = range(0, n, block)
    else:
        starts = np.linspace(0, n - block, 64).astype(np.int64)
    top, low, odd_nonzero, even_nonzero = 0, 0, False, False
    for s in starts:
        chunk = np.asarray(tokens[s: s + block])
        top, low = max(top, int(chunk.max())), min(low, int(chunk.min()))
        if p.suffix != ".npy" and dtype == "uint16":
            first = int(s) % 2  # the word at an even file position is the low half of a little-endian uint32
            odd_nonzero |= bool(chunk[1 - first::2].any())
            even_nonzero |= bool(chunk[first::2].any())
    if low < 0:
        return f"token id {low} is negative; ids must be in [0, model.vocab_size={vocab_size}): re-tokenize the data"
    if p.suffix != ".npy" and dtype == "uint16" and n >= 64 and even_nonzero and not odd_nonzero:
        return ("every second uint16 word is zero: this looks like a uint32 token file read as data.dtype=uint16; "
                "set data.dtype=uint32")
    if top >= vocab_size:
        other = _fitting_dtype(p, dtype, vocab_size)
        return f"token id {top} >= model.vocab_size={vocab_size}; " + (
            f"read as {other} its ids fit: set data.dtype={other}" if other else
            f"set model.vocab_size to at least {top + 1} (the tokenizer's vocabulary) or re-tokenize the data")
    return None


def _fitting_dtype(p: Path, dtype: str, vocab_size: int) -> str | None:
    """The other raw element type, when the file's head read as it holds only ids < vocab_size (a uint16
    file read as uint32 pairs its ids into numbers in the millions)."""
    other = {"uint16": "uint32", "uint32": "uint16"}[dtype]
    if p.suffix == ".npy" or p.stat().st_size % np.dtype(other).itemsize:
        return None
    head = np.fromfile(p, dtype=other, count=1 << 20)
    return other if len(head) and int(head.max()) < vocab_size else None
