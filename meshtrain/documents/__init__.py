"""Text documents as packed token rows (data.source=hf): read with `datasets`, tokenized on the fly by a Hugging
Face tokenizer on the batch-building thread, packed with data.eos_id between documents.

How a row is found without tokenizing the corpus first. The B rows of a global batch are B *lanes*. Every
epoch the documents of a source are put in a seeded order, and the epochs' orders laid end to end are dealt to
the lanes in turn: lane r reads documents r, r+B, r+2B, ... of that endless sequence, so every document is read
once an epoch. A lane is its documents' tokens back to back, each followed by data.eos_id; its t-th row is the
window [t*T, t*T + T + 1) of that stream (windows share one token, as the token file's do: every token is a
target once). Row r of step s is row s of lane r: a pure function of (seed, step), and only the lanes of a
process's own rows are ever read or tokenized there.

Where a window starts depends on the token counts of the lane's earlier documents, so the counts are kept: in
memory for the lane's recent documents, and on disk for every document tokenized so far (counts.py, 4 bytes a
document, under data.cache_dir). The cost, stated: a lane walks forward, tokenizing each document once when its
rows need it; a run resumed at step s reads its lanes' counts from that file, or, where it is missing (a new
cache_dir), tokenizes the documents before step s again to count them (as long as reading them took, no more).
The seeded order of an epoch is a permutation of the source's documents held in memory (8 bytes a document).

A mixture (data.mixture) gives each row one source, drawn by weight from a seeded stream per lane: row r of
step s is then the next row of lane r of that source, its index the number of earlier steps whose row r drew
the same source (counted in blocks of steps, cheaply). Weights are shares of rows, so of tokens.

  reading.py   a source opened with `datasets`, the tokenizer, the identity of both (for the count file)
  counts.py    the per-document token counts kept on disk
  lanes.py     one source's rows, lane by lane
  mixture.py   TextSource: the sources, their weights, the held-out split; what data.Batches reads
  checks.py    the start-up check that every source and the tokenizer can be read
"""
from meshtrain.documents.checks import check_text_sources
from meshtrain.documents.mixture import TextSource

__all__ = ["TextSource", "check_text_sources"]
