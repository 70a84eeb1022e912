"""A trained model ready to run: from a meshtrain checkpoint or a Hugging Face directory, on a mesh.

`load("runs/x/checkpoints" | "runs/x" | "hf:DIR", overrides)` gives the resolved config, the Setup on
the mesh that config describes (mesh.* overrides choose it; the default spans every device with
fsdp), and the parameters read straight into their shardings: Orbax restores only the parameters of
the chosen step (no optimizer state), and a Hugging Face model is loaded as `checkpoint.init_from`
would. The command-line tools (evaluate, generate, export) start here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.checkpoint import Checkpointer
from meshtrain.config import Config, ConfigError, PipelineConfig, build_config, padded_vocab, validate, with_mesh
from meshtrain.hf.config import HF_PREFIX, hf_dir
from meshtrain.mesh import build_mesh
from meshtrain.precision import Precision
from meshtrain.scan_layout import Stack
from meshtrain.step.state import Setup, abstract_params, build_setup


@dataclass
class Loaded:
    cfg: Config
    setup: Setup
    params: Any
    step: int | None  # the checkpoint's step; None for a Hugging Face model
    hf_source: Path | None  # the Hugging Face directory the model came from, when it did (tokenizer, eos)


def checkpoint_dir(source: str) -> Path:
    """A run directory or its checkpoints directory -> the directory holding the numbered steps."""
    p = Path(source)
    if (p / "checkpoints").is_dir() and not any(c.name.isdigit() for c in p.iterdir()):
        p = p / "checkpoints"
    if not p.is_dir():
        raise ConfigError(f"--checkpoint {source!r}: no such directory; give a run directory, its checkpoints/ "
                          f"directory, or hf:DIR for a Hugging Face model")
    return p


def saved_run(source: str, step: int | None) -> tuple[Checkpointer, int, dict[str, Any]]:
    """(the run's checkpointer, which the caller closes; the step to read; its saved config)."""
    ckpt = Checkpointer(str(checkpoint_dir(source)), keep=1_000_000, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise ConfigError(f"--checkpoint {source!r}: holds no committed checkpoint")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise ConfigError(f"--step {step}: not in {source!r}; it holds steps {', '.join(map(str, sorted(steps)))}")
        return ckpt, step, ckpt.saved_config(step)
    except BaseException:
        ckpt.close()
        raise


def load(source: str, overrides: list[str], *, step: int | None = None) -> Loaded:
    """The model of `source` on the mesh the overrides describe (see the module docstring)."""
    if source.startswith(HF_PREFIX):
        cfg = build_config({}, [f"checkpoint.init_from={source}", *overrides])
        setup = _setup(cfg)
        from meshtrain.hf.weights import load_params
        params = load_params(hf_dir(source), setup.cfg.model, abstract_params(setup), setup.state_shardings.params,
                             moe=setup.cfg.moe)
        return Loaded(setup.cfg, setup, params, None, hf_dir(source))

    asked = step
    ckpt, step, saved = saved_run(source, step)
    try:  # closed on every way out: Orbax's threads outliving the interpreter print a traceback at exit
        # The run's own settings, minus where it ran (mesh, hosts) and how it started.
        values = {k: v for k, v in saved.items() if k not in ("mesh", "distributed")}
        init_from = values.get("checkpoint", {}).get("init_from", "")
        values["checkpoint"] = {}
        cfg = build_config(values, overrides)
        setup = _setup(cfg)
        tp, saved_rows = setup.mesh.shape["tp"], padded_vocab(cfg.model, saved["mesh"]["tp"])
        if saved_rows % tp:
            raise ConfigError(f"mesh.tp={tp} does not divide the checkpoint's {saved_rows} vocabulary rows "
                              f"(model.vocab_size={cfg.model.vocab_size} padded for its "
                              f"mesh.tp={saved['mesh']['tp']}); choose a tp that divides {saved_rows}")
        setup = with_vocab_rows(setup, saved_rows)
        params, step = ckpt.restore_params_verified(step, abstract_params(setup), fall_back=asked is None,
                                                    stack=Stack.of(setup.cfg))
    finally:
        ckpt.close()
    return Loaded(setup.cfg, setup, params, step, hf_dir(init_from) if init_from else None)


def with_vocab_rows(setup: Setup, rows: int) -> Setup:
    """The setup with the vocabulary padded to `rows` (a saved checkpoint's; any multiple of tp works:
    padded logits are masked by the loss and cut off by `logits`)."""
    exe = dataclasses.replace(setup.exe, vocab_padded=rows)
    return dataclasses.replace(setup, exe=exe, model=setup.model.clone(exe=exe))


def _setup(cfg: Config) -> Setup:
    # Inference runs one sequence axis per device group: Megatron SP would split 1-token steps over tp. It runs
    # no pipeline schedule either, and its parameters keep the layer stack in the model's order (the checkpoint
    # reader's default), which is the Setup's own only without interleaved / dualpipe_v chunks.
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=False),
                              pipeline=PipelineConfig())
    degrees = validate(cfg, jax.device_count())
    cfg = with_mesh(cfg, degrees)
    return build_setup(cfg, build_mesh(degrees))


def logits(setup: Setup, h_btd: jax.Array, head_dv: jax.Array) -> jax.Array:
    """Final hidden states -> fp32 logits [B, T, V] over the real vocabulary (padding columns dropped)."""
    policy: Precision = setup.model.policy
    logits_btv = policy.einsum("btd,dv->btv", h_btd, head_dv, site="lm_head", out_dtype=jnp.float32)
    return logits_btv[..., : setup.cfg.model.vocab_size]


def forward_logits(setup: Setup, params: Any, tokens_bt: jax.Array) -> jax.Array:
    """fp32 logits of whole sequences (positions 0.., one segment), jitted on the setup's mesh."""
    def fwd(params, tokens_bt):
        positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
        h_btd, head_dv = setup.model.apply({"params": params}, tokens_bt, positions_bt, jnp.zeros_like(tokens_bt))
        return logits(setup, h_btd, head_dv)

    return jax.jit(fwd)(params, jnp.asarray(tokens_bt, jnp.int32))
