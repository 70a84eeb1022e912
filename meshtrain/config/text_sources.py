"""data.source=hf in terms the config can check without the data libraries: which files a data.path names,
what data.mixture says, where a tokenizer.json is.

A text source is one of
  a directory written by `datasets`' save_to_disk (it holds dataset_info.json or dataset_dict.json),
  a parquet or JSONL file,
  a directory: every *.parquet, *.jsonl and *.json file below it, in sorted order,
  a glob (e.g. data/*.parquet; ** reaches into subdirectories), its matches in sorted order.
One source's files share one format. data.mixture is "PATH:WEIGHT,PATH:WEIGHT" (a plain string, the same on
the command line and in YAML); the weights are relative and need not add up to 1.

Pure Python: the readers themselves are meshtrain/documents.
"""
from __future__ import annotations

import glob
import math
from pathlib import Path

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}  # suffix -> the `datasets` builder
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


def source_files(path: str) -> tuple[str, list[str]]:
    """(format, files) of a source: format "saved" (files: [the directory]), "parquet" or "json".

    Raises ValueError with the reason when the path names nothing readable."""
    p = Path(path)
    if p.is_dir() and any((p / m).is_file() for m in SAVED_MARKERS):
        return "saved", [str(p)]
    if p.is_dir():
        files = sorted(str(q) for q in p.rglob("*") if q.suffix in FORMATS and q.is_file())
        if not files:
            raise ValueError("a directory with neither a saved dataset (dataset_info.json) nor *.parquet/*.jsonl files")
    elif p.is_file():
        files = [str(p)]
    elif glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise ValueError("the pattern matches no file")
    else:
        raise ValueError("no such file or directory")
    kinds = {FORMATS.get(Path(f).suffix) for f in files}
    if None in kinds:
        odd = next(f for f in files if Path(f).suffix not in FORMATS)
        raise ValueError(f"{odd!r} is not .parquet, .jsonl or .json")
    if len(kinds) > 1:
        raise ValueError("mixes parquet and JSON files; make each format its own source (data.mixture)")
    return kinds.pop(), files


def parse_mixture(text: str) -> tuple[list[tuple[str, float]], list[str]]:
    """data.mixture -> ([(path, weight)], problems). A path may hold ':' (the weight is after the last one)."""
    parts, problems = [], []
    for item in (s.strip() for s in text.split(",")):
        path, sep, weight = item.rpartition(":")
        try:
            w = float(weight) if sep and path else math.nan
        except ValueError:
            w = math.nan
        if not (math.isfinite(w) and w > 0):
            problems.append(f"data.mixture={text!r}: {item!r} is not PATH:WEIGHT with a weight > 0; write e.g. "
                            f"data.mixture=a.parquet:0.7,b.jsonl:0.3")
            continue
        parts.append((path, w))
    return parts, problems


def text_source_paths(data) -> list[tuple[str, str]]:
    """(field, path) of every text source a DataConfig reads: data.path or data.mixture's, and data.eval_path."""
    if data.mixture:
        paths = [("data.mixture", p) for p, _ in parse_mixture(data.mixture)[0]]
    else:
        paths = [("data.path", data.path)] if data.path else []
    return paths + ([("data.eval_path", data.eval_path)] if data.eval_path else [])


def tokenizer_file(path: str) -> Path | None:
    """The tokenizer.json that data.tokenizer names (the file, or one in the directory), None when absent."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return p if p.is_file() else None


def text_source_problems(data, vocab_size: int) -> list[str]:
    """data.source=hf's fields, checked without reading the data: the sources exist, the mixture parses, the
    tokenizer is there, the end-of-document id is set (what reading needs: meshtrain/documents/checks.py)."""
    d, problems = data, []
    if d.path and d.mixture:
        problems.append(f"data.path={d.path!r} and data.mixture={d.mixture!r}: data.source=hf reads one of them; "
                        f"clear data.path to train on the mixture")
    elif not (d.path or d.mixture):
        problems.append("data.source=hf needs data.path (a saved dataset, parquet/JSONL file, directory or glob) or "
                        "data.mixture=PATH:WEIGHT,PATH:WEIGHT")
    if d.mixture:
        problems += parse_mixture(d.mixture)[1]
    for field, path in text_source_paths(d):
        try:
            source_files(path)
        except ValueError as e:
            shown = f"{field}={d.mixture!r}: {path!r}" if field == "data.mixture" else f"{field}={path!r}"
            problems.append(f"{shown}: {e}; give a saved dataset directory, a .parquet/.jsonl file, a directory of "
                            f"them or a glob")
    if not d.tokenizer:
        problems.append("data.tokenizer is empty: data.source=hf tokenizes text with a Hugging Face tokenizer; set "
                        "it to a tokenizer.json or the model directory holding one")
    elif tokenizer_file(d.tokenizer) is None:
        where = "the directory holds no tokenizer.json" if Path(d.tokenizer).is_dir() else "no such file"
        problems.append(f"data.tokenizer={d.tokenizer!r}: {where}; point it at a tokenizer.json or a directory "
                        f"holding one")
    if not d.text_column:
        problems.append("data.text_column is empty: name the column that holds the documents' text (e.g. text)")
    if not 0 <= d.eos_id < vocab_size:
        problems.append(f"data.eos_id={d.eos_id}: data.source=hf puts an end-of-document id between documents; set "
                        f"it to the tokenizer's end-of-text id (e.g. the id of </s> or <|endoftext|>), in "
                        f"[0, model.vocab_size={vocab_size})")
    return problems
