"""What a pipeline schedule accepts, checked in pure Python: the schedule kinds and the rules on their
arguments. Both `validate()` (config keys) and the schedule builders (step/pipeline/schedules.py) and the
`meshtrain.schedule` command (its flags) check through here, each naming the arguments its own way."""
from __future__ import annotations

from typing import Literal, get_args

Kind = Literal["afab", "1f1b", "interleaved", "zb_h1", "dualpipe_v"]
KINDS: tuple[str, ...] = get_args(Kind)
# The train.remat policies that recompute no matmul: chosen for speed, so the last chunk may keep everything.
KEEPS_EVERY_MATMUL = ("none", "save_dots", "save_dots_attn")


def last_chunk_remat(setting: str, train_remat: str) -> str:
    """The remat policy of a pipeline's last chunk: `pipeline.last_chunk_remat` with `auto` decided.

    The other chunks keep what train.remat saves in the stage's stash from F until B, several microbatches at a
    time, and pay for it in HBM traffic too (on an H100, llama1b's half at remat none: F 8.8 ms, against 6.8 with
    save_dots_attn, whose backward reruns the cheap elementwise work instead). The last chunk's F and B run back
    to back in one op (step/pipeline/ops.py), so there keeping everything costs one chunk's activations for the
    length of that op, and saves the rerun (its op: 21.6 ms with save_dots_attn, 20.8 with none). A policy that
    recomputes matmuls was chosen to fit memory, and stays. A union (p+q) keeps every matmul where a part does."""
    if setting != "auto":
        return setting
    return "none" if any(part in KEEPS_EVERY_MATMUL for part in train_remat.split("+")) else train_remat


def validate_args(kind: str, n_stages: int, n_microbatches: int, virtual_stages: int = 1,
                  names: dict[str, str] | None = None) -> list[str]:
    """Problems with these arguments, one line each naming the argument as `names` spells it
    (e.g. a CLI flag or a config key), its value and the fix. Empty when make_schedule works."""
    n = {"kind": "kind", "n_stages": "n_stages", "n_microbatches": "n_microbatches",
         "virtual_stages": "virtual_stages", **(names or {})}
    p, m, v = n_stages, n_microbatches, virtual_stages
    problems = []
    if kind not in KINDS:
        problems.append(f"{n['kind']}={kind!r}: unknown schedule; choose one of {', '.join(KINDS)}")
    for key, value in (("n_stages", p), ("n_microbatches", m), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{n[key]}={value!r}: must be an integer >= 1")
    if problems:
        return problems
    if m < p:
        problems.append(f"{n['n_microbatches']}={m}: fewer microbatches than pipeline stages "
                        f"({n['n_stages']}={p}) leaves stages with nothing to run; use at least {p}")
    elif kind == "interleaved" and m % p:
        problems.append(f"{n['n_microbatches']}={m}: the interleaved schedule sends microbatches "
                        f"round the stages in groups of {n['n_stages']}={p}; use a multiple of {p} "
                        f"({m - m % p} or {m - m % p + p})")
    elif kind == "dualpipe_v" and m < 2 * p:
        problems.append(f"{n['n_microbatches']}={m}: dualpipe_v needs two microbatches per stage "
                        f"({n['n_stages']}={p}) to fill both arms of its V; use at least {2 * p}")
    if kind == "dualpipe_v" and v != 2:
        problems.append(f"{n['virtual_stages']}={v}: dualpipe_v holds two chunks per stage (the arms "
                        f"of its V); use {n['virtual_stages']}=2")
    elif v > 1 and kind not in ("interleaved", "dualpipe_v"):
        problems.append(f"{n['virtual_stages']}={v}: only the interleaved and dualpipe_v schedules run "
                        f"several chunks per stage; use {n['kind']}=interleaved or {n['virtual_stages']}=1")
    return problems
