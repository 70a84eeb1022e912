"""What a checkpoint guarantees, under the faults that break it (issue #31).

In-process where the library alone decides (restore with fallback, digests, the lock, the resume checks,
config values, token files): one compiled set-up serves every damage case. The faults that need a whole
run (a non-finite streak, a full disk, two runs on one directory, a damaged step resumed end to end)
run the command line and carry the `slow` marker.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import serialization

from helpers import CLI_TINY, cli_env, make_setup, tiny_config
from meshtrain.checkpoint import Checkpointer, CheckpointError, digests
from meshtrain.config import ConfigError, build_config, validate
from meshtrain.data import check_token_files
from meshtrain.lock import RunLock
from meshtrain.resume import check_compatible, restore_or_init
from meshtrain.step.state import abstract_params, init_state

MESH = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"]


def leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at steps 2 and 4 (synchronous saves) of two different states, with the states saved.
    No train step is compiled: restore and verification do not care how the values came about."""
    setup = make_setup(tiny_config(*MESH), 8)
    first = init_state(setup)
    states = {2: first.replace(step=first.step + 2),
              4: first.replace(step=first.step + 4, params=jax.tree.map(lambda p: p * 1.5 + 0.25, first.params))}
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    ckpt = Checkpointer(str(directory), keep=3, async_save=False)
    for step, state in states.items():
        ckpt.save(step, state, setup.cfg.to_dict())
    ckpt.wait()
    ckpt.close()
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2", "4"]
    return setup, directory, {k: jax.device_get(v) for k, v in states.items()}


