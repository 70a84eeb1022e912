"""Typed, frozen configuration: YAML file, then dotted `section.key=value` overrides, then validate().

The config is the user's whole interface, so every mistake is reported as a `ConfigError` that names
the field, the value and the fix, and `validate()` reports every problem at once instead of the first.

  schema.py      the frozen dataclasses (one per section), MESH_AXES, CHECKPOINT_POINTS, MATMUL_SITES, derived
                 values
  presets.py     model presets (`model.preset`)
  loading.py     defaults <- preset <- YAML <- overrides: build_config, load_config, to_yaml, help_text
  from_hf.py     a Hugging Face config.json as model and moe fields, for checkpoint.init_from=hf:DIR
  validation.py  ConfigError and validate(), with the checks of the model and its layout over the mesh
  run_checks.py  validate()'s checks of how the run trains and records (train, precision, data, eval, ...)
  pipeline.py    the pipeline schedule kinds and the rules on their arguments (the schedule builders' too)
  text_sources.py  data.source=hf without its libraries: a source's files, data.mixture's parts, the tokenizer

Outside the package, import `from meshtrain.config import ...` (from_hf's names through meshtrain.hf.config).
Inside, imports point one way: pipeline <- schema <- run_checks <- validation <- from_hf <- loading, presets
and text_sources (which run_checks reads) stand alone; nothing here imports the rest of meshtrain (config
is the ground floor).
"""
from meshtrain.config.loading import (
    all_keys, build_config, cpu_default_overrides, help_text, load_config, to_yaml,
)
from meshtrain.config.presets import LLAMA2, LLAMA3, LLAMA31, PRESETS
from meshtrain.config.schema import (
    CHECKPOINT_POINTS, FP8_EXCLUDE_DEFAULT, MATMUL_SITES, MESH_AXES, REMAT_FIXED, CheckpointConfig, Config,
    DataConfig, DistributedConfig, EvalConfig, MeshConfig, ModelConfig, MoEConfig, ParallelConfig, PipelineConfig,
    PrecisionConfig, RunConfig, TrainConfig,
    fp8_exclude_patterns, padded_vocab, profile_range, remat_parts, runs_plain, tracker_names, with_mesh,
)
from meshtrain.config.run_checks import precision_problems, profile_problems
from meshtrain.config.validation import ConfigError, moe_problems, pipeline_problems, resolve_mesh, validate

__all__ = [
    # schema
    "MESH_AXES", "CHECKPOINT_POINTS", "REMAT_FIXED", "MATMUL_SITES", "FP8_EXCLUDE_DEFAULT", "Config", "MeshConfig",
    "ModelConfig", "MoEConfig",
    "TrainConfig", "DataConfig", "PrecisionConfig", "PipelineConfig", "CheckpointConfig", "EvalConfig",
    "DistributedConfig", "RunConfig", "ParallelConfig",
    "padded_vocab", "fp8_exclude_patterns", "profile_range", "remat_parts", "runs_plain", "tracker_names",
    "with_mesh",
    # presets
    "PRESETS", "LLAMA2", "LLAMA3", "LLAMA31",
    # loading
    "all_keys", "build_config", "load_config", "to_yaml", "help_text", "cpu_default_overrides",
    # validation
    "ConfigError", "validate", "resolve_mesh", "moe_problems", "profile_problems", "precision_problems",
    "pipeline_problems",
]
