"""Turn text files into the flat token file that `data.source=file` trains on.

  python scripts/prepare_data.py INPUT... --out tokens.bin [--tokenizer tokenizer.json]
                                 [--dtype uint16|uint32] [--append-eos [--eos-token TEXT]]

INPUT is a text file or a directory (every *.txt below it, in sorted order); each file is one document.
The output is every document's tokens back to back: a raw little-endian array (`data.dtype` says its
element type) or, when --out ends in .npy, a NumPy array file.

Tokens:
  byte level (default)  token = byte value of the UTF-8 text, so ids 0..255 and model.vocab_size=256;
                        --append-eos ends every document with id 256, so model.vocab_size=257.
  --tokenizer PATH      a Hugging Face `tokenizers` JSON file (`pip install tokenizers`), encoded without
                        the tokenizer's own special-token template; model.vocab_size = its vocabulary
                        size (with added tokens). --append-eos ends every document with --eos-token, or
                        with the first of </s>, <|endoftext|>, <|end_of_text|>, <eos>, [SEP] that the
                        tokenizer knows, or else with a new id equal to the vocabulary size (one more).

The summary at the end prints the exact overrides to train on the file. model.vocab_size must be at
least the printed value; meshtrain pads it to a multiple of mesh.tp itself.

Memory stays bounded: files are read in pieces of about --chunk-mb MiB and the tokens are written as
they come. Byte level is exact for any piece size. For a tokenizer the pieces are whole lines (one very
long line is read whole), and a document of several pieces differs from encoding it in one go only if a
token would span a line end. The output appears only once complete (written beside it, then renamed).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
UINT16_IDS = 1 << 16  # a vocabulary of up to 65536 ids fits uint16


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported as one line, exit status 2."""


def find_documents(inputs: list[str]) -> list[Path]:
    docs: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.txt") if q.is_file())
            if not found:
                raise UsageError(f"input directory {item!r} holds no .txt files")
            docs.extend(found)
        elif p.is_file():
            docs.append(p)
        else:
            raise UsageError(f"input {item!r}: no such file or directory")
    return docs


def read_pieces(path: Path, chunk_bytes: int, binary: bool) -> Iterator[bytes | str]:
    """The file in pieces: bytes of chunk_bytes each, or text of whole lines adding up to about that."""
    if binary:
        with open(path, "rb") as f:
            while piece := f.read(chunk_bytes):
                yield piece
        return
    with open(path, encoding="utf-8", newline="") as f:  # newline="": keep \r\n as written
        while lines := f.readlines(chunk_bytes):
            yield "".join(lines)


class ByteLevel:
    binary = True

    def __init__(self, append_eos: bool):
        self.eos_id = 256 if append_eos else None
        self.vocab_size = 257 if append_eos else 256
        self.name = "byte level" + (", end-of-document id 256" if append_eos else "")

    def encode(self, piece: bytes) -> np.ndarray:
        return np.frombuffer(piece, np.uint8)


