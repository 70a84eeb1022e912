"""Loading: defaults <- model preset <- YAML file <- dotted `section.key=value` overrides, each value
coerced to its field's type; unknown keys get a suggestion; renamed keys are read under their new names
for one release. Also the YAML dump and the --help listing.
"""
from __future__ import annotations

import ast
import difflib
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from meshtrain.config.from_hf import apply_hf_values, hf_dir
from meshtrain.config.presets import PRESETS
from meshtrain.config.schema import Config, ModelConfig, RunConfig
from meshtrain.config.validation import ConfigError

# Old spelling -> new key. The old one is still read, with a note on stderr, until the next release.
RENAMED = {
    "mesh.sequence_parallel": "parallel.sequence_parallel",
    "mesh.fsdp_combine_mib": "parallel.fsdp_combine_mib",
    "model.tp_overlap": "parallel.tp_overlap",
    "model.cp_impl": "parallel.cp_impl",
    "model.cp_layout": "parallel.cp_layout",
}


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _section_types().items() for f in fields(cls)]


def _unknown(key: str, candidates: list[str], where: str, renamed: dict[str, str] | None = None) -> str:
    renamed = renamed or {}  # a near miss of an old spelling suggests the new key
    close = difflib.get_close_matches(key, candidates + list(renamed), n=1, cutoff=0.5)
    hint = f"did you mean '{renamed.get(close[0], close[0])}'?" if close else f"valid keys: {', '.join(candidates)}"
    return f"unknown config key '{where}': {hint}"


def _renamed(values: dict[str, Any], text: dict[str, str], noted: set[str]) -> list[str]:
    """Move the old spellings in one layer (the file, or the overrides) to their new keys, in place; a later
    layer still overrides an earlier one. Both spellings in one layer is a problem: which one was meant?"""
    problems = []
    for old, new in RENAMED.items():
        if old not in values:
            continue
        raw = values.pop(old)
        if new in values:
            problems.append(f"{old} and {new} are both given: {old} is the old spelling of {new}; keep only {new}")
            continue
        values[new] = raw
        if old in text:
            text[new] = text.pop(old)
        if old not in noted:
            noted.add(old)
            print(f"config: {old} is now {new} (the old spelling is accepted until the next release)", file=sys.stderr)
    return problems


def _old_tensorboard(values: dict[str, Any], text: dict[str, str], noted: set[str]) -> list[str]:
    """run.tensorboard=true, the old switch, is read as `tensorboard` added to run.tracker of the same layer (a
    note on stderr) until the next release; false says nothing. Saved checkpoints' configs carry it too."""
    if "run.tensorboard" not in values:
        return []
    try:
        on = _coerce("run.tensorboard", values.pop("run.tensorboard"), bool)
    except ConfigError as e:
        return e.problems
    if on:
        given = str(text.get("run.tracker", values.get("run.tracker")) or "")
        values["run.tracker"] = ",".join(dict.fromkeys([t.strip() for t in given.split(",") if t.strip()]
                                                       + ["tensorboard"]))
        text.pop("run.tracker", None)
        if "run.tensorboard" not in noted:
            noted.add("run.tensorboard")
            print("config: run.tensorboard=true is now run.tracker=tensorboard (a comma list: tensorboard,wandb; the "
                  "old switch is accepted until the next release)", file=sys.stderr)
    return []


def _coerce(key: str, raw: Any, tp: Any) -> Any:
    """Turn a YAML/CLI value into the field's declared type, or raise ConfigError naming the key."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        value = str(raw) if not isinstance(raw, str) else raw
        if value not in choices:
            raise ConfigError(f"{key}={raw!r}: must be one of {', '.join(map(str, choices))}")
        return value
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: must be true or false")
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r}: must be an integer")
        try:
            f = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r}: must be an integer") from None
        if not f.is_integer():
            raise ConfigError(f"{key}={raw!r}: must be an integer")
        return int(f)
    if tp is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r}: must be a number") from None
    if tp is str:
        return "" if raw is None else str(raw)
    raise TypeError(f"unsupported config field type {tp} for {key}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's comment in the schema's source, as one line: the comment on its own line, else the
    comment block right above it (a field without either is missing from the dict)."""
    lines = inspect.getsource(cls).splitlines()
    body = ast.parse(textwrap.dedent("\n".join(lines))).body[0].body
    docs = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        row = node.lineno - 1
        _, hash_, trailing = _code_and_comment(lines[row])
        above = []
        for prev in reversed(lines[:row]):
            if not prev.strip().startswith("#"):
                break
            above.insert(0, prev.strip()[1:].strip())
        text = trailing.strip() if hash_ else " ".join(above)
        if text:
            docs[node.target.id] = text
    return docs


