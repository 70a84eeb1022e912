"""Batches built ahead on a thread are the batches built in the loop, in the same order; the thread
ends when the loop ends, stops early, or fails on either side, and a build error reaches the loop."""
from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import pytest

from helpers import make_setup, tiny_config
from meshtrain import trainer
from meshtrain.config import ConfigError, DataConfig
from meshtrain.data import Batches
from meshtrain.prefetch import Prefetcher, batch_feed

HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def token_file(tmp_path, n=2001, top=None):
    tokens = np.arange(n) % 97
    if top is not None:
        tokens[-5:] = top  # past the head that the start-up check samples: found when read
    path = tmp_path / "t.bin"
    tokens.astype(np.uint16).tofile(path)
    return str(path)


def assert_finishes(feed) -> None:
    began = time.perf_counter()
    feed.close()
    assert time.perf_counter() - began < 5 and not feed._thread.is_alive()


@pytest.mark.parametrize("source", ["synthetic", "file"])
def test_prefetched_batches_are_the_loop_batches_in_order(tmp_path, source):
    data = DataConfig(source=source, path=token_file(tmp_path), seq_len=16)
    b = Batches(data, vocab_size=97, global_batch=8, grad_accum=2, seed=3, sharding=HOST)
    feed = Prefetcher(b.batch, range(5, 40), depth=2)
    for step in range(5, 40):
        got, want = feed.get(step), b.batch(step)
        for name in ("tokens", "targets", "positions", "segment_ids"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))
    assert_finishes(feed)


def test_it_runs_ahead_by_its_depth_only():
    made = []

    def make(step):
        made.append(step)
        return step

    feed = Prefetcher(make, range(100), depth=2)
    deadline = time.perf_counter() + 10
    while len(made) < 3 and time.perf_counter() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # room for a (wrong) fourth build
    assert made == [0, 1, 2]  # two waiting, the third built and waiting for room
    assert [feed.get(s) for s in range(3)] == [0, 1, 2]
    assert_finishes(feed)


def test_stopping_early_with_a_full_queue_does_not_hang():
    feed = Prefetcher(lambda s: s, range(10**9), depth=2)
    assert feed.get(0) == 0
    time.sleep(0.2)  # the thread is now blocked on a full queue
    assert_finishes(feed)


def test_a_build_error_is_raised_at_its_step_in_the_loop():
    def make(step):
        if step == 3:
            raise ConfigError("data.path='x': token ids in [0, 200] at step 3 fall outside model.vocab_size=97")
        return step

    feed = Prefetcher(make, range(10), depth=2)
    assert [feed.get(s) for s in range(3)] == [0, 1, 2]
    with pytest.raises(ConfigError, match="at step 3"):
        feed.get(3)
    assert_finishes(feed)


def test_asking_out_of_order_is_an_error_not_a_wrong_batch():
    feed = Prefetcher(lambda s: s, range(10), depth=2)
    with pytest.raises(RuntimeError, match="handed out step 0 when step 1"):
        feed.get(1)
    assert_finishes(feed)


def test_depth_zero_builds_in_the_loop():
    feed = batch_feed(lambda s: s * 10, range(5), depth=0)
    assert [feed.get(s) for s in (0, 1)] == [0, 10]
    feed.close()


def test_trainer_builds_on_the_thread_and_stops_with_a_build_error(tmp_path, monkeypatch):
    """In the loop (data.prefetch=2, the default) every batch is built on the feed thread; an error
    building a later batch stops the run with that error, and the thread with it."""
    cfg = tiny_config("data.source=file", f"data.path={token_file(tmp_path)}", "model.vocab_size=128",
                      "train.steps=5", "train.log_every=1", f"run.dir={tmp_path}")
    setup = make_setup(cfg, 1)
    built, where = Batches.batch, []

    def failing(self, step):
        where.append((step, threading.current_thread().name))
        if step == 3:
            raise ConfigError(f"data.path={cfg.data.path!r}: token ids in [0, 200] at step 3 fall outside "
                              f"model.vocab_size=128")
        return built(self, step)

    monkeypatch.setattr(Batches, "batch", failing)
    with pytest.raises(ConfigError, match="at step 3"):
        trainer.train(setup.cfg, setup.mesh)
    assert where == [(s, "meshtrain-prefetch") for s in range(4)]
    assert not [t for t in threading.enumerate() if t.name == "meshtrain-prefetch" and t.is_alive()]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
