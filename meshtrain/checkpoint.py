"""Checkpoints through Orbax: async save, keep the last N, the resolved config saved beside each.

What a committed step guarantees:
  atomic     Orbax writes a step into a temporary directory and renames it only once all of it is on
             disk, so a process killed mid-save leaves no step that `all_steps()` returns (left-over
             temporary directories are removed at start).
  verified   each array's digest (`digests`, computed on the devices from the exact bits) goes into the
             step's Orbax custom metadata at save time; restore recomputes it on what it read, so a
             flipped bit, a truncated or swapped file is found, not trained on.
  fallback   `restore_verified` tries the newest step and, on any read or verification error, says so in
             one line and tries the one before; the steps that failed are renamed `<step>.damaged` (kept,
             never deleted) once an earlier one verified, so that neither a new save nor rotation trips on them.
  loud       a failed save (full disk, unwritable directory, a write past checkpoint.timeout_s) raises
             CheckpointError with one line at once; the steps already committed are left as they were.

The state is stored as a plain nested dict of arrays (flax `to_state_dict`), so the checkpoint format
does not depend on Python class names. Restore reads each array straight into the shardings of the
current mesh, which may differ from the mesh that saved it (the digests do not depend on the sharding).
The layer stack is written in the order the run keeps it (the pipeline stages' order under interleaved and
dualpipe_v, step/pipeline/layout.py), recorded beside the digests; a restore verifies what it read, then puts
the stack in the order its reader asks for (a step without the record is in the model's order), and in the
reader's layout where `model.scan_layers` changed since the save (scan_layout.py).
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from meshtrain.config import ConfigError
from meshtrain.scan_layout import Stack, saved_layout, to_layout
from meshtrain.step.pipeline.layout import LAYERS, MODEL_ORDER, reorder_arrays
from meshtrain.step.state import TrainState

DIGESTS = "meshtrain_digests"  # the custom-metadata key of {array path: digest}
LAYERS_ORDER = "meshtrain_layers_order"  # the model block at each stored position of the layer stack


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no saved step could be read back intact; one line."""


def reason(e: BaseException) -> str:
    """An exception as one short line (Orbax and TensorStore errors run over many)."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {text[:240]}" if text else type(e).__name__


# ---------------------------------------------------------------------------------------- digests

def _digest(x: jax.Array) -> jax.Array:
    """sum_i word_i * (2i + 1) mod 2^32 over the array's raw bits as unsigned words. The weights are odd,
    so any single flipped bit changes it; integer addition is exact in any order, so every sharding of
    the same values gives the same digest."""
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        w = x.astype(jnp.uint32)
    else:
        size = jnp.dtype(x.dtype).itemsize
        word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
        w = jax.lax.bitcast_convert_type(x, word).reshape(-1).astype(jnp.uint32)
    i = jnp.arange(w.shape[0], dtype=jnp.uint32)
    return jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)


_digests = jax.jit(lambda leaves: [_digest(x) for x in leaves])


def digests(tree: Any) -> dict[str, int]:
    """{'params/embed/embedding': digest, ...} of every array in `tree` (a state dict)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in flat]
    values = _digests([leaf for _, leaf in flat])  # replicated scalars: any local copy is the value
    return {n: int(np.asarray(v.addressable_data(0))) for n, v in zip(names, values)}


# ------------------------------------------------------------------------------------ the manager