def data_files(step_dir: Path) -> list[Path]:
    """The array data files of a step, largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    assert files, f"no array data files under {step_dir}/state"
    return sorted(files, key=lambda p: -p.stat().st_size)


def truncate(step: Path) -> None:
    f = data_files(step)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def overwrite(step: Path) -> None:
    f = data_files(step)[0]
    f.write_bytes(bytes(f.stat().st_size))


def flip_byte(step: Path) -> None:
    f = data_files(step)[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def delete_manifests(step: Path) -> None:
    found = list(step.rglob("manifest.ocdbt"))
    assert found
    for m in found:
        m.unlink()


def newer_empty(step: Path) -> None:
    (step.parent / "6").mkdir()


def newer_partial_copy(step: Path) -> None:
    shutil.copytree(step, step.parent / "6")
    for f in data_files(step.parent / "6"):
        f.unlink()


DAMAGE = {
    "truncated_data": truncate,
    "overwritten_data": overwrite,
    "flipped_byte": flip_byte,
    "deleted_manifests": delete_manifests,
    "state_missing": lambda s: shutil.rmtree(s / "state"),
    "config_missing": lambda s: shutil.rmtree(s / "config"),
    "metadata_missing": lambda s: (s / "_CHECKPOINT_METADATA").unlink(),
    "step_dir_emptied": lambda s: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in s.iterdir()],
    "newer_empty_step": newer_empty,
    "newer_partial_copy": newer_partial_copy,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_step_falls_back_to_verified_one(saved, damage, tmp_path, capsys):
    setup, directory, states = saved
    ckpt_dir = tmp_path / "checkpoints"
    shutil.copytree(directory, ckpt_dir)
    DAMAGE[damage](ckpt_dir / "4")
    ckpt = Checkpointer(str(ckpt_dir), keep=3, async_save=False)
    state, step = restore_or_init(setup, ckpt)
    ckpt.close()
    out = capsys.readouterr().out
    good, bad = (4, 6) if damage.startswith("newer") else (2, 4)
    assert step == good, out
    assert leaves_equal(jax.device_get(state), states[good]), "the fallback step must restore bit for bit"
    assert f"checkpoint step {bad} in {ckpt_dir} cannot be used" in out and f"falling back to step {good}" in out
    assert "Traceback" not in out
    assert all(len(line) < 600 for line in out.splitlines())
    # The damaged step is kept, out of the way of later saves and rotation.
    assert (ckpt_dir / f"{bad}.damaged").is_dir()
    assert sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == sorted({2, 4} - {bad})


def test_intact_checkpoint_restores_newest_without_a_word(saved, tmp_path, capsys):
    setup, directory, states = saved
    ckpt = Checkpointer(str(directory), keep=3, async_save=False)
    state, step = restore_or_init(setup, ckpt)
    ckpt.close()
    assert step == 4 and leaves_equal(jax.device_get(state), states[4])
    assert "cannot be used" not in capsys.readouterr().out


def test_no_verified_step_is_one_line_naming_the_directory(saved, tmp_path):
    setup, directory, _ = saved
    ckpt_dir = tmp_path / "checkpoints"
    shutil.copytree(directory, ckpt_dir)
    flip_byte(ckpt_dir / "4")
    truncate(ckpt_dir / "2")
    ckpt = Checkpointer(str(ckpt_dir), keep=3, async_save=False)
    with pytest.raises(CheckpointError) as e:
        restore_or_init(setup, ckpt)
    ckpt.close()
    assert str(ckpt_dir) in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.isdigit()) == ["2", "4"], "nothing renamed"


def test_readers_verify_the_params_and_fall_back_only_when_the_newest_was_asked_for(saved, tmp_path, capsys):
    """evaluate, generate and export read only the parameters: those are verified too. Asked for the newest
    step, a damaged one is passed over (and left where it is); asked for that step, it is an error."""
    setup, directory, states = saved
    ckpt_dir = tmp_path / "checkpoints"
    shutil.copytree(directory, ckpt_dir)
    for f in data_files(ckpt_dir / "4"):  # every array of step 4, parameters included
        f.write_bytes(bytes(f.stat().st_size))
    ckpt = Checkpointer(str(ckpt_dir), keep=3, async_save=False)
    params, step = ckpt.restore_params_verified(4, abstract_params(setup), fall_back=True)
    assert step == 2 and leaves_equal(jax.device_get(params), states[2].params)
    out = capsys.readouterr().out
    assert f"checkpoint step 4 in {ckpt_dir} cannot be used" in out and "falling back to step 2" in out
    with pytest.raises(CheckpointError, match=r"step 4 in .* does not read back intact.*--step"):
        Checkpointer(str(ckpt_dir), keep=3, async_save=False).restore_params_verified(
            4, abstract_params(setup), fall_back=False)
    ckpt.close()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["2", "4"], "a reader renames nothing"
    intact = Checkpointer(str(directory), keep=3, async_save=False)
    params, step = intact.restore_params_verified(4, abstract_params(setup), fall_back=True)
    assert step == 4 and leaves_equal(jax.device_get(params), states[4].params)


def test_readers_close_the_checkpoint_on_an_error(saved, monkeypatch):
    """A reader that stops on a config error closes what it opened (Orbax's threads left open print a
    traceback at interpreter exit, after the one clean line)."""
    from meshtrain import inference
    _, directory, _ = saved
    closed = []
    monkeypatch.setattr(Checkpointer, "close", lambda self: closed.append(self.directory))
    for bad in (["train.stpes=3"], ["--step"]):
        closed.clear()
        with pytest.raises(ConfigError):
            if bad == ["--step"]:
                inference.load(str(directory), [], step=3)  # no such step
            else:
                inference.load(str(directory), bad)
        assert closed == [directory], bad


def test_a_synchronous_save_that_hangs_stops_at_the_timeout(saved, tmp_path, monkeypatch):
    """A synchronous write on a hung file system fails after checkpoint.timeout_s with the one-line error
    (Orbax times only its async writes); the committed steps stay as they were."""
    setup, directory, states = saved
    shutil.copytree(directory, tmp_path / "checkpoints")
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=3, async_save=False, timeout_s=1)
    monkeypatch.setattr(ckpt.manager, "save", lambda *a, **k: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        ckpt.save(6, jax.device_put(states[4]), setup.cfg.to_dict())
    assert time.monotonic() - started < 10
    assert "saving step 6" in str(e.value) and "checkpoint.timeout_s=1" in str(e.value)
    assert "committed steps [2, 4] are intact" in str(e.value)
    monkeypatch.undo()
    ckpt.close()


def test_abandoned_reads_of_a_damaged_step_print_nothing_and_other_errors_still_do():
    """After a failed read, Orbax's abandoned sibling reads raise again when collected (their reader turns
    GeneratorExit into an Exception): that must not print a traceback after the one fallback line, while
    any other unraisable exception still does."""
    script = """if True:
        import types
        from meshtrain.checkpoint import _quiet_abandoned_reads

        @types.coroutine
        def pending():
            yield

        async def reader(message):  # like Orbax's: catches BaseException and re-raises
            try:
                await pending()
            except BaseException as e:
                raise Exception(message) from e

        class Broken:
            def __del__(self):
                raise ValueError("a real error")

        _quiet_abandoned_reads()
        _quiet_abandoned_reads()  # idempotent: one filter, not a chain
        read = reader("abandoned read")
        read.send(None)
        del read
        Broken()
    """
    proc = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "abandoned read" not in proc.stderr and "ValueError: a real error" in proc.stderr


def test_digest_sees_one_flipped_bit_and_not_the_sharding(saved):
    setup, _, states = saved
    tree = serialization.to_state_dict(states[4])
    base = digests(tree)
    w = np.array(tree["params"]["embed"]["embedding"] if "embed" in tree["params"] else jax.tree.leaves(tree)[0])
    bits = w.view(np.uint32).copy()
    bits.flat[bits.size // 3] ^= 1 << 7
    flipped = digests({"x": bits.view(w.dtype)})["x"]
    assert flipped != digests({"x": w})["x"]
    resharded = jax.device_put(w, jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    assert digests({"x": resharded})["x"] == digests({"x": w})["x"]
    assert base == digests(tree)


# ----------------------------------------------------------------------------- resume: the data

def test_resume_refuses_other_data_unless_allowed(tmp_path):
    cfg = tiny_config(*MESH)
    saved = cfg.to_dict()
    for override, field in (("train.seed=1", "train.seed"), ("train.global_batch=32", "train.global_batch"),
                            ("data.seq_len=32", "data.seq_len")):
        with pytest.raises(ConfigError) as e:
            check_compatible(tiny_config(*MESH, override), saved, tmp_path, 4)
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(field), e.value.problems
        assert "checkpoint.allow_data_change=true" in e.value.problems[0]
        check_compatible(tiny_config(*MESH, override, "checkpoint.allow_data_change=true"), saved, tmp_path, 4)
    saved_file = dict(saved, data=dict(saved["data"], source="file", path="a.bin"))
    with pytest.raises(ConfigError, match="data.source='synthetic' but"):
        check_compatible(cfg, saved_file, tmp_path, 4)
    check_compatible(cfg, saved, tmp_path, 4)  # the same settings pass


# ----------------------------------------------------------------------------- the lock

def test_second_holder_of_a_run_dir_is_refused_and_a_dead_ones_lock_is_free(tmp_path):
    (tmp_path / ".meshtrain.lock").write_text("pid 999999 on gone\n")  # left by a killed run: no flock held
    with RunLock([("run.dir", str(tmp_path)), ("checkpoint.dir", str(tmp_path / "checkpoints"))]):
        assert f"pid {os.getpid()}" in (tmp_path / ".meshtrain.lock").read_text()
        with pytest.raises(ConfigError) as e:
            with RunLock([("run.dir", str(tmp_path))]):
                pass
        assert e.value.problems[0].startswith(f"run.dir={str(tmp_path)!r} is in use by another meshtrain run (pid ")
    with RunLock([("run.dir", str(tmp_path))]):  # released on exit
        pass


# ----------------------------------------------------------------------------- config values

@pytest.mark.parametrize("override, expected", [
    ("train.lr=inf", "train.lr=inf: must be a finite number"),
    ("train.weight_decay=nan", "train.weight_decay=nan: must be a finite number"),
    ("train.b1=nan", "train.b1=nan: must be a finite number"),
    ("model.init_std=nan", "model.init_std=nan: must be a finite number"),
    ("model.norm_eps=nan", "model.norm_eps=nan: must be a finite number"),
    ("train.b2=2.0", "train.b2=2.0: must be in [0, 1)"),
    ("model.rope_theta=-1", "model.rope_theta=-1.0: must be > 0"),
])
def test_bad_config_values_are_refused(override, expected):
    with pytest.raises(ConfigError) as e:
        validate(tiny_config(*MESH, override), 8)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(expected), e.value.problems


def test_too_many_cpu_devices_refused_before_jax_starts():
    with pytest.raises(ConfigError, match=r"run.cpu_devices=100000: must be <= 512"):
        build_config({}, ["run.cpu_devices=100000"])


# ----------------------------------------------------------------------------- token files

def token_problem(tmp_path, name: str, array: np.ndarray | bytes, *overrides: str) -> list[str]:
    path = tmp_path / name
    if isinstance(array, bytes):
        path.write_bytes(array)
    elif name.endswith(".npy"):
        np.save(path, array)
    else:
        array.tofile(path)
    cfg = tiny_config("data.source=file", f"data.path={path}", *overrides)
    return check_token_files(cfg.data, cfg.model.vocab_size)


def test_token_files_refused_in_one_line(tmp_path):
    ids = np.arange(4096) % 100
    assert token_problem(tmp_path, "ok.npy", ids.astype(np.uint16)) == []
    assert token_problem(tmp_path, "ok.bin", ids.astype(np.uint16)) == []
    cases = {
        "neg.npy": (ids.astype(np.int32) - 1, "token id -1 is negative"),
        "float.npy": (ids.astype(np.float32), "a .npy of float32 values"),
        "twod.npy": (ids.astype(np.uint16).reshape(64, 64), "a .npy of shape (64, 64)"),
        "wide.bin": (ids.astype(np.uint32), "looks like a uint32 token file read as data.dtype=uint16"),
        "odd.bin": (b"\x01\x00\x02", "3 bytes is not a whole number of data.dtype=uint16 tokens"),
    }
    for name, (array, expected) in cases.items():
        problems = token_problem(tmp_path, name, array)
        assert len(problems) == 1 and expected in problems[0], (name, problems)
        assert problems[0].startswith("data.path=")
    assert token_problem(tmp_path, "wide32.bin", ids.astype(np.uint32), "data.dtype=uint32") == []


# ----------------------------------------------------------------------------- whole runs (slow)

def fault_env() -> dict[str, str]:
    """A fresh CPU process that shares compiled programs with the other runs of this module."""
    cache = Path(os.environ.get("PYTEST_CKPT_FAULT_CACHE", "/tmp/meshtrain-test-compile-cache"))
    return cli_env(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def run_fault(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain.run", *CLI_TINY, *MESH, *overrides], env=fault_env(),
                          capture_output=True, text=True, timeout=timeout)


def committed(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


def assert_one_line_error(proc: subprocess.CompletedProcess, prefix: str) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_nonfinite_streak_never_rotates_out_the_last_finite_step(tmp_path):
    """lr=1e6 without clipping: step 2 blows the weights up, steps 3.. are non-finite. Saving every step with
    keep=2 used to leave only streak steps; now the last finite step stays the newest checkpoint."""
    proc = run_fault("train.lr=1e6", "train.grad_clip=0", "train.warmup_steps=0", "train.steps=8",
                     "train.max_nonfinite=3", "checkpoint.every=1", "checkpoint.keep=2", f"run.dir={tmp_path}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert_one_line_error(proc, "error: step 5: 3 consecutive steps had a non-finite")
    assert committed(tmp_path / "checkpoints") == [1, 2]
    assert "step 3 not saved" in proc.stdout


def can_mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True).returncode == 0
    return ok


@pytest.mark.slow
def test_full_disk_stops_the_run_at_once_with_earlier_steps_intact(saved, tmp_path):
    """checkpoint.dir on a 2 MiB tmpfs: step 1 (about 1.1 MB) fits, step 2 does not."""
    disk = tmp_path / "disk"
    if not can_mount_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        proc = run_fault("train.steps=6", "checkpoint.every=1", f"checkpoint.dir={disk}/ckpt",
                         f"run.dir={tmp_path}/run")
        shutil.copytree(disk / "ckpt", tmp_path / "kept", ignore=shutil.ignore_patterns("*tmp*"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    line = assert_one_line_error(proc, "checkpoint error: saving ")
    assert f"{disk}/ckpt" in line and "failed" in line
    steps = committed(tmp_path / "kept")
    assert steps and max(steps) < 6
    setup = saved[0]
    ckpt = Checkpointer(str(tmp_path / "kept"), keep=3, async_save=False)
    state, step = restore_or_init(setup, ckpt)  # what was committed before the failure verifies
    ckpt.close()
    assert step == max(steps) and int(state.step) == step


@pytest.mark.slow
def test_second_run_on_one_directory_is_refused_and_the_first_goes_on(tmp_path):
    cmd = [sys.executable, "-m", "meshtrain.run", *CLI_TINY, *MESH, "train.steps=400", "train.schedule_steps=400",
           "checkpoint.every=1000", f"run.dir={tmp_path}"]
    first = subprocess.Popen(cmd, env=fault_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert first.poll() is None, first.communicate()[0]
            time.sleep(0.1)
        second = run_fault("train.steps=400", "train.schedule_steps=400", f"run.dir={tmp_path}")
        assert second.returncode == 2, second.stdout + second.stderr
        line = assert_one_line_error(second, "config error: run.dir=")
        assert f"pid {first.pid} on " in line
        assert first.poll() is None, "the first run must go on"
    finally:
        first.send_signal(signal.SIGTERM)
        out = first.communicate(timeout=120)[0]
    assert first.returncode == 0, out
    assert "checkpoint saved" in out and len(committed(tmp_path / "checkpoints")) == 1


# ----------------------------------------------------------------------------- the record

class _Clock:
    """A perf_counter that moves only when told: step times compared exactly, never against a loaded CI's sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    from types import SimpleNamespace

    import meshtrain.metrics
    fake = _Clock()
    monkeypatch.setattr(meshtrain.metrics, "time", SimpleNamespace(perf_counter=fake))
    return fake