class HFTokenizer:
    binary = False

    def __init__(self, path: str, append_eos: bool, eos_token: str | None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from None
        if not Path(path).is_file():
            raise UsageError(f"--tokenizer {path!r}: no such file")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for malformed JSON
            raise UsageError(f"--tokenizer {path!r}: not a tokenizers JSON file ({' '.join(str(e).split())})") \
                from None
        size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.vocab_size, eos_name = None, size, ""
        if append_eos:
            names = [eos_token] if eos_token else list(EOS_CANDIDATES)
            known = [(n, self.tok.token_to_id(n)) for n in names if self.tok.token_to_id(n) is not None]
            if eos_token and not known:
                raise UsageError(f"--eos-token {eos_token!r}: the tokenizer has no such token")
            if known:
                eos_name, self.eos_id = known[0]
            else:
                eos_name, self.eos_id, self.vocab_size = "new id", size, size + 1
        self.name = f"tokenizer {path}" + (f", end-of-document {eos_name} = id {self.eos_id}" if append_eos else "")

    def encode(self, piece: str) -> np.ndarray:
        return np.asarray(self.tok.encode(piece, add_special_tokens=False).ids, np.int64)


def pick_dtype(requested: str | None, vocab_size: int) -> str:
    if requested == "uint16" and vocab_size > UINT16_IDS:
        raise UsageError(f"--dtype uint16 holds ids up to {UINT16_IDS - 1}, but the vocabulary needs "
                         f"{vocab_size} ids; use --dtype uint32 (or leave --dtype out)")
    return requested or ("uint16" if vocab_size <= UINT16_IDS else "uint32")


def write_tokens(docs: list[Path], coder: ByteLevel | HFTokenizer, dtype: str, out: Path, chunk_bytes: int,
                 progress: Callable[[str], None]) -> int:
    """Stream every document's tokens into `out` (raw); returns the token count."""
    n_tokens = 0
    eos = None if coder.eos_id is None else np.asarray([coder.eos_id], dtype)
    with open(out, "wb") as f:
        for i, doc in enumerate(docs):
            try:
                for piece in read_pieces(doc, chunk_bytes, coder.binary):
                    ids = coder.encode(piece)
                    if ids.size and int(ids.max()) >= coder.vocab_size:  # a tokenizer bug would corrupt training
                        raise UsageError(f"{doc}: token id {int(ids.max())} >= vocabulary size {coder.vocab_size}")
                    ids.astype(dtype).tofile(f)
                    n_tokens += ids.size
            except UnicodeDecodeError as e:
                raise UsageError(f"{doc}: not UTF-8 text ({e.reason}); the byte-level default (no --tokenizer) "
                                 f"reads any bytes") from None
            if eos is not None:
                eos.tofile(f)
                n_tokens += 1
            if (i + 1) % 1000 == 0:
                progress(f"{i + 1}/{len(docs)} documents, {n_tokens} tokens")
    return n_tokens


def to_npy(raw: Path, out: Path, dtype: str, n_tokens: int, chunk: int = 1 << 24) -> None:
    """Copy a raw token file into a .npy of known length, a bounded chunk at a time."""
    src = np.memmap(raw, dtype=dtype, mode="r") if n_tokens else np.zeros(0, dtype)
    dst = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(n_tokens,))
    for lo in range(0, n_tokens, chunk):
        dst[lo: lo + chunk] = src[lo: lo + chunk]
    dst.flush()
    del src, dst


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            break
        n /= 1024
    else:
        unit = "TiB"
    return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/prepare_data.py", description=__doc__.split("\n\n")[0],
                                 epilog="See the module docstring for the vocabulary rules.")
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, or directories of .txt files")
    ap.add_argument("--out", required=True, help="output token file: raw (e.g. tokens.bin) or .npy")
    ap.add_argument("--tokenizer", help="tokenizers JSON file; default: byte level (vocabulary 256)")
    ap.add_argument("--dtype", choices=("uint16", "uint32"), help="default: uint16 when the vocabulary fits")
    ap.add_argument("--append-eos", action="store_true", help="end every document with an end-of-document id")
    ap.add_argument("--eos-token", help="with --tokenizer: the end-of-document token (e.g. '</s>')")
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="read pieces of about this many MiB (default 4)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    tmp = out.with_name(out.name + ".partial")
    try:
        if a.eos_token and not (a.tokenizer and a.append_eos):
            raise UsageError("--eos-token needs --tokenizer and --append-eos")
        if a.chunk_mb <= 0:
            raise UsageError(f"--chunk-mb {a.chunk_mb}: must be > 0")
        docs = find_documents(a.inputs)
        coder = HFTokenizer(a.tokenizer, a.append_eos, a.eos_token) if a.tokenizer else ByteLevel(a.append_eos)
        dtype = pick_dtype(a.dtype, coder.vocab_size)
        out.parent.mkdir(parents=True, exist_ok=True)
        chunk_bytes = max(1, int(a.chunk_mb * (1 << 20)))
        n_tokens = write_tokens(docs, coder, dtype, tmp, chunk_bytes, lambda s: print(s, file=sys.stderr))
        if n_tokens == 0:
            raise UsageError("the inputs hold no text, so there is nothing to train on")
        if out.suffix == ".npy":
            to_npy(tmp, out, dtype, n_tokens)
            tmp.unlink()
        else:
            os.replace(tmp, out)
    except (UsageError, OSError) as e:  # OSError: unreadable input, unwritable output, full disk
        tmp.unlink(missing_ok=True)
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

    overrides = ["data.source=file", f"data.path={out.resolve()}"]
    if out.suffix != ".npy":  # a .npy file records its own element type
        overrides.append(f"data.dtype={dtype}")
    overrides.append(f"model.vocab_size={coder.vocab_size}")
    print(f"wrote {out}: {len(docs)} documents, {n_tokens} tokens, {dtype} "
          f"({human_bytes(n_tokens * np.dtype(dtype).itemsize)})")
    print(f"vocabulary: {coder.vocab_size} ids needed ({coder.name}); model.vocab_size must be at least "
          f"{coder.vocab_size}")
    print("train on it with these overrides (data.seq_len + 1 must not exceed the token count):")
    print("  " + " ".join(shlex.quote(o) for o in overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
