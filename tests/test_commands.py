"""The `meshtrain` command: `meshtrain <command>` (the console script) and `python -m meshtrain <command>` run
`python -m meshtrain.<command>`; without a command, the list."""
import importlib
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import cli_env
from meshtrain.__main__ import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def python_m(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], env=cli_env(), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_the_list_names_every_command():
    proc = python_m("meshtrain")
    assert proc.returncode == 0, proc.stderr
    for name in COMMANDS:
        assert f"meshtrain {name} " in proc.stdout, name


def test_a_subcommand_is_its_module():
    via_meshtrain, direct = python_m("meshtrain", "run", "--help"), python_m("meshtrain.run", "--help")
    assert via_meshtrain.returncode == 0, via_meshtrain.stderr
    assert "train.optimizer" in via_meshtrain.stdout
    assert via_meshtrain.stdout == direct.stdout


def test_an_unknown_command_is_one_line_and_the_list():
    proc = python_m("meshtrain", "trian")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("meshtrain: unknown command 'trian'\n") and "meshtrain run " in proc.stderr


def test_console_script_and_commands_resolve():
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["meshtrain"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    for name in COMMANDS:  # each runs as `python -m meshtrain.<name>` (a module, or a package's __main__)
        spec = importlib.util.find_spec(f"meshtrain.{name}")
        assert spec is not None and (spec.submodule_search_locations is None
                                     or importlib.util.find_spec(f"meshtrain.{name}.__main__")), name
