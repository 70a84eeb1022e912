"""A checkpoint's layer stack read in the other layout than the one it was saved in.

`model.scan_layers` decides how the state keeps the layers: scanned, every leaf under a `layers` key
stacked [L, ...] (with MoE groups of `moe.every` layers, [L/every, ...] per member of the group), or
unrolled, one `layers/layer_i` subtree per layer. A run may change it between a save and its resume
(unrolled layers run faster on GPUs; a pipeline needs them scanned), and a reader may load either:

    the reader's abstract state ──as_saved──> the saved layout's shapes and shardings, compared with the
        step's own metadata (`saved_layout`): a state that does not stack per layer cannot move
    Orbax reads the step there; its digests are checked on exactly what was written
    ──to_layout──> stacked or split on the devices into the reader's shardings, one `layers` subtree at a time

Everything under a `layers` key moves alike: the parameters, the optimizer's moments, the fp8 histories.
Adafactor's factored statistics do not stack per layer (a stacked [L, D] norm scale is factored, a [D] one is
not): its state stays in the layout it was saved in, which the config error says. The cost: an unrolled step
read by a scanned reader over pp > 1 holds each layer on every stage until it is stacked (pp splits only the
stacked axis), and each `layers` subtree is held twice while it moves.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.config import Config, ConfigError
from meshtrain.model.transformer import stacked_layers, unrolled_layers
from meshtrain.step.pipeline.layout import LAYERS


@dataclasses.dataclass(frozen=True)
class Stack:
    """How a config keeps its layer stack in the state (module docstring)."""

    scanned: bool
    n_layers: int
    every: int = 1  # layers per scanned group: moe.every with MoE layers

    @classmethod
    def of(cls, cfg: Config) -> "Stack":
        return cls(cfg.model.scan_layers, cfg.model.n_layers, cfg.moe.every if cfg.moe.enabled else 1)

    def as_saved_under(self, saved_config: dict) -> "Stack":
        """This stack as a step saved under `saved_config` keeps it: the same layers and MoE groups (what
        resume.check_compatible compares before a restore), scanned or not as that run was."""
        return dataclasses.replace(self, scanned=bool(saved_config["model"].get("scan_layers", True)))


def map_stacks(fn: Callable[[dict, Any], Any], tree: Any, beside: Any = None) -> Any:
    """A state dict with fn(subtree, the subtree at the same place in `beside`) for every subtree under a
    `layers` key; the rest as it is."""
    if not isinstance(tree, dict):
        return tree
    at = (lambda k: None) if beside is None else (lambda k: beside[k])
    return {k: fn(v, at(k)) if k == LAYERS and isinstance(v, dict) else map_stacks(fn, v, at(k))
            for k, v in tree.items()}


def _relaid(layers: dict, source: Stack, target: Stack, stack_leaves: Callable, take: Callable) -> dict:
    """One `layers` subtree from source's layout into target's."""
    if source.scanned == target.scanned:
        return layers
    if source.scanned:
        return unrolled_layers(layers, source.n_layers, source.every, take=take)
    return stacked_layers(layers, source.n_layers, source.every, stack_leaves=stack_leaves)


def _stacked_shape(*per_layer: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    x, sharding = per_layer[0], per_layer[0].sharding
    if isinstance(sharding, NamedSharding):  # each layer's split, the layer axis whole
        sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(per_layer), *x.shape), x.dtype, sharding=sharding)


def _layer_shape(stacked: jax.ShapeDtypeStruct, _: int) -> jax.ShapeDtypeStruct:
    sharding = stacked.sharding
    if isinstance(sharding, NamedSharding):  # the stack's split without its layer axis
        sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype, sharding=sharding)


def as_saved(abstract: dict, reader: Stack, saved: Stack) -> dict:
    """The reader's abstract state dict (ShapeDtypeStructs carrying shardings) in the saved layout: what Orbax
    reads the step into."""
    return map_stacks(lambda layers, _: _relaid(layers, reader, saved, _stacked_shape, _layer_shape), abstract)


def to_layout(state: dict, saved: Stack, reader: Stack, abstract: dict) -> dict:
    """A restored state dict (arrays in the saved layout) in the reader's: each `layers` subtree stacked or
    split by one jit into the shardings of `abstract` (the reader's abstract state dict)."""
    if saved.scanned == reader.scanned:
        return state

    def move(layers: dict, target: dict) -> dict:
        relay = lambda t: _relaid(t, saved, reader, lambda *xs: jnp.stack(xs), lambda x, i: x[i])  # noqa: E731
        return jax.jit(relay, out_shardings=jax.tree.map(lambda s: s.sharding, target))(layers)

    return map_stacks(move, state, abstract)


def mismatches(wanted: Any, saved_shapes: Any, path: str = "") -> list[str]:
    """Where the shapes of `wanted` (an abstract state dict in the saved layout) differ from what the step holds
    (`saved_shapes`: its metadata tree, leaves with a `.shape`); `wanted`'s keys only."""
    if isinstance(wanted, dict):
        if not isinstance(saved_shapes, dict):
            return [path or "/"]
        return [m for k, v in wanted.items()
                for m in (mismatches(v, saved_shapes[k], f"{path}/{k}") if k in saved_shapes else [f"{path}/{k}"])]
    got = tuple(getattr(saved_shapes, "shape", ()) or ())
    return [] if got == tuple(wanted.shape) else [f"{path} (saved {got}, read as {tuple(wanted.shape)})"]


def saved_layout(target: dict, reader: Stack | None, saved_config: dict, directory: Path,
                 step: int) -> tuple[dict, Stack | None]:
    """(the reader's abstract state dict `target` in the layout `step` of the checkpoint `directory` was saved in,
    that layout): `target` itself unless `reader` keeps its stack otherwise. A state that cannot move between the
    two is the user's config, not damage: ConfigError, before anything is read."""
    saved = reader.as_saved_under(saved_config) if reader is not None else None
    if saved is None or saved == reader:
        return target, saved
    read_as = as_saved(target, reader, saved)
    held = ocp.StandardCheckpointHandler().metadata(epath.Path(Path(directory) / str(step) / "state")).tree
    wrong = mismatches(read_as, held)
    if wrong:
        was = str(saved.scanned).lower()
        raise ConfigError(f"model.scan_layers={str(reader.scanned).lower()}: step {step} in {directory} was saved with "
                          f"model.scan_layers={was}, and {wrong[0]} does not stack per layer (train.optimizer's "
                          f"state); resume with model.scan_layers={was}")
    return read_as, saved