def test_step_time_never_negative_when_a_pause_began_before_the_step_ended(clock):
    from meshtrain.metrics import Throughput
    timer = Throughput()
    clock.sleep(0.01)
    timer.finished(1)
    timer.first_step_done(1)
    clock.sleep(0.02)
    timer.pause(0.05)  # e.g. a trace's start that waited for step 1 before its interval ended
    timer.finished(2)
    dt, paused = timer.seconds_per_step(2)
    assert 0 < dt < 1e-6 and paused == pytest.approx(0.02), (dt, paused)  # all 0.02 s of the interval paused


def test_resumed_run_drops_the_records_of_replayed_steps(tmp_path):
    import json

    from meshtrain.metrics import MetricsLog
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    MetricsLog(str(tmp_path), total_steps=10, first_step=3, progress=False).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_nonfinite_advice_names_the_likely_cause():
    from types import SimpleNamespace

    import jax.numpy as jnp

    from meshtrain.trainer import _Loop
    advice = lambda cfg, w: _Loop.nonfinite_advice(SimpleNamespace(  # noqa: E731
        setup=SimpleNamespace(cfg=cfg), state=SimpleNamespace(params={"w": jnp.asarray(w)}, loss_scale=jnp.float32(8))))
    assert "Lower train.lr" in advice(tiny_config(), [1.0, 2.0])
    assert "hold NaN or inf" in advice(tiny_config(), [1.0, float("nan")])
    fp16 = advice(tiny_config("precision.compute=float16"), [1.0])
    assert "smallest loss scale" in fp16 and "bfloat16" in fp16


