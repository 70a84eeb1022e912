"""`python -m meshtrain.export --checkpoint DIR [--step N] --out OUT [--dtype float32|bfloat16|float16]`

Writes a Hugging Face directory (Llama, OLMoE or Mixtral: the architecture that computes what the run's
model computes, meshtrain/hf/config.py): config.json (transformers 5's `rope_parameters` and 4's
`rope_theta`/`rope_scaling`), the weights as safetensors (split into several files with an index past
--max-shard-gb), the vocabulary padding removed, and the tokenizer files of the Hugging Face model the
run started from, if any. `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads it. The
parameters are restored into host memory (a CPU device), never onto the accelerators.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from meshtrain import launch
from meshtrain.config import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
# What the source model says beyond the function meshtrain trained (a sliding window is only accepted where it
# covers the sequence, so it changed nothing and still describes the model).
KEPT_FROM_SOURCE = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "sliding_window",
                    "router_aux_loss_coef")


def export(source: str, out: Path, *, step: int | None = None, dtype: str = "float32",
           max_shard_bytes: int = 5 << 30) -> tuple[int, list[str]]:
    """Export checkpoint `step` (default: latest) of `source` to `out`; returns (step, files written)."""
    import jax

    from meshtrain.config import build_config, padded_vocab, validate, with_mesh
    from meshtrain.hf.config import architecture, config_json, hf_dir
    from meshtrain.hf.weights import hf_tensors, save_tensors
    from meshtrain.inference import saved_run, with_vocab_rows
    from meshtrain.mesh import build_mesh
    from meshtrain.step.state import abstract_params, build_setup

    if source.startswith("hf:"):
        raise ConfigError(f"--checkpoint {source!r}: export writes a meshtrain run as a Hugging Face directory, and "
                          f"this already is one; to export a fine-tune of it, train with checkpoint.init_from={source} "
                          f"and export that run directory")
    asked = step
    ckpt, step, saved = saved_run(source, step)
    try:  # closed on every way out (inference.load says why)
        values = {k: v for k, v in saved.items() if k not in ("mesh", "distributed", "checkpoint")}
        cfg = build_config(values, ["mesh.fsdp=1"])
        architecture(cfg.model, cfg.moe)  # a model no Hugging Face class computes: say so before reading it
        degrees = validate(cfg, 1)
        setup = build_setup(with_mesh(cfg, degrees), build_mesh(degrees, jax.devices("cpu")[:1]))
        # The saved rows of the vocabulary-sized tensors are padded for the tp it was trained with.
        setup = with_vocab_rows(setup, padded_vocab(cfg.model, saved["mesh"]["tp"]))
        params, step = ckpt.restore_params_verified(step, abstract_params(setup), fall_back=asked is None)
        params = jax.device_get(params)
    finally:
        ckpt.close()

    out.mkdir(parents=True, exist_ok=True)
    files = save_tensors(hf_tensors(params, cfg.model, dtype, moe=cfg.moe), out, max_shard_bytes)
    source_dir = hf_dir(saved.get("checkpoint", {}).get("init_from", ""))
    extra = {}
    if source_dir is not None and (source_dir / "config.json").is_file():
        src = json.loads((source_dir / "config.json").read_text())
        extra = {k: src[k] for k in KEPT_FROM_SOURCE if k in src}
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file():
                shutil.copy2(source_dir / name, out / name)
                files.append(name)
    (out / "config.json").write_text(json.dumps(config_json(cfg.model, cfg.moe, dtype=dtype, extra=extra), indent=2)
                                     + "\n")
    files.append("config.json")
    readable(out, files)
    return step, files


def readable(out: Path, files: list[str]) -> None:
    """The files get the mode any new file gets here (0644 under the usual umask): the safetensors writer
    leaves 0600, which other users and a model server running as another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for name in files:
        os.chmod(out / name, 0o666 & ~umask)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshtrain.export", description=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a meshtrain run directory or its checkpoints/")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of at most this")
    args = p.parse_args(argv)

    def body() -> int:
        launch.prepare_devices([])  # before jax (the parameters go to one CPU device either way)
        step, files = export(args.checkpoint, Path(args.out), step=args.step, dtype=args.dtype,
                             max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
        print(f"export: step {step} of {args.checkpoint} -> {args.out}: {', '.join(files)}", flush=True)
        return 0

    return launch.guarded(body)


if __name__ == "__main__":
    launch.program(main)
