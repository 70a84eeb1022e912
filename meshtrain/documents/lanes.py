"""One source's rows, lane by lane (the lanes and their cost: meshtrain/documents/__init__.py).

    lane r:  doc G[r] + eos | doc G[r+B] + eos | doc G[r+2B] + eos | ...     G = epoch 0's order, epoch 1's, ...
    row t:   tokens [t*T, t*T + T + 1) of that stream
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from meshtrain.config import ConfigError
from meshtrain.documents.counts import UNKNOWN
from meshtrain.documents.reading import Documents

GROW = 16  # documents a lane counts ahead at a time (tokenized together: encode_batch runs on all cores)
KEEP_ENDS = 4096  # a lane forgets the ends of documents this far behind its reading point
CACHE_TOKENS = 1 << 23  # tokenized documents kept for the next rows (a document spans rows): 32 MiB of ids


class _Lane:
    """Where a lane's documents end: ends[i] is the stream offset after document k0 + i (its eos included)."""

    def __init__(self):
        self.k0, self.before, self.ends = 0, 0, np.zeros(0, np.int64)


class LanePacker:
    def __init__(self, docs: Documents, tokenizer, counts: np.ndarray, *, eos_id: int, seq_len: int, seed: int,
                 salt: int, lanes: int, first: int, n: int, shuffle: bool):
        """Documents [first, first + n) of `docs` in `lanes` lanes, in a seeded order per epoch (`shuffle`) or
        in their own order; `salt` keeps the orders of a mixture's sources apart."""
        self.docs, self.tok, self.counts = docs, tokenizer, counts
        self.eos_id, self.seq_len, self.seed, self.salt = eos_id, seq_len, seed, salt
        self.lanes, self.first, self.n, self.shuffle = lanes, first, n, shuffle
        self._lanes: dict[int, _Lane] = {}
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_tokens = 0

    def doc_ids(self, lane: int, ks: np.ndarray) -> np.ndarray:
        """The documents at positions `ks` of lane `lane`."""
        g = lane + ks * self.lanes
        epoch, j = np.divmod(g, self.n)
        if not self.shuffle:
            return self.first + j
        out = np.empty(len(ks), np.int64)
        for e in np.unique(epoch):  # one or two epochs per call
            at = epoch == e
            out[at] = self.first + self._perm(int(e))[j[at]]
        return out

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, self.salt, epoch]).permutation(self.n)
            while len(self._perms) > 2:  # lanes straddle at most two epochs at a time
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def row(self, lane: int, t: int) -> np.ndarray:
        """Row t of lane `lane`: seq_len + 1 int32 tokens."""
        a, b = t * self.seq_len, t * self.seq_len + self.seq_len + 1
        ln = self._lanes.setdefault(lane, _Lane())
        if a < ln.before:  # asked for a row behind what the lane remembers (an evaluation starts again)
            ln = self._lanes[lane] = _Lane()
        while not len(ln.ends) or ln.ends[-1] < b:
            self._extend(lane, ln)
        i0 = int(np.searchsorted(ln.ends, a, side="right"))  # the first document ending after a
        i1 = int(np.searchsorted(ln.ends, b, side="left"))  # the document holding token b - 1
        start = int(ln.ends[i0 - 1]) if i0 else ln.before
        ids = [int(d) for d in self.doc_ids(lane, ln.k0 + np.arange(i0, i1 + 1))]
        self._tokenize([d for d in dict.fromkeys(ids) if d not in self._cache])
        out = np.concatenate([self._cache[d] for d in ids])[a - start: b - start]
        for d in ids:
            self._cache.move_to_end(d)
        self._evict()
        if i0 > KEEP_ENDS:
            ln.before, ln.ends, ln.k0 = int(ln.ends[i0 - 1]), ln.ends[i0:], ln.k0 + i0
        return out

    def _extend(self, lane: int, ln: _Lane) -> None:
        """Count the lane's next GROW documents: from the count file, tokenizing those it does not know."""
        ids = self.doc_ids(lane, ln.k0 + len(ln.ends) + np.arange(GROW))
        self._tokenize([int(d) for d in np.unique(ids) if self.counts[d] == UNKNOWN and int(d) not in self._cache])
        self._evict()
        lengths = self.counts[ids].astype(np.int64) + 1  # + eos
        last = int(ln.ends[-1]) if len(ln.ends) else ln.before
        ln.ends = np.concatenate([ln.ends, last + np.cumsum(lengths)])

    def _tokenize(self, ids: list[int]) -> None:
        if not ids:
            return
        encoded = self.tok.encode_batch(self.docs.texts(ids), add_special_tokens=False)
        for d, enc in zip(ids, encoded):
            tokens = np.asarray(enc.ids + [self.eos_id], np.int32)
            known = int(self.counts[d])
            if known not in (UNKNOWN, len(tokens) - 1):
                raise ConfigError(f"data.cache_dir: the kept token count of document {d} of {self.docs.path!r} is "
                                  f"{known}, but it tokenizes to {len(tokens) - 1}; delete the count files "
                                  f"(counts-*.npy) in data.cache_dir")
            self.counts[d] = len(tokens) - 1
            self._cache[d] = tokens
            self._cached_tokens += len(tokens)

    def _evict(self) -> None:
        while self._cached_tokens > CACHE_TOKENS and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old)
