"""Messages of the first hour that pointed the wrong way; each test fails on the message it replaced."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshtrain.config import ConfigError, build_config
from meshtrain.data import check_token_files

ROOT = Path(__file__).resolve().parents[1]


def test_a_wrong_data_dtype_says_set_data_dtype(tmp_path):
    """A uint16 file read as uint32 pairs its ids into millions: it said "set model.vocab_size to at least 14811293"."""
    path = tmp_path / "tokens.bin"
    (np.arange(4000) % 200 + 26).astype(np.uint16).tofile(path)
    data = build_config({}, ["data.source=file", f"data.path={path}", "data.dtype=uint32"]).data
    (problem,) = check_token_files(data, 256)
    assert problem.endswith("read as uint16 its ids fit: set data.dtype=uint16") and "vocab_size to at least" not in problem
    too_big = build_config({}, ["data.source=file", f"data.path={path}", "data.dtype=uint16"]).data
    (problem,) = check_token_files(too_big, 100)  # really too large for the vocabulary: the vocab_size advice stays
    assert "set model.vocab_size to at least 226" in problem


def test_export_of_an_hf_directory_says_what_to_do_instead(tmp_path):
    from meshtrain.export import export

    with pytest.raises(ConfigError, match=r"this already is one; to export a fine-tune of it, train with "
                                          r"checkpoint.init_from=hf:"):
        export(f"hf:{tmp_path}", tmp_path / "out")


def run_compare(tmp_path, steps_a, steps_b):
    for name, steps in (("a", steps_a), ("b", steps_b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps(dict(step=s, loss=5.0 - s / 100, step_time_s=0.1)) + "\n" for s in steps))
    return subprocess.run([sys.executable, "scripts/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--after", "0"], cwd=ROOT, capture_output=True, text=True)


def test_compare_runs_of_different_length_compares_the_common_steps(tmp_path):
    proc = run_compare(tmp_path, range(10, 101, 10), range(10, 51, 10))
    assert proc.returncode == 0, proc.stderr
    assert "losses equal within rtol on the 5 steps every run logged" in proc.stdout
    assert "NOT" not in proc.stdout


def test_launch_local_without_a_gpu_names_run_cpu_devices():
    proc = subprocess.run(["bash", "scripts/launch_local.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})  # no nvidia-smi
    assert proc.returncode == 2 and "run.cpu_devices" in proc.stderr


def test_generate_warns_past_the_trained_length_and_announces_long_decodes():
    """It sampled 100000 tokens past a 64-token training length without a word (and, before meshtrain.signals,
    without heeding Ctrl-C)."""
    from meshtrain.generate import length_notes

    assert length_notes(10, 32, 64, 1) == []
    warning, long = length_notes(10, 2000, 64, 2)
    assert "= 2010 tokens, past the 64 the model was trained on (data.seq_len)" in warning
    assert long.startswith("sampling 2000 tokens for 2 prompt(s)") and "Ctrl-C" in long
