"""Resuming a run: restore the newest checkpoint that verifies (or initialize), and refuse a checkpoint of
another model or of other data.

A checkpoint's parameter tree is decided by the model's shape fields; everything else (kernels, the mesh,
the norms' eps ...) may change between the run that saved it and the run that resumes it. The batches are
decided by the data-defining fields (DATA_FIELDS): a resume that changes one of them would continue on
another stream than the one it started, so it is refused unless checkpoint.allow_data_change is set.
"""
from __future__ import annotations

import dataclasses
import fnmatch

import jax

from meshtrain.checkpoint import Checkpointer, abstract_state
from meshtrain.config import MATMUL_SITES, Config, ConfigError, MoEConfig, padded_vocab
from meshtrain.hf.config import hf_dir
from meshtrain.scan_layout import Stack
from meshtrain.step.state import Setup, TrainState, abstract_params, init_state, state_from_params


def restore_or_init(setup: Setup, ckpt: Checkpointer | None) -> tuple[TrainState, int | None]:
    latest = ckpt.latest_step() if ckpt else None
    if latest is None:
        if (directory := hf_dir(setup.cfg.checkpoint.init_from)) is not None:
            from meshtrain.hf.weights import load_params
            params = load_params(directory, setup.cfg.model, abstract_params(setup), setup.state_shardings.params,
                                 moe=setup.cfg.moe)
            return state_from_params(setup, params), None
        return init_state(setup), None
    shapes = jax.eval_shape(lambda: init_state(setup))  # traced only: no parameters are drawn
    found = ckpt.restore_verified(abstract_state(setup.state_shardings, shapes),
                                  lambda saved, step: check_compatible(setup.cfg, saved, ckpt.directory, step),
                                  setup.layers_order, Stack.of(setup.cfg))
    if found is None:  # only damaged-and-set-aside or no steps: cannot happen after latest_step, but be plain
        return init_state(setup), None
    state, step, _ = found
    return state, step


# Model fields that decide the parameter tree; the rest (kernels, norms' eps, ...) may change on resume, and so
# may scan_layers (the checkpoint is read into the other layout: scan_layout.py).
SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                "tie_embeddings")
MOE_SHAPE_FIELDS = ("n_experts", "d_ff_expert", "n_shared", "every")
# Fields that decide which tokens each step trains on.
DATA_FIELDS = (("train", "seed"), ("train", "global_batch"), ("data", "source"), ("data", "path"),
               ("data", "dtype"), ("data", "seq_len"), ("data", "tokenizer"), ("data", "text_column"),
               ("data", "mixture"), ("data", "eos_id"))
# The data fields only some sources read; for the others a change means nothing.
SOURCE_FIELDS = {"path": ("file", "hf"), "dtype": ("file",), "tokenizer": ("hf",), "text_column": ("hf",),
                 "mixture": ("hf",), "eos_id": ("hf",)}


