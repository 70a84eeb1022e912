"""data.source=hf: parquet and JSONL documents tokenized on the fly by a Hugging Face tokenizer and packed
with data.eos_id between them, each document once an epoch; a weighted mixture of sources; a pure function of
(seed, step) whichever process reads which rows, and whether the kept token counts are there or not; the
held-out split; one line per config mistake; a resumed 1,000-step run bitwise equal to an uninterrupted one.

The corpus is the test's own: source A (parquet) speaks words a0..a19, source B (JSONL) words b0..b19, so
every token says which source it came from, and a tokenizer (WordLevel) is trained on that text here.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from helpers import TINY, logged_losses, run_cli
from meshtrain.config import ConfigError, DataConfig, build_config
from meshtrain.data import Batches
from meshtrain.model.loss import IGNORE

pytest.importorskip("datasets")
HOST = SingleDeviceSharding(jax.devices()[0])  # one device holds everything: local rows = the global batch
EOS, SEQ = 1, 16


@dataclass
class Corpus:
    dir: Path
    a: str  # parquet, 120 documents
    b: str  # JSONL, 80 documents
    tokenizer: str
    a_ids: list[tuple[int, ...]]  # each document's token ids, as the tokenizer gives them
    b_ids: list[tuple[int, ...]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    # 3 to 40 words: most documents are shorter than a row, some span two or three rows
    texts = {s: [" ".join(f"{s}{w}" for w in rng.integers(0, 20, size=rng.integers(3, 41))) for _ in range(n)]
             for s, n in (("a", 120), ("b", 80))}
    pq.write_table(pa.table({"text": texts["a"], "n": np.arange(120)}), d / "a.parquet", row_group_size=32)
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts["b"]))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts["a"] + texts["b"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(d / "tokenizer.json"))
    assert tok.token_to_id("</s>") == EOS and tok.get_vocab_size() == 42
    ids = {s: [tuple(tok.encode(t, add_special_tokens=False).ids) for t in texts[s]] for s in texts}
    assert len(set(ids["a"] + ids["b"])) == 200  # distinct documents: a token sequence names its document
    return Corpus(d, str(d / "a.parquet"), str(d / "b.jsonl"), str(d / "tokenizer.json"), ids["a"], ids["b"])


def hf(corpus: Corpus, **fields) -> DataConfig:
    return replace(DataConfig(source="hf", path=corpus.a, tokenizer=corpus.tokenizer, eos_id=EOS, seq_len=SEQ),
                   **fields)


def batches(data: DataConfig, cache: Path, *, global_batch=4, grad_accum=1, seed=0, sharding=HOST,
            split="train") -> Batches:
    return Batches(data, vocab_size=128, global_batch=global_batch, grad_accum=grad_accum, seed=seed,
                   sharding=sharding, split=split, cache_dir=cache)


def rows(b: Batches, step: int) -> np.ndarray:
    """The global batch of `step` as [B, T+1], rows in global order."""
    return b.local_rows(step).reshape(-1, SEQ + 1)


def lane_documents(b: Batches, steps: int) -> list[list[tuple[int, ...]]]:
    """Every lane's stream over `steps` steps (row windows share one token) cut at EOS: its whole documents."""
    per_step = [rows(b, s) for s in range(steps)]
    out = []
    for lane in range(per_step[0].shape[0]):
        stream = np.concatenate([per_step[0][lane]] + [r[lane][1:] for r in per_step[1:]])
        ends = np.flatnonzero(stream == EOS)
        out.append([tuple(doc[:-1]) for doc in np.split(stream[: ends[-1] + 1], ends + 1)[:-1]])
    return out


def dealt_order(lanes: list[list[tuple]], index: dict, n: int) -> list[int]:
    """The documents the lanes read, as the sequence G they were dealt from: G[r + k*B] is lane r's k-th."""
    order = [None] * n
    for r, docs in enumerate(lanes):
        for k, doc in enumerate(docs):
            if r + k * len(lanes) < n:
                order[r + k * len(lanes)] = index[doc]  # a KeyError: not a document as the tokenizer encodes it
    assert None not in order, "walk more steps: some lane did not reach the end of the epoch"
    return order


# ------------------------------------------------------------------------------------ packing


def test_rows_are_documents_tokenized_and_packed_with_eos(corpus, tmp_path):
    """Each lane is whole documents, each as the tokenizer encodes it and followed by EOS; over an epoch every
    document is read once, in a seeded order ("train") or the documents' own ("all")."""
    index = {ids: i for i, ids in enumerate(corpus.a_ids)}
    train = batches(hf(corpus), tmp_path)
    assert rows(train, 0).shape == (4, SEQ + 1)
    order = dealt_order(lane_documents(train, 60), index, 120)
    assert sorted(order) == list(range(120))  # every document once ...
    assert order != list(range(120))  # ... shuffled
    whole = dealt_order(lane_documents(batches(hf(corpus), tmp_path, split="all"), 60), index, 120)
    assert whole == list(range(120))


