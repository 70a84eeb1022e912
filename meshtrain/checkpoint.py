"""Checkpoints through Orbax: async save, keep the last N, the resolved config saved beside each.

Orbax writes every checkpoint into a temporary directory and renames it only once all of it is on
disk, so a process killed mid-save leaves no step that `latest_step()` would return: a restart loads
the previous committed one (left-over temporary directories are removed at start).

The state is stored as a plain nested dict of arrays (flax `to_state_dict`), so the checkpoint format
does not depend on Python class names. Restore reads each array straight into the shardings of the
current mesh, which may differ from the mesh that saved it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import serialization

from meshtrain.step.state import TrainState


class Checkpointer:
    def __init__(self, directory: str, *, keep: int, async_save: bool):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    @staticmethod
    def exists(directory: str) -> bool:
        return Path(directory).is_dir()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: TrainState, config: dict[str, Any]) -> None:
        """Start saving `state` as `step`; returns once the device arrays are copied (async write)."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(serialization.to_state_dict(state)),
            config=ocp.args.JsonSave(config)), force=True)

    def restore(self, step: int, abstract_state: TrainState) -> TrainState:
        """Read `step` into the shapes, dtypes and shardings of `abstract_state` (any mesh)."""
        target = serialization.to_state_dict(abstract_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return serialization.from_state_dict(abstract_state, restored["state"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of `step` (no optimizer state), into the shardings of `abstract_params`.
        Needs a Checkpointer that has not saved in this process (Orbax binds the handler on first use)."""
        target = {"params": serialization.to_state_dict(abstract_params)}
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(target, restore_args=args, partial_restore=True)))
        return restored["state"]["params"]

    def saved_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def wait(self) -> None:
        """Block until the last async save is committed (call before exiting)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_state(state_shardings: TrainState, shapes: TrainState) -> TrainState:
    """ShapeDtypeStructs carrying the target shardings: what restore fills."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_shardings)