def check_compatible(cfg: Config, saved: dict, directory, step: int) -> None:
    """Refuse, with the differing fields named, to restore a checkpoint of another model shape."""
    problems = [f"model.{k}={getattr(cfg.model, k)!r} but the checkpoint has {saved['model'][k]!r}"
                for k in SHAPE_FIELDS if saved["model"].get(k) != getattr(cfg.model, k)]
    saved_moe = saved.get("moe", {})  # checkpoints older than the moe section are dense
    problems += [f"moe.{k}={getattr(cfg.moe, k)!r} but the checkpoint has {saved_moe.get(k, getattr(MoEConfig, k))!r}"
                 for k in MOE_SHAPE_FIELDS if saved_moe.get(k, getattr(MoEConfig, k)) != getattr(cfg.moe, k)]
    saved_vocab = padded_vocab(cfg.model, saved["mesh"]["tp"])  # vocab_size itself matched above
    if not problems and saved_vocab != padded_vocab(cfg.model, cfg.mesh.tp):
        problems.append(f"mesh.tp={cfg.mesh.tp} pads model.vocab_size={cfg.model.vocab_size} differently from the "
                        f"checkpoint's mesh.tp={saved['mesh']['tp']} ({saved_vocab} rows); use a tp that pads alike")
    # fp8_delayed keeps amax histories in the state: which sites keep one, and their length, are part of its
    # shape. Compared by the sites the patterns leave in fp8, not by the patterns' spelling (a checkpoint saved
    # under an older default names patterns that matched no site).
    if _fp8_state(saved["precision"], cfg) != _fp8_state(dataclasses.asdict(cfg.precision), cfg):
        problems.append(f"precision.matmul={cfg.precision.matmul!r} (fp8_amax_history={cfg.precision.fp8_amax_history}, "
                        f"fp8_exclude={cfg.precision.fp8_exclude!r}) keeps other fp8 state than the checkpoint's "
                        f"precision.matmul={saved['precision'].get('matmul', 'bf16')!r}")
    # The optimizer decides the state's tree (its moments, Adafactor's factored statistics); checkpoints older
    # than train.optimizer are AdamW's.
    saved_optimizer = saved.get("train", {}).get("optimizer", "adamw")
    if saved_optimizer != cfg.train.optimizer:
        problems.append(f"train.optimizer={cfg.train.optimizer!r} keeps another state than the checkpoint's "
                        f"train.optimizer={saved_optimizer!r}")
    if problems:
        raise ConfigError([f"checkpoint.dir={str(directory)!r} step {step} is another model: {p}; resume with the "
                           f"same model settings or point checkpoint.dir elsewhere" for p in problems])
    if cfg.checkpoint.allow_data_change:
        return
    current = cfg.to_dict()
    sources = {cfg.data.source, saved.get("data", {}).get("source")}
    changed = [(f"{sec}.{k}", current[sec][k], saved[sec][k]) for sec, k in DATA_FIELDS
               if k in saved.get(sec, {}) and saved[sec][k] != current[sec][k]
               and (k not in SOURCE_FIELDS or sources & set(SOURCE_FIELDS[k]))]
    if changed:
        raise ConfigError([f"{name}={now!r} but checkpoint.dir={str(directory)!r} step {step} was trained with "
                           f"{was!r}: the resumed run would train on other batches; set {name}={was!r}, or "
                           f"checkpoint.allow_data_change=true if you mean to change it" for name, now, was in changed])


def keep_saved_schedule(setup: Setup, saved: dict) -> Setup:
    """On resume, the learning-rate schedule stays the checkpoint's unless train.schedule_steps is given:
    a larger train.steps alone would otherwise stretch the cosine and make the rate jump."""
    t = setup.cfg.train
    saved_len = saved["train"].get("schedule_steps") or saved["train"]["steps"]
    if t.schedule_steps or saved_len == t.total_schedule_steps:
        return setup
    if jax.process_index() == 0:
        past = f" (from step {saved_len} on it stays at its final value)" if t.steps > saved_len else ""
        print(f"meshtrain: train.steps={t.steps} but the checkpoint was trained on a {saved_len}-step learning-rate "
              f"schedule: keeping that schedule{past}; set train.schedule_steps={t.steps} to stretch it instead",
              flush=True)
    cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(t, schedule_steps=saved_len))
    return dataclasses.replace(setup, cfg=cfg)


def _fp8_state(precision: dict, cfg: Config) -> tuple | bool:
    """(history length, the model's matmul sites that keep amax histories) of a precision section, or False
    when it keeps none."""
    if precision.get("matmul") != "fp8_delayed":
        return False
    patterns = [p.strip() for p in precision["fp8_exclude"].split(",") if p.strip()]
    sites = [site for site in MATMUL_SITES if cfg.moe.enabled or not site.startswith("moe.")]
    kept = frozenset(site for site in sites if not any(fnmatch.fnmatchcase(site, p) for p in patterns))
    return precision["fp8_amax_history"], kept
