"""TextSource: what data.Batches reads for data.source=hf. One or more sources (data.path, or data.mixture's
weighted ones), each its documents in lanes (lanes.py), the held-out part of each kept apart.

Splits: "train" reads each source's documents but the last data.eval_fraction of them, in a seeded order per
epoch; "eval" reads that held-out end of each (or all of data.eval_path) in the documents' own order, so
every evaluation sees the same tokens; "all" reads every document in order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtrain.config import ConfigError, DataConfig
from meshtrain.config.text_sources import parse_mixture
from meshtrain.documents.counts import open_counts
from meshtrain.documents.lanes import LanePacker
from meshtrain.documents.reading import Documents, counts_key, load_tokenizer

MIX_BLOCK = 1024  # a lane's source choices are drawn this many steps at a time
MIX_STREAM = 0x313C  # the choices' random stream, apart from the documents' orders
EVAL_STREAM = 0xE7A1


class TextSource:
    def __init__(self, data: DataConfig, *, vocab_size: int, seed: int, global_batch: int, cache_dir: Path,
                 split: str = "train"):
        self.seq_len, self.seed = data.seq_len, seed
        tok = load_tokenizer(data.tokenizer)
        size = tok.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise ConfigError(f"data.tokenizer={data.tokenizer!r}: its vocabulary holds {size} ids but "
                              f"model.vocab_size={vocab_size}; set model.vocab_size to at least {size}")
        if split == "eval" and data.eval_path:
            parts, fields, fraction, split = [(data.eval_path, 1.0)], ["data.eval_path"], 0.0, "all"
        else:
            parts = parse_mixture(data.mixture)[0] if data.mixture else [(data.path, 1.0)]
            fields = ["data.mixture" if data.mixture else "data.path"] * len(parts)
            fraction = 0.0 if data.eval_path or split == "all" else data.eval_fraction
            if split == "eval" and not fraction:
                raise ConfigError("evaluation needs held-out data: set data.eval_fraction (the end of each source) "
                                  "or data.eval_path")
        self.packers = []
        for salt, ((path, _), field) in enumerate(zip(parts, fields)):
            docs = Documents(path, data.text_column, cache_dir, field)
            counts = open_counts(cache_dir / f"counts-{counts_key(docs, data.tokenizer)}.npy", docs.n)
            n_eval = max(1, round(docs.n * fraction)) if fraction else 0
            if n_eval and n_eval >= docs.n:
                raise ConfigError(f"data.eval_fraction={fraction}: {field} source {path!r} holds {docs.n} documents, "
                                  f"too few to hold some out; lower it or use data.eval_path")
            first, n = (docs.n - n_eval, n_eval) if split == "eval" else (0, docs.n - n_eval)
            self.packers.append(LanePacker(docs, tok, counts, eos_id=data.eos_id, seq_len=data.seq_len, seed=seed,
                                           salt=salt, lanes=global_batch, first=first, n=n, shuffle=split == "train"))
        w = np.array([weight for _, weight in parts], np.float64)
        self.weights = w / w.sum()
        self.stream = [MIX_STREAM] + ([EVAL_STREAM] if split != "train" else [])
        self._seen: dict[int, list[np.ndarray]] = {}  # lane -> rows drawn per source before each block

    def rows(self, step: int, row_ids: np.ndarray) -> np.ndarray:
        """Token rows [len(row_ids), seq_len + 1] of global batch `step`."""
        out = np.empty((len(row_ids), self.seq_len + 1), np.int32)
        for i, r in enumerate(row_ids):
            source, t = self._pick(int(r), step)
            out[i] = self.packers[source].row(int(r), t)
        return out

    def _pick(self, lane: int, step: int) -> tuple[int, int]:
        """(the source row `lane` of `step` reads, which of that source's lane rows it is)."""
        if len(self.packers) == 1:
            return 0, step
        block, at = divmod(step, MIX_BLOCK)
        seen = self._seen.setdefault(lane, [np.zeros(len(self.packers), np.int64)])
        while len(seen) <= block:  # rows per source in the blocks before: one draw per block (cheap to redo)
            seen.append(seen[-1] + np.bincount(self._choices(lane, len(seen) - 1), minlength=len(self.packers)))
        choices = self._choices(lane, block)
        source = int(choices[at])
        return source, int(seen[block][source] + np.count_nonzero(choices[:at] == source))

    def _choices(self, lane: int, block: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, *self.stream, lane, block])
        return rng.choice(len(self.packers), size=MIX_BLOCK, p=self.weights)
