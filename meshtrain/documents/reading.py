"""A text source opened with `datasets` (memory-mapped Arrow: parquet and JSONL are converted once into
data.cache_dir/hf, a saved dataset is read where it lies) and the tokenizer, each failure one ConfigError line."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from meshtrain.config import ConfigError
from meshtrain.config.text_sources import source_files, tokenizer_file


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + " ...") if len(text) > 300 else text or type(e).__name__


class Documents:
    """The documents of one source: how many, and their texts by index."""

    def __init__(self, path: str, text_column: str, cache_dir: Path, field: str = "data.path"):
        import datasets

        shown = f"{field}={path!r}"
        try:
            fmt, self.files = source_files(path)
        except ValueError as e:
            raise ConfigError(f"{shown}: {e}") from None
        try:
            if fmt == "saved":
                ds = datasets.load_from_disk(path)
            else:
                ds = datasets.load_dataset(fmt, data_files=self.files, split="train", cache_dir=str(cache_dir / "hf"))
        except Exception as e:  # the readers raise their own kinds (ArrowInvalid, DatasetGenerationError, ...)
            raise ConfigError(f"{shown}: cannot read it as {fmt} ({_one_line(e)}); check the files") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds and len(ds) != 1:
                raise ConfigError(f"{shown}: a DatasetDict of splits {', '.join(ds)}; save the one to train on "
                                  f"(ds[split].save_to_disk(DIR)) and point {field} at it")
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        if text_column not in ds.column_names:
            raise ConfigError(f"{shown}: no column {text_column!r} (columns: {', '.join(ds.column_names)}); set "
                              f"data.text_column to the one holding the text")
        if len(ds) == 0:
            raise ConfigError(f"{shown}: holds no documents")
        self.path, self.column, self.n = path, text_column, len(ds)
        self.ds = ds.select_columns([text_column])
        self.saved = fmt == "saved"

    def texts(self, ids) -> list[str]:
        return [t or "" for t in self.ds[[int(i) for i in ids]][self.column]]  # None (a missing value): empty

    def identity(self) -> list:
        """What the documents' token counts depend on, besides the tokenizer: every file, its size and time."""
        files = sorted(q for q in Path(self.path).rglob("*") if q.is_file()) if self.saved else map(Path, self.files)
        return [self.column] + [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def load_tokenizer(path: str):
    """The `tokenizers` Tokenizer of data.tokenizer (a tokenizer.json, or a directory holding one)."""
    from tokenizers import Tokenizer

    f = tokenizer_file(path)
    if f is None:
        raise ConfigError(f"data.tokenizer={path!r}: no tokenizer.json there; point it at a tokenizer.json or a "
                          f"directory holding one")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the library raises a bare Exception for malformed JSON
        raise ConfigError(f"data.tokenizer={path!r}: not a readable tokenizers JSON file ({_one_line(e)}); point "
                          f"it at the tokenizer.json of a Hugging Face model") from None


def tokenizer_digest(path: str) -> str:
    f = tokenizer_file(path)
    return hashlib.sha256(f.read_bytes()).hexdigest() if f else ""


def counts_key(docs: Documents, tokenizer_path: str) -> str:
    """Names the count file of (these documents, this tokenizer): a different file or tokenizer gets its own."""
    text = json.dumps([docs.identity(), tokenizer_digest(tokenizer_path)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]