@pytest.mark.parametrize("form", ["saved", "saved-dict", "jsonl", "glob", "directory"])
def test_every_form_of_a_source_reads_the_same_documents(corpus, tmp_path, form):
    """Source A as a save_to_disk directory (a Dataset, or a DatasetDict's train split), as JSONL, or as two
    parquet halves named by a glob or by their directory: the same documents in the same order, so the same
    batches as the one parquet file."""
    import datasets
    import pyarrow.parquet as pq

    table = pq.read_table(corpus.a)
    src = tmp_path / "src"
    if form.startswith("saved"):
        ds = datasets.Dataset(table)
        (datasets.DatasetDict(train=ds, other=ds.select(range(3))) if form == "saved-dict" else ds).save_to_disk(src)
        path = str(src)
    elif form == "jsonl":
        path = str(tmp_path / "a.jsonl")
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    else:
        src.mkdir()
        pq.write_table(table.slice(0, 50), src / "part-0.parquet")
        pq.write_table(table.slice(50), src / "part-1.parquet")
        path = str(src / "*.parquet") if form == "glob" else str(src)
    want = batches(hf(corpus), tmp_path / "cache")
    got = batches(hf(corpus, path=path), tmp_path / "cache")
    assert got.source.packers[0].n == 120
    for step in (0, 7, 29):
        np.testing.assert_array_equal(got.local_rows(step), want.local_rows(step))


def test_document_mask_restarts_positions_after_each_eos(corpus, tmp_path):
    fields = batches(hf(corpus, document_mask=True), tmp_path).local_fields(3)
    tokens, targets, positions, segments = (fields[k].reshape(-1, SEQ) for k in
                                            ("tokens", "targets", "positions", "segment_ids"))
    after_eos = np.zeros_like(tokens, bool)
    after_eos[:, 1:] = tokens[:, :-1] == EOS
    assert after_eos.sum() >= 2  # documents do end inside these rows
    assert (positions[after_eos] == 0).all() and (positions[:, 0] == 0).all()
    steps = np.diff(positions, axis=1)
    assert ((steps == 1) | after_eos[:, 1:]).all()  # counting up within a document
    np.testing.assert_array_equal(np.diff(segments, axis=1), after_eos[:, 1:].astype(np.int32))
    assert (targets[tokens == EOS] == IGNORE).all()  # EOS cannot predict the next document's first token
    assert (targets[tokens != EOS] != IGNORE).all()


# ------------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("mixture", [False, True], ids=["one-source", "mixture"])
def test_batch_is_a_pure_function_of_seed_and_step(corpus, tmp_path, mixture):
    """A fresh reader that jumps to step 37 (tokenizing the documents before it only to count them), one that
    finds the counts kept by another, and one that walked there all build the same batch."""
    data = hf(corpus, path="", mixture=f"{corpus.a}:0.7,{corpus.b}:0.3") if mixture else hf(corpus)
    walker = batches(data, tmp_path / "walked")
    for s in range(37):
        walker.local_rows(s)
    jumper = batches(data, tmp_path / "jumped")
    np.testing.assert_array_equal(jumper.local_rows(37), walker.local_rows(37))
    counted = tmp_path / "walked" / next(p.name for p in (tmp_path / "walked").glob("counts-*.npy"))
    assert (np.load(counted) >= 0).any()
    np.testing.assert_array_equal(batches(data, tmp_path / "walked").local_rows(37), walker.local_rows(37))
    assert not np.array_equal(walker.local_rows(37), walker.local_rows(38))
    assert not np.array_equal(batches(data, tmp_path / "walked", seed=1).local_rows(37), walker.local_rows(37))
    four = batches(data, tmp_path / "walked", grad_accum=2)  # the same global batch, in two microbatches
    np.testing.assert_array_equal(four.local_rows(37).reshape(4, -1), rows(walker, 37))


def test_a_lane_forgetting_what_it_read_changes_nothing(corpus, tmp_path, monkeypatch):
    """With the lanes keeping the ends of only 2 documents behind and 40 tokens of tokenized documents, the
    batches are those of the default bounds, also when a step behind the forgotten part is asked for again."""
    import meshtrain.documents.lanes as lanes

    data = hf(corpus, path="", mixture=f"{corpus.a}:0.5,{corpus.b}:0.5")
    roomy = batches(data, tmp_path / "a")
    want = [roomy.local_rows(s) for s in range(60)]
    monkeypatch.setattr(lanes, "KEEP_ENDS", 2)
    monkeypatch.setattr(lanes, "CACHE_TOKENS", 40)
    tight = batches(data, tmp_path / "b")
    for s in [*range(60), 0, 1, 59]:
        np.testing.assert_array_equal(tight.local_rows(s), want[s])
    assert any(state.k0 > 0 for p in tight.source.packers for state in p._lanes.values())  # it did forget