def _code_and_comment(line: str) -> tuple[str, str, str]:
    """Split off a trailing comment, ignoring a # inside a string literal."""
    for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
        if tok.type == tokenize.COMMENT:
            code, hash_, comment = line.strip().partition(tok.string)
            return code, "#", tok.string[1:]
    return line, "", ""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _parse_cli_value(text: str) -> Any:
    # YAML parsing gives `1e-3` -> float, `true` -> bool, `[1,2]` -> list, and leaves words as str.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def build_config(file_values: dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- model preset <- YAML mapping <- `section.key=value` overrides. Collects all errors."""
    flat: dict[str, Any] = {}
    cli_text: dict[str, str] = {}  # override text as typed: string fields take it verbatim
    problems: list[str] = []
    sections = _section_types()
    for section, values in (file_values or {}).items():
        if section not in sections:
            problems.append(_unknown(str(section), list(sections), str(section)))
            continue
        if values is None:  # a section whose keys are all commented out
            continue
        if not isinstance(values, dict):
            problems.append(f"config section '{section}' must be a mapping of key: value, got {values!r}")
            continue
        for k, v in values.items():
            flat[f"{section}.{k}"] = v
    noted: set[str] = set()
    problems.extend(_renamed(flat, {}, noted) + _old_tensorboard(flat, {}, noted))
    cli: dict[str, Any] = {}
    for item in overrides or []:
        if "=" not in item:
            problems.append(f"override '{item}' must look like section.key=value (e.g. train.steps=10)")
            continue
        k, v = item.split("=", 1)
        cli[k.strip()] = _parse_cli_value(v)
        cli_text[k.strip()] = v
    problems.extend(_renamed(cli, cli_text, noted) + _old_tensorboard(cli, cli_text, noted))
    flat.update(cli)

    # The preset first, so that explicit model fields override it.
    preset = flat.get("model.preset", ModelConfig.preset)
    model_values: dict[str, Any] = {}
    if str(preset) not in PRESETS:
        problems.append(f"model.preset={preset!r}: unknown preset; choose one of {', '.join(PRESETS)}")
    else:
        model_values.update(PRESETS[str(preset)])

    per_section: dict[str, dict[str, Any]] = {s: {} for s in sections}
    per_section["moe"].update(model_values.pop("moe", {}))
    per_section["model"].update(model_values)
    valid = all_keys()
    for key, raw in flat.items():
        section, _, name = key.partition(".")
        if key not in valid:
            problems.append(_unknown(key, valid, key, RENAMED))
            continue
        tp = _field_types(sections[section])[name]
        if tp is str and key in cli_text:
            raw = cli_text[key]  # YAML would turn `run.dir=010` into 8 and `host=10:30` into 630
        try:
            per_section[section][name] = _coerce(key, raw, tp)
        except ConfigError as e:
            problems.extend(e.problems)
    # A Hugging Face model decides the shape: its config.json goes over the preset (from_hf.py).
    if str(per_section["checkpoint"].get("init_from", "")).startswith("hf:"):
        named = [(k, *k.split(".", 1)) for k in flat if k in valid and k.startswith(("model.", "moe."))]
        explicit = {k: per_section[s][f] for k, s, f in named if f in per_section[s]}
        problems.extend(apply_hf_values(per_section, explicit, hf_dir(per_section["checkpoint"]["init_from"])))
    # Read before jax starts (run.py simulates the CPU devices), so it cannot wait for validate().
    cpu_devices = per_section["run"].get("cpu_devices", RunConfig.cpu_devices)
    if cpu_devices < 1:
        problems.append(f"run.cpu_devices={cpu_devices}: must be >= 1")
    elif cpu_devices > MAX_CPU_DEVICES:  # XLA would spend minutes to hours creating 100000 of them
        problems.append(f"run.cpu_devices={cpu_devices}: must be <= {MAX_CPU_DEVICES} (simulated CPU devices; "
                        f"a larger mesh is for real accelerators)")
    if problems:
        raise ConfigError(problems)
    return Config(**{s: sections[s](**per_section[s]) for s in sections})


MAX_CPU_DEVICES = 512


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    file_values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file; configs/ holds the shipped ones")
        try:
            file_values = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            detail = " ".join(str(e).split())  # one line per problem, as everywhere
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({detail})") from None
        if not isinstance(file_values, dict):
            raise ConfigError(f"--config {str(path)!r}: top level must be a mapping of sections")
    return build_config(file_values, overrides)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def help_text(machine_defaults: list[str] | None = None, why: str = "") -> str:
    """Every key on one line: its type, the default that applies and what it does (its comment in the schema).
    `machine_defaults` (overrides such as the CPU run's) replace the dataclass default, which is then named
    beside it with `why`."""
    applied = build_config({}, machine_defaults or [])
    lines = []
    for section, cls in _section_types().items():
        types_, docs = _field_types(cls), field_docs(cls)
        for f in fields(cls):
            default, here = f.default, getattr(getattr(applied, section), f.name)
            tp = types_[f.name]
            kind = "|".join(map(str, get_args(tp))) if get_origin(tp) is Literal else tp.__name__
            note = f" ({why}; {default!r} otherwise)" if here != default else ""
            doc = f" -- {docs[f.name]}" if f.name in docs else ""
            lines.append(f"  {section + '.' + f.name:<30} {kind:<24} default {here!r}{note}{doc}")
    return "\n".join(lines)


def cpu_default_overrides() -> list[str]:
    """The embedded default on a CPU-only machine: 8 simulated devices as dp=2, fsdp=2, tp=2."""
    return ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.steps=60", "train.log_every=5"]
