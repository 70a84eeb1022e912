"""Make the small text sources under tests/fixtures/text/ that the README's data.source=hf commands train on.

    python scripts/make_text_fixtures.py [--out tests/fixtures/text]

  stories.parquet  400 short stories, column "text" (and "id")
  notes.jsonl      200 notes, one JSON object a line with key "text"

Their characters are those of the character-level tokenizer of tests/fixtures/hf/llama31_tied (letters, space,
.,!?' and newline; </s> is id 1), so `data.tokenizer=tests/fixtures/hf/llama31_tied` reads them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SUBJECTS = ("the mesh", "a small model", "every device", "the pipeline", "an expert", "the ring", "a tired GPU")
VERBS = ("shards", "gathers", "scatters", "reduces", "learns", "waits for", "sends")
OBJECTS = ("the batch", "its gradients", "a long sequence", "the optimizer state", "the tokens", "the heads")


def sentence(rng: np.random.Generator) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    return s[0].upper() + s[1:] + str(rng.choice([".", "!", "?"]))


def document(rng: np.random.Generator, sentences: tuple[int, int]) -> str:
    return " ".join(sentence(rng) for _ in range(rng.integers(*sentences)))


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/text")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    stories = [document(rng, (2, 9)) for _ in range(400)]
    pq.write_table(pa.table({"text": stories, "id": np.arange(len(stories))}), out / "stories.parquet")
    notes = [document(rng, (1, 4)) for _ in range(200)]
    (out / "notes.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in notes))
    print(f"wrote {out}/stories.parquet ({len(stories)} documents) and {out}/notes.jsonl ({len(notes)})")


if __name__ == "__main__":
    main()
