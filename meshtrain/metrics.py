"""Throughput accounting (FLOPs, MFU, memory) and the run's outputs: a progress bar and metrics.jsonl.

MFU = model FLOPs per second / peak, with model FLOPs = 6·N·tokens (dense forward + backward) plus
6·L·T·D·tokens for causal attention (score and value matmuls, half of the T×T square). Recomputation
is not counted: MFU measures useful work. N counts every parameter, embeddings included; in an MoE
model only the active ones: a token passes through top_k of the n_experts routed experts.
"""
from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from tqdm import tqdm

from meshtrain.config import ModelConfig, MoEConfig
from meshtrain.tracking import Tracker

# Dense bf16 peak per device, FLOP/s, by substring of jax's device_kind. None: no MFU is reported.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: jax.Device) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)


def count_params(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def active_params(n_params: int, model: ModelConfig, moe: MoEConfig) -> int:
    """Parameters one token computes with: all but the routed experts it is not sent to."""
    if not moe.enabled:
        return n_params
    n_moe_layers = sum(moe.is_moe_layer(i) for i in range(model.n_layers))
    routed = n_moe_layers * moe.n_experts * 3 * model.d_model * moe.expert_ffn(model)
    return n_params - routed + routed * moe.top_k // moe.n_experts


def flops_per_token(model: ModelConfig, n_params: int, seq_len: int) -> float:
    return 6.0 * n_params + 6.0 * model.n_layers * seq_len * model.n_heads * model.kv_dim


def memory_in_use() -> dict[str, float]:
    """GiB in use and peak on the first local device, where the backend reports it (GPUs do)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    gib = 2.0 ** 30
    return {k: stats[s] / gib for k, s in (("mem_gib", "bytes_in_use"), ("peak_mem_gib", "peak_bytes_in_use"))
            if s in stats}


class MetricsLog:
    """Writes one JSON object per logged step (and per evaluation) to <run.dir>/metrics.jsonl, hands its
    numbers to the trackers (meshtrain/tracking.py: TensorBoard, W&B), and drives the progress bar.

    Only process 0 writes; every process computes the same numbers. The bar is drawn from construction
    on, so anything printed while it lives goes through `write()` (which lifts the bar out of the way).
    The log closes the trackers it is given.
    """

    def __init__(self, run_dir: str, *, total_steps: int, first_step: int, progress: bool,
                 trackers: Sequence[Tracker] = ()):
        self.is_writer = jax.process_index() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.is_writer:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if first_step == 0 and self.path.exists():
                # A fresh run in a used run.dir: keep the old records, but out of this run's file.
                stamp = datetime.fromtimestamp(self.path.stat().st_mtime).strftime("%Y-%m-%dT%H-%M-%S")
                n = 0
                while (old := self.path.with_name(f"metrics.{stamp}{f'-{n}' if n else ''}.jsonl")).exists():
                    n += 1
                self.path.rename(old)
                print(f"meshtrain: {self.path} held an earlier run's records; moved to {old.name}", flush=True)
            elif first_step > 0 and self.path.exists():
                self._truncate_after(first_step)
        self.trackers = list(trackers) if self.is_writer else []
        show_bar = progress and self.is_writer and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=first_step, disable=not show_bar, unit="step",
                        dynamic_ncols=True, leave=True)
        self._rate_from_here = False

    def _truncate_after(self, step: int) -> None:
        """A resumed run replays the steps after its checkpoint: drop their records from the stopped run (or
        from a run whose newer checkpoints were damaged), so that every step has one record."""
        lines = self.path.read_text().splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) > step:
                    continue
            except (ValueError, AttributeError):
                continue  # a line cut short by a kill
            kept.append(line)
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.path)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)
        if not self._rate_from_here and not self.bar.disable:
            # The first step's time is mostly compilation: the bar's rate, and so the time it says is left,
            # counts from the end of that step, not from the start of the run.
            self._rate_from_here = True
            done = self.bar.n
            self.bar.reset()  # the clock and the rate's averages from now
            self.bar.initial = self.bar.n = self.bar.last_print_n = done
            self.bar.refresh()

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        self._append(record, "train")
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self.write(format_record(record))

    def log_eval(self, record: dict[str, Any]) -> None:
        """An evaluation: {step, eval_loss, eval_ppl, eval_tokens, eval_s}."""
        if not self.is_writer:
            return
        self._append(record, "eval")
        self.write(f"eval   {record['step']:>6}  loss {record['eval_loss']:.4f}  ppl {record['eval_ppl']:.3f}  "
                   f"({record['eval_tokens']:,} tokens, {record['eval_s']:.1f} s)")

    def write(self, message: str) -> None:
        """Print a line without tearing the progress bar."""
        if self.is_writer:
            self.bar.write(message, file=sys.stdout)
            sys.stdout.flush()

    def _append(self, record: dict[str, Any], group: str) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers:
            scalars = tracked_scalars(record, group)
            for tracker in self.trackers:
                tracker.log(record["step"], scalars)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ends with an error (the trackers that keep a run's outcome record it)."""
        self.bar.close()
        for tracker in self.trackers:
            tracker.close(failed)


def tracked_scalars(record: dict[str, Any], group: str) -> dict[str, float]:
    """A record's finite numbers as the trackers name them: train/loss, eval/loss (from eval_loss), ..."""
    return {f"eval/{key[5:]}" if group == "eval" and key.startswith("eval_") else f"{group}/{key}": value
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def format_record(r: dict[str, Any]) -> str:
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"gnorm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}",
             f"{r['tokens_per_s']:>10,.0f} tok/s", f"{r['step_time_s'] * 1e3:8.1f} ms/step"]
    if "moe_aux_loss" in r:
        parts.append(f"moe aux {r['moe_aux_loss']:.3f} z {r['moe_z_loss']:.3g} load {r['moe_load_max']:.2f}"
                     f" drop {r['moe_dropped'] * 100:.1f}%")
    if r.get("includes_compile"):
        parts.append("(includes compilation)")
    if r.get("paused_s"):
        p = r["paused_s"]  # starting a trace takes a fraction of a millisecond on a CPU
        parts.append(f"(+{f'{p:.1f} s' if p >= 0.05 else f'{p * 1e3:.1f} ms'} checkpoint/eval/trace, not counted)")
    if r.get("mfu") is not None:
        parts.append(f"{r['tflops_per_device']:.0f} TFLOP/s/dev  MFU {r['mfu'] * 100:.1f}%")
    if "peak_mem_gib" in r:
        parts.append(f"mem {r['mem_gib']:.1f}/{r['peak_mem_gib']:.1f} GiB")
    if r.get("nonfinite_run"):
        parts.append(f"{r['nonfinite_run']} non-finite step(s) skipped in a row")
    return "  ".join(parts)


class Throughput:
    """Seconds per step between the moments the host saw two steps finish.

    A step's interval ends at the first moment the host sees that step done: when it waits for the step
    (to save, evaluate or trace), when the dispatch returns with the step already run (a CPU runtime
    may run a step whose inputs are ready in the calling thread), or else when its metrics are read,
    which the loop does after dispatching the next step. Host work after that moment belongs to the
    next interval, and so does the next step's inline run.

    The first finished step includes compilation, so it only sets the baseline; a record logged at
    that very step reports its wall time since the loop started (compilation included).

    A watched step (`watch`) is seen done by a thread of its own, the moment its outputs exist, whatever
    holds the loop then: the next step's dispatch (the full Llama-3-8B step on two H200s returns from its
    dispatch after 0.5 s of its 1.8), the data feed, a log line. The loop's own sight can come late, and a
    late start of an interval whose end is seen at once (the run's last step: nothing is dispatched after
    it) makes the step look fast: a 2-step run of that 8B config once printed 1.14 s for step 2 (an MFU of
    93.6%) where the synchronized benchmark measured 1.81 s (the cause not found: two later runs of the
    same command printed 1.80 s).
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.mark: tuple[float, int] | None = None  # (time, step) of the last baseline
        self.prev: tuple[float, int] | None = None  # the baseline before it
        # Host work off the clock, as (start, stop) on the same monotonic clock. An interval subtracts only
        # the part of a pause that falls inside it: a pause whose seconds began before the interval did (a
        # trace's start waits for the step that ends the previous interval) would otherwise make it negative.
        self.pauses: list[tuple[float, float]] = []
        self.seen: dict[int, float] = {}  # step -> time when first seen done
        self._seen_changed = threading.Condition()  # guards `seen`, which the watcher's thread writes too
        self._watched: set[int] = set()  # steps whose outputs the watcher waits for and not yet read
        self._watcher: _Watcher | None = None

    def pause(self, seconds: float) -> None:
        """Leave the `seconds` of host time (a checkpoint save, an evaluation) that just ended out of the step time."""
        now = time.perf_counter()
        self.pauses.append((now - seconds, now))

    def finished(self, step: int) -> None:
        """`step` has just been seen done; its interval ends here even if it is read later."""
        now = time.perf_counter()
        with self._seen_changed:
            self.seen[step] = min(self.seen.get(step, now), now)  # the first sight counts
            self._seen_changed.notify_all()

    def watch(self, step: int, output: jax.Array) -> None:
        """Note the moment `output` (any array the dispatch of `step` returned) exists, from the watcher's thread."""
        if self._watcher is None:
            self._watcher = _Watcher(self.finished)
        self._watched.add(step)
        self._watcher.put(step, output)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def _end(self, step: int) -> float:
        """The time at the end of `step`'s interval: when it was first seen done, else no later than when a
        later step was (a CPU may run the next step inline in its dispatch before this one is read).
        A watched step is done when this is called (its metrics were read): its note is on its way."""
        with self._seen_changed:
            if step in self._watched:
                self._seen_changed.wait_for(lambda: step in self.seen, timeout=_WATCH_GRACE_S)
            self._watched = {s for s in self._watched if s > step}
            now = time.perf_counter()
            end = self.seen.get(step) or min([t for s, t in self.seen.items() if s > step], default=now)
            self.seen = {s: v for s, v in self.seen.items() if s > step}
        return end

    def _paused(self, begin: float, end: float) -> float:
        """Seconds paused within (begin, end]; forgets the pauses over by `begin`."""
        inside = sum(max(0.0, min(b, end) - max(a, begin)) for a, b in self.pauses)
        self.pauses = [(a, b) for a, b in self.pauses if b > begin]
        return inside

    def seconds_per_step(self, step: int) -> tuple[float, float]:
        """Call when `step` is known to be finished; moves the baseline to it. Returns (seconds per step,
        seconds paused in the interval), from one monotonic clock."""
        end = self._end(step)
        base = self.mark
        if base is not None and end <= base[0]:
            # Seen done no later than the last baseline: the two steps share the interval before it.
            base = self.prev
        begin = base[0] if base else self.started
        paused = self._paused(begin, end)
        n = step - base[1] if base is not None and step > base[1] else 1
        dt = (end - begin - paused) / n
        self.prev, self.mark = base, (end, step)
        return max(dt, 1e-9), paused  # the floor: a tie of the clock, never a division by zero downstream

    def first_step_done(self, step: int) -> None:
        end = self._end(step)
        self._paused(self.mark[0] if self.mark else self.started, end)
        self.prev, self.mark = None, (end, step)


_WATCH_GRACE_S = 5.0  # how long a read waits for the watcher's note of a step already done (else: the read's time)


class _Watcher:
    """A daemon thread that waits for each watched step's output in turn and calls `note(step)` when it exists
    (steps end in the order they were dispatched). It only waits: nothing on the device waits for it."""

    def __init__(self, note) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(note,), name="meshtrain-step-clock", daemon=True)
        self._thread.start()

    def _run(self, note) -> None:
        while (item := self._queue.get()) is not None:
            step, output = item
            try:
                output.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed step is reported by the loop's own read of it
                pass
            note(step)

    def put(self, step: int, output) -> None:
        self._queue.put((step, output))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=_WATCH_GRACE_S)