class RowsOfOneHost:
    """A sharding stand-in for one process of several: its devices hold the rows in `parts`."""

    def __init__(self, parts: list[tuple[int, int]]):
        self.parts = parts

    def addressable_devices_indices_map(self, shape):
        return {i: (slice(None), slice(lo, hi), slice(None)) for i, (lo, hi) in enumerate(self.parts)}


def test_a_process_reads_and_tokenizes_only_its_rows(corpus, tmp_path):
    data = hf(corpus, path="", mixture=f"{corpus.a}:1,{corpus.b}:1")
    whole = batches(data, tmp_path / "whole", global_batch=8, grad_accum=2)
    host = batches(data, tmp_path / "host", global_batch=8, grad_accum=2, sharding=RowsOfOneHost([(2, 4)]))
    for s in range(12):
        np.testing.assert_array_equal(host.local_rows(s), whole.local_rows(s)[:, 2:4])
    # Lanes are global row ids: microbatch * 4 + row, so this host reads lanes 2, 3, 6 and 7 of each source.
    for packer, memo in zip(host.source.packers, sorted((tmp_path / "host").glob("counts-*.npy"),
                                                        key=lambda p: np.load(p).shape[0], reverse=True)):
        read = set()
        for lane, state in packer._lanes.items():
            assert lane in (2, 3, 6, 7)
            read |= set(packer.doc_ids(lane, np.arange(state.k0 + len(state.ends))).tolist())
        assert set(np.flatnonzero(np.load(memo) >= 0).tolist()) == read  # nothing of the other lanes tokenized
        assert len(read) < packer.n


# ------------------------------------------------------------------------------------ mixture, eval split


def test_mixture_fills_rows_by_weight(corpus, tmp_path):
    b = batches(hf(corpus, path="", mixture=f"{corpus.a}:0.7,{corpus.b}:0.3"), tmp_path)
    a_words = {i for doc in corpus.a_ids for i in doc}
    assert not a_words & {i for doc in corpus.b_ids for i in doc}  # a token names its source
    kinds = []
    for s in range(200):
        for row in rows(b, s):
            words = set(row.tolist()) - {EOS}
            assert words <= a_words or not words & a_words, "a row reads one source"
            kinds.append(words <= a_words)
    assert 0.65 < np.mean(kinds) < 0.75  # 800 rows: 0.7 within 3.5 standard deviations


def test_eval_split_holds_out_the_end_of_each_source(corpus, tmp_path):
    index = {ids: i for i, ids in enumerate(corpus.a_ids)}
    data = hf(corpus, eval_fraction=0.25)  # documents 90..119 held out
    train = dealt_order(lane_documents(batches(data, tmp_path), 60), index, 90)
    assert sorted(train) == list(range(90))
    held = batches(data, tmp_path, split="eval")
    assert dealt_order(lane_documents(held, 20), index, 30) == list(range(90, 120))  # in order
    np.testing.assert_array_equal(batches(data, tmp_path, split="eval").local_rows(0), held.local_rows(0))
    other = batches(hf(corpus, eval_path=corpus.b), tmp_path, split="eval")
    b_words = {i for doc in corpus.b_ids for i in doc}
    assert set(rows(other, 0).ravel().tolist()) - {EOS} <= b_words


# ------------------------------------------------------------------------------------ mistakes


def launch_problems(*overrides: str) -> list[str]:
    from meshtrain.launch import validated_mesh

    with pytest.raises(ConfigError) as e:
        validated_mesh(build_config({}, TINY + list(overrides)), data=True)
    return e.value.problems


@pytest.mark.parametrize("change,message", [
    (["data.path=/nowhere/x.parquet"], "data.path='/nowhere/x.parquet': no such file or directory; give a saved"),
    (["data.path=/nowhere/*.parquet"], "data.path='/nowhere/*.parquet': the pattern matches no file"),
    (["data.text_column=body"], "no column 'body' (columns: text, n); set data.text_column"),
    (["data.tokenizer={dir}/bad.json"], "data.tokenizer='{dir}/bad.json': not a readable tokenizers JSON file"),
    (["data.tokenizer={dir}/empty"], "data.tokenizer='{dir}/empty': the directory holds no tokenizer.json; point"),
    (["data.path=", "data.mixture={a}:0.7,{b}:-1"], "'{b}:-1' is not PATH:WEIGHT with a weight > 0; write e.g."),
    (["data.path=", "data.mixture={a}:0.7,{b}"], "'{b}' is not PATH:WEIGHT with a weight > 0"),
    (["data.mixture={b}:1"], "data.source=hf reads one of them; clear data.path"),
    (["data.eos_id=-1"], "data.eos_id=-1: data.source=hf puts an end-of-document id between documents; set it"),
    (["model.vocab_size=40"], "holds 42 ids but model.vocab_size=40; set model.vocab_size to at least 42"),
], ids=["missing-path", "empty-glob", "missing-column", "unreadable-tokenizer", "no-tokenizer-in-dir",
        "bad-weight", "no-weight", "path-and-mixture", "no-eos", "vocab-too-small"])
