"""The start-up check of data.source=hf (beside data.check_token_files): every source opens and holds the text
column, and the tokenizer reads and fits model.vocab_size, all reported at once before any device work."""
from __future__ import annotations

from pathlib import Path

from meshtrain.config import ConfigError, DataConfig
from meshtrain.config.text_sources import source_files, text_source_paths, tokenizer_file
from meshtrain.documents.reading import Documents, load_tokenizer


def check_text_sources(data: DataConfig, vocab_size: int, cache_dir: Path) -> list[str]:
    if data.source != "hf":
        return []
    problems = []
    for field, path in text_source_paths(data):
        try:
            source_files(path)
        except ValueError:
            continue  # validate() reports a missing source
        try:
            Documents(path, data.text_column, cache_dir, field)
        except ConfigError as e:
            problems += e.problems
    if data.tokenizer and tokenizer_file(data.tokenizer) is not None:  # else validate() says what is missing
        try:
            tok = load_tokenizer(data.tokenizer)
            size = tok.get_vocab_size(with_added_tokens=True)
            if size > vocab_size:
                problems.append(f"data.tokenizer={data.tokenizer!r}: its vocabulary holds {size} ids but "
                                f"model.vocab_size={vocab_size}; set model.vocab_size to at least {size}")
        except ConfigError as e:
            problems += e.problems
    return problems