def test_step_read_after_the_next_was_seen_done_gets_a_positive_time(clock):
    """A CPU runs step 10 inline in its dispatch before step 9 is read: 9's interval may not end after 10's."""
    from meshtrain.metrics import Throughput
    timer = Throughput()
    timer.finished(8)
    timer.seconds_per_step(8)
    clock.sleep(0.01)
    timer.finished(10)  # seen inline at dispatch
    clock.sleep(0.01)
    dt9, _ = timer.seconds_per_step(9)  # read later, never seen itself
    dt10, _ = timer.seconds_per_step(10)
    # 9 and 10 share the 0.01 s before 10 was seen; the 0.01 s after it belongs to step 11.
    assert dt9 == pytest.approx(0.01) and dt10 == pytest.approx(0.005), (dt9, dt10)


class _Output:
    """Stands for an array a step's dispatch returned: it exists when the test says so."""

    def __init__(self):
        import threading
        self.exists = threading.Event()

    def block_until_ready(self):
        assert self.exists.wait(10), "never made ready"
        return self


def _noted(timer, step):
    import time
    for _ in range(10_000):
        if step in timer.seen:
            return
        time.sleep(0.001)
    raise AssertionError(f"step {step} was never noted")


def test_a_step_ends_when_its_outputs_exist_not_when_the_host_reads_it(clock):
    """The host is held in the next step's dispatch after a step ends (a large program's kernels being queued): the
    interval of the run's last step is still the time between the two steps' ends, not from the late read."""
    from meshtrain.metrics import Throughput
    timer = Throughput()
    one, two = _Output(), _Output()
    timer.watch(1, one)
    clock.sleep(50.0)  # compilation and step 1
    one.exists.set()
    _noted(timer, 1)
    timer.watch(2, two)  # dispatched: the host is held 0.7 s more, then reads step 1
    clock.sleep(0.7)
    timer.first_step_done(1)
    clock.sleep(1.1)
    two.exists.set()  # the last step: read at once, nothing is dispatched after it
    _noted(timer, 2)
    clock.sleep(0.3)  # the read comes later still: it does not move the end
    dt, paused = timer.seconds_per_step(2)
    assert dt == pytest.approx(1.8) and paused == 0.0, dt  # ended at the host's sight: 1.4 s
    timer.close()
    assert timer._watcher is None