def test_each_mistake_is_one_line_naming_field_value_and_fix(corpus, change, message):
    (corpus.dir / "bad.json").write_text("{ not json")
    (corpus.dir / "empty").mkdir(exist_ok=True)
    fill = lambda s: s.format(dir=corpus.dir, a=corpus.a, b=corpus.b)  # noqa: E731
    base = ["data.source=hf", f"data.path={corpus.a}", f"data.tokenizer={corpus.tokenizer}", f"data.eos_id={EOS}",
            f"run.dir={corpus.dir / 'run'}"]
    problems = launch_problems(*base, *map(fill, change))
    assert len(problems) == 1 and fill(message) in problems[0], problems


def test_a_mistake_on_the_command_line_exits_2_without_a_traceback(corpus, tmp_path):
    proc = run_cli("data.source=hf", f"data.path={corpus.b}", f"data.tokenizer={corpus.tokenizer}",
                   f"data.eos_id={EOS}", "data.text_column=body", f"run.dir={tmp_path}", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("config error:")]
    want = f"data.path={corpus.b!r}: no column 'body' (columns: text); set data.text_column to the one holding the text"
    assert lines == [f"config error: {want}"]
    assert "Traceback" not in proc.stderr


def test_resume_refuses_another_tokenizer_column_or_mixture(corpus, tmp_path):
    from meshtrain.resume import check_compatible

    cfg = build_config({}, TINY + ["data.source=hf", f"data.path={corpus.a}", f"data.tokenizer={corpus.tokenizer}",
                                   f"data.eos_id={EOS}"])
    for key, was in (("tokenizer", "other/tokenizer.json"), ("text_column", "body"), ("mixture", "x:1"),
                     ("eos_id", 0)):
        saved = cfg.to_dict()
        saved["data"][key] = was
        with pytest.raises(ConfigError, match=rf"data\.{key}=.* was trained with {was!r}.*allow_data_change=true"):
            check_compatible(cfg, saved, tmp_path, 3)
        allowed = replace(cfg, checkpoint=replace(cfg.checkpoint, allow_data_change=True))
        check_compatible(allowed, saved, tmp_path, 3)
    file_cfg = build_config({}, TINY + ["data.source=file", "data.path=t.bin", "data.tokenizer=a.json"])
    saved = file_cfg.to_dict()
    saved["data"]["tokenizer"] = "b.json"  # a token file reads no tokenizer: nothing changed
    check_compatible(file_cfg, saved, tmp_path, 3)


# ------------------------------------------------------------------------------------ a run, stopped and resumed


@pytest.mark.slow
def test_mixture_run_of_1000_steps_resumed_midway_is_bitwise_equal(corpus, tmp_path):
    """One device, 4 rows of 16 tokens a step, a parquet and a JSONL source mixed 0.6/0.4. The run stopped at
    step 500 resumes without its kept token counts (data_cache removed), so the resumed batches are found by
    counting again: the losses from step 501 on equal the uninterrupted run's bit for bit."""
    common = ["run.cpu_devices=1", "mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1",
              "train.global_batch=4", "train.steps=1000", "train.schedule_steps=1000",
              "train.log_every=25", "checkpoint.every=0", "data.source=hf", f"data.tokenizer={corpus.tokenizer}",
              f"data.mixture={corpus.a}:0.6,{corpus.b}:0.4", f"data.eos_id={EOS}", "data.document_mask=true"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    run_cli(*common, f"run.dir={full}", timeout=600)
    run_cli(*common, "train.steps=500", f"run.dir={stopped}", timeout=600)
    assert (stopped / "checkpoints" / "500").is_dir()
    shutil.rmtree(stopped / "data_cache")
    out = run_cli(*common, f"run.dir={stopped}", timeout=600).stdout
    assert "resumed from step 500" in out
    want, got = logged_losses(full), logged_losses(stopped)
    assert sorted(want) == list(range(25, 1001, 25)) and sorted(got) == sorted(want)
    assert got == want
    # It learned the words' frequencies (random words: the floor is near ln 21, from ln 128 = 4.85 untrained),
    # and the losses move: the comparison is not one of constants.
    assert want[1000] < np.log(128) - 1.5 and len(set(want.values())) > 30

