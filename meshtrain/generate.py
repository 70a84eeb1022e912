"""`python -m meshtrain.generate --checkpoint DIR|hf:DIR --prompt TEXT [options] [section.key=value ...]`

Continues each prompt with a KV cache on the mesh (meshtrain/generation.py). Text goes through a
Hugging Face `tokenizer.json` (--tokenizer, else the one in the model's Hugging Face directory), or
through bytes when there is none and the vocabulary holds 256 ids (scripts/prepare_data.py's bytes).
A sample ends at the model's end-of-sequence token when it has one.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from meshtrain import launch
from meshtrain.config import ConfigError


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    def __init__(self, path: Path):
        from meshtrain.config.run_checks import missing_package
        missing = missing_package("tokenizers", "data", f"the tokenizer {path}")
        if missing:
            raise ConfigError(missing)
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def pick_tokenizer(explicit: str | None, hf_source: Path | None, vocab_size: int):
    if explicit:
        if not Path(explicit).is_file():
            raise ConfigError(f"--tokenizer {explicit!r}: no such file (a Hugging Face tokenizer.json)")
        return FileTokenizer(Path(explicit))
    if hf_source is not None and (hf_source / "tokenizer.json").is_file():
        return FileTokenizer(hf_source / "tokenizer.json")
    if vocab_size >= 256:
        return ByteTokenizer()
    raise ConfigError(f"model.vocab_size={vocab_size} is not a byte vocabulary and the model names no tokenizer: "
                      f"pass --tokenizer tokenizer.json")


def eos_ids(hf_source: Path | None, data_eos: int) -> set[int]:
    ids = {data_eos} if data_eos >= 0 else set()
    if hf_source is not None and (hf_source / "config.json").is_file():
        eos = json.loads((hf_source / "config.json").read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


LONG = 256  # new tokens past which the decode reports its progress (a line per compiled chunk, generation.CHUNK)


def length_notes(prompt_len: int, max_new_tokens: int, trained_len: int, n_prompts: int) -> list[str]:
    """What to say before decoding: past the length the model was trained on (data.seq_len) its output
    degrades, and a long decode says how far it got as it goes."""
    notes = []
    total = prompt_len + max_new_tokens
    if total > trained_len:
        notes.append(f"warning: prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} = {total} tokens, "
                     f"past the {trained_len} the model was trained on (data.seq_len); expect worse text past it")
    if max_new_tokens > LONG:
        notes.append(f"sampling {max_new_tokens} tokens for {n_prompts} prompt(s), with a progress line as it goes "
                     f"(Ctrl-C stops it)")
    return notes


class Progress:
    """`generate: 384/2000 tokens, 41.2 tokens/s per prompt` on stderr after each compiled chunk."""

    def __init__(self, total: int):
        self.total, self.started = total, time.monotonic()

    def __call__(self, done: int) -> None:
        rate = done / max(time.monotonic() - self.started, 1e-9)
        print(f"generate: {done}/{self.total} tokens, {rate:.1f} tokens/s per prompt", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = launch.checkpoint_parser("generate", "Sample continuations of prompts with a KV cache.")
    p.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for several)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: the model's, else bytes)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    args = launch.with_overrides(p).parse_intermixed_args(argv)

    def body() -> int:
        launch.prepare_devices(args.overrides)  # before jax: the rest of the start-up is inference.load's
        from meshtrain.generation import generate
        from meshtrain.inference import load

        problems = [f"--{k.replace('_', '-')}={getattr(args, k)}: {msg}" for k, ok, msg in (
            ("max_new_tokens", args.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", args.temperature >= 0, "must be >= 0 (0: greedy)"),
            ("top_k", args.top_k >= 0, "must be >= 0"), ("num_samples", args.num_samples >= 1, "must be >= 1"))
            if not ok]
        if problems:
            raise ConfigError(problems)
        loaded = load(args.checkpoint, args.overrides, step=args.step)
        vocab = loaded.cfg.model.vocab_size
        tok = pick_tokenizer(args.tokenizer, loaded.hf_source, vocab)
        prompts = [tok.encode(text) for text in args.prompt for _ in range(args.num_samples)]
        too_big = sorted({i for ids in prompts for i in ids if i >= vocab})
        if too_big:
            raise ConfigError(f"--prompt: token ids {too_big[:5]} are outside model.vocab_size={vocab}; pass the "
                              f"model's --tokenizer")
        for line in length_notes(max(map(len, prompts)), args.max_new_tokens, loaded.cfg.data.seq_len, len(prompts)):
            print(f"generate: {line}", file=sys.stderr, flush=True)
        progress = Progress(args.max_new_tokens) if args.max_new_tokens > LONG else None
        new = generate(loaded.setup, loaded.params, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, seed=args.seed, progress=progress)
        stop = eos_ids(loaded.hf_source, loaded.cfg.data.eos_id)
        for i, (text, ids) in enumerate(zip([t for t in args.prompt for _ in range(args.num_samples)], new)):
            ids = next((ids[:j] for j, t in enumerate(ids) if t in stop), ids)
            if len(new) > 1:
                print(f"--- sample {i + 1}")
            print(text + tok.decode(ids), flush=True)
        return 0

    return launch.guarded(body)


if __name__ == "__main__":
    launch.program(main)