class Checkpointer:
    def __init__(self, directory: str, *, keep: int, async_save: bool, timeout_s: int = 600):
        self.directory = Path(directory).absolute()
        # A write that takes longer than timeout_s fails (and so stops the run) instead of hanging it:
        # Orbax times the async writes; a synchronous save is timed here (`_within`).
        self._sync_timeout_s = None if async_save else timeout_s
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=async_save,
                                               async_options=ocp.AsyncOptions(timeout_secs=timeout_s))
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            raise CheckpointError(f"checkpoint.dir={str(self.directory)!r} cannot be used ({reason(e)}); "
                                  f"fix its permissions or point checkpoint.dir elsewhere") from None

    @staticmethod
    def exists(directory: str) -> bool:
        return Path(directory).is_dir()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    # -- save

    def save(self, step: int, state: TrainState, config: dict[str, Any], layers_order: np.ndarray = MODEL_ORDER
             ) -> None:
        """Start saving `state`, its layer stack in `layers_order` (`Setup.layers_order`), as `step`; returns once
        the device arrays are copied (async write). A failure, this one's or an earlier async write's, raises
        CheckpointError."""
        self.check()
        tree = serialization.to_state_dict(state)
        metadata = {DIGESTS: digests(tree), LAYERS_ORDER: [int(b) for b in layers_order]}

        def write() -> None:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), config=ocp.args.JsonSave(config)),
                custom_metadata=metadata, force=True)
        try:
            if self._sync_timeout_s is None:
                write()
            else:
                _within(self._sync_timeout_s, write)
        except Exception as e:  # noqa: BLE001  (any failure of the write is reported the same way)
            raise self._save_failed(step, e) from None

    def check(self) -> None:
        """Raise CheckpointError if an async write has failed since the last call. Never waits: while a
        write is still in progress there is nothing to report yet (Orbax's check_for_errors would also
        wait for the step's metadata writes)."""
        if self.manager.is_saving_in_progress():
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(None, e) from None

    def _save_failed(self, step: int | None, e: BaseException) -> CheckpointError:
        which = f"step {step}" if step is not None else "a checkpoint"
        kept = self._committed_on_disk()
        return CheckpointError(f"saving {which} to {self.directory} failed ({reason(e)}); the run stops here, "
                               f"committed steps {kept or 'none'} are intact: free space or fix the directory, "
                               f"then run the same command to resume")

    def _committed_on_disk(self) -> list[int]:
        try:
            return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())
        except OSError:
            return []

    # -- restore

    def layers_order(self, step: int) -> np.ndarray:
        """The order `step` holds its layer stack in (module docstring)."""
        return np.asarray((self.manager.metadata(step).custom_metadata or {}).get(LAYERS_ORDER, MODEL_ORDER))

    def in_order(self, step: int, tree: Any, layers_order: np.ndarray) -> Any:
        """A verified read of `step` (a state dict, or a tree holding `params`) with its layer stack moved from the
        step's order to `layers_order`."""
        params = tree["params"]
        if LAYERS not in params:
            return tree
        rows = jax.tree.leaves(params[LAYERS])[0].shape[0]
        return reorder_arrays(tree, self.layers_order(step), np.asarray(layers_order), rows)

    def restore(self, step: int, abstract_state: TrainState) -> TrainState:
        """Read `step` into the shapes, dtypes and shardings of `abstract_state` (any mesh), unverified, the layer
        stack in the order it was written in."""
        state = self._read(step, serialization.to_state_dict(abstract_state))
        return serialization.from_state_dict(abstract_state, state)

    def _read(self, step: int, target: dict) -> dict:
        """`step`'s state dict read into `target`'s shapes, dtypes and shardings, unverified."""
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]

    def verify(self, step: int, state: TrainState | dict) -> None:
        """Compare the digests of what `restore` read (a state, or its state dict) with those written at save
        time; raise on a mismatch. A step written before digests existed has none: it passes unverified."""
        if not (self.directory / str(step) / "_CHECKPOINT_METADATA").is_file():
            raise ValueError("its _CHECKPOINT_METADATA file is missing")
        self._verify_digests(step, state if isinstance(state, dict) else serialization.to_state_dict(state), whole=True)

    def _in_reader_layout(self, step: int, state: dict, saved: Stack | None, reader: Stack | None, target: dict,
                          layers_order: np.ndarray) -> dict:
        """A verified read of `step` (a state dict, or a tree holding `params`, in its saved layout) with the layer
        stack in the reader's layout and order: a scanned stack is put in order where it is scanned."""
        if saved is None or saved == reader:
            return self.in_order(step, state, layers_order)
        if saved.scanned:  # the model's order, then split into layers
            return to_layout(self.in_order(step, state, MODEL_ORDER), saved, reader, target)
        # Stacked, then put in the reader's order (an unrolled step ran without a pipeline: it records the model's).
        return self.in_order(step, to_layout(state, saved, reader, target), layers_order)

    def _verify_digests(self, step: int, state_dict: dict, whole: bool = False) -> None:
        """The digests of `state_dict` (all of a step's arrays when `whole`, else a part, e.g. the params)
        against those recorded at save time; ValueError on a mismatch."""
        saved = (self.manager.metadata(step).custom_metadata or {}).get(DIGESTS)
        if saved is None:
            return
        got = digests(state_dict)
        if set(got) - set(saved) or whole and set(got) != set(saved):
            raise ValueError(f"its arrays are not those it recorded ({len(got)} read, {len(saved)} recorded)")
        bad = [k for k in got if got[k] != saved[k]]
        if bad:
            raise ValueError(f"checksum mismatch in {len(bad)} array(s), first {bad[0]}")

    def restore_verified(self, abstract_state: TrainState, check_config: Callable[[dict, int], None],
                         layers_order: np.ndarray = MODEL_ORDER, stack: Stack | None = None
                         ) -> tuple[TrainState, int, dict] | None:
        """The newest step that reads back and verifies, as (state, step, its saved config), the state's layer stack
        in `layers_order` and in `stack`'s layout (the reader's; None: as saved); None when the directory holds no
        step. `check_config(saved_config, step)` may raise ConfigError (a checkpoint of another model is the user's
        mistake, not damage: no fallback). Steps that failed are set aside
        once one verifies; when none does, CheckpointError names the directory and nothing is renamed."""
        steps = self.all_steps()[::-1]
        failed = []
        target = serialization.to_state_dict(abstract_state)
        for i, step in enumerate(steps):
            try:
                saved = self.saved_config(step)
            except Exception as e:  # noqa: BLE001
                failed.append(self._say_failed(step, f"its config cannot be read ({reason(e)})", steps[i + 1:]))
                continue
            check_config(saved, step)
            state, why = None, None
            try:
                read_as, saved_stack = saved_layout(target, stack, saved, self.directory, step)
                state = self._read(step, read_as)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001
                _quiet_abandoned_reads()
                why = reason(e)
            why = _agreed_failure(why)  # before verify: its digests are a collective of every process
            if why is None:
                try:
                    self.verify(step, state)
                except Exception as e:  # noqa: BLE001  (the digests are global: every process agrees)
                    why = reason(e)
            if why is not None:
                failed.append(self._say_failed(step, why, steps[i + 1:]))
                continue
            self._set_aside(failed)
            state = self._in_reader_layout(step, state, saved_stack, stack, target, layers_order)
            return serialization.from_state_dict(abstract_state, state), step, saved
        if steps:
            raise CheckpointError(f"no checkpoint in {self.directory} reads back intact (steps {sorted(steps)} all "
                                  f"failed, see above); restore a copy of it, or move it away to start afresh")
        return None

    def _say_failed(self, step: int, why: str, rest: list[int]) -> int:
        then = f"falling back to step {rest[0]}" if rest else "no earlier step to fall back to"
        if jax.process_index() == 0:
            print(f"meshtrain: checkpoint step {step} in {self.directory} cannot be used: {why}; {then}", flush=True)
        return step

    def _set_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                src = self.directory / str(step)
                dst = self.directory / f"{step}.damaged"
                n = 1
                while dst.exists():
                    dst, n = self.directory / f"{step}.damaged{n}", n + 1
                src.rename(dst)
                print(f"meshtrain: set aside {src.name} as {dst.name} (kept for inspection)", flush=True)
        if jax.process_count() > 1:  # the others list the steps only once process 0 has renamed them
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("meshtrain checkpoint set aside")
        self.manager.reload()

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of `step` (no optimizer state), into the shardings of `abstract_params`.
        Needs a Checkpointer that has not saved in this process (Orbax binds the handler on first use)."""
        target = {"params": serialization.to_state_dict(abstract_params)}
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(target, restore_args=args, partial_restore=True)))
        return restored["state"]["params"]

    def restore_params_verified(self, step: int, abstract_params: Any, *, fall_back: bool,
                                layers_order: np.ndarray = MODEL_ORDER, stack: Stack | None = None
                                ) -> tuple[Any, int]:
        """(params, the step they are from): `step`'s parameters, verified against the digests written
        with them, the layer stack in `layers_order` (by default the model's, as readers run it) and in `stack`'s
        layout (the reader's; None: as saved). With
        `fall_back` (the newest step was asked for, not a given one) a step that does not
        read back intact is passed over for the next older one, with a line saying so; nothing is renamed
        (a reader leaves the run directory as it found it). CheckpointError when no candidate verifies."""
        candidates = [s for s in self.all_steps()[::-1] if s <= step] if fall_back else [step]
        target = {"params": serialization.to_state_dict(abstract_params)}
        for i, candidate in enumerate(candidates):
            try:
                read_as, saved = saved_layout(target, stack, self.saved_config(candidate), self.directory, candidate)
                params = self.restore_params(candidate, read_as["params"])
                self._verify_digests(candidate, {"params": params})
                params = self._in_reader_layout(candidate, {"params": params}, saved, stack, target, layers_order)
                return serialization.from_state_dict(abstract_params, params["params"]), candidate
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001
                _quiet_abandoned_reads()
                self._say_failed(candidate, reason(e), candidates[i + 1:])
        raise CheckpointError(f"step{'s' if len(candidates) > 1 else ''} {', '.join(map(str, candidates))} in "
                              f"{self.directory} do{'' if len(candidates) > 1 else 'es'} not read back intact (see "
                              f"above); restore a copy of the run, or pass --step with an intact step")

    def saved_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def wait(self) -> None:
        """Block until the last async save is committed (call before exiting); a failed write raises
        CheckpointError."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(None, e) from None

    def close(self) -> None:
        self.manager.close()


def _agreed_failure(why: str | None) -> str | None:
    """Why this step cannot be used, as every process sees it: each process reads only the shards its
    devices hold, so one may fail where another succeeds; all must then pass the step over together (a
    process that went on alone would wait in the next collective for ever). Every process calls this."""
    if jax.process_count() == 1:
        return why
    from jax.experimental import multihost_utils
    failed = np.asarray(multihost_utils.process_allgather(np.int32(why is not None)))
    if why is None and failed.any():
        return f"process {int(np.argmax(failed))} could not read it"
    return why


def _within(timeout_s: float, fn: Callable[[], None]) -> None:
    """Run `fn` and return, re-raising what it raised; TimeoutError once it has run `timeout_s` seconds.
    A synchronous Orbax save has no timeout of its own, and a hung file system (a stale NFS mount) would
    hang the run for ever; the write runs in a daemon thread so that the run can stop with one line
    (the step's temporary directory is never committed, and the next start removes it)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
            failure.append(e)

    writer = threading.Thread(target=run, name="meshtrain-checkpoint-write", daemon=True)
    writer.start()
    writer.join(timeout_s)
    if writer.is_alive():
        raise TimeoutError(f"the write took longer than checkpoint.timeout_s={timeout_s:g}")
    if failure:
        raise failure[0]


def _quiet_abandoned_reads() -> None:
    """Keep the one line `_say_failed` prints the only report of a damaged step. When one read of a step
    fails, Orbax abandons its sibling reads; closing such a suspended reader raises GeneratorExit inside it,
    which Orbax's reader catches (as BaseException) and re-raises as an Exception, so Python prints
    "Exception ignored in: <coroutine ...>" and a traceback whenever the garbage collector gets to it,
    possibly long after the fallback. Only exceptions caused by GeneratorExit are dropped (never
    meaningful); every other unraisable exception reaches the hook that was installed before."""
    if getattr(sys.unraisablehook, "meshtrain_quiet_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit):
            previous(unraisable)

    hook.meshtrain_quiet_reads = True
    sys.unraisablehook = hook


def abstract_state(state_shardings: TrainState, shapes: TrainState) -> TrainState:
    """ShapeDtypeStructs carrying the target shardings: what restore fills."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_shardings)
