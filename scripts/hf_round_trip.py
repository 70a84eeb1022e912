"""Live Hugging Face round trip: start a run from a HF directory, train, export, load the export with
`transformers.AutoModelForCausalLM.from_pretrained`, and compare its fp32 logits with meshtrain's.

    PYTHONPATH=. python scripts/hf_round_trip.py --out results/hf_round_trip [--fixture tests/fixtures/hf/llama31_tied]
        [section.key=value ...]      # e.g. --fixture tests/fixtures/hf/mixtral mesh.dp=1 mesh.ep=2

Needs torch and transformers (the GPU machine has both; CI does not, and checks the pieces against
stored fixtures instead). Runs on whatever jax finds: every visible GPU, or 8 simulated CPU devices.
Writes result.json and prints a table last; exits 1 if the logits differ by more than 1e-4.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4


def round_trip(work: Path, fixture: Path, steps: int = 3, overrides: tuple[str, ...] = ()) -> dict:
    from meshtrain import run
    run_dir = work / "run"
    rc = run.main([f"checkpoint.init_from=hf:{fixture}", f"train.steps={steps}", f"checkpoint.every={steps}",
                   "train.global_batch=8", "data.seq_len=32", "precision.compute=float32", "train.log_every=1",
                   "train.lr=1e-2", "train.warmup_steps=0", "run.progress=false", f"run.dir={run_dir}", *overrides])
    if rc != 0:
        raise RuntimeError(f"training from {fixture} failed with exit status {rc}")

    import jax
    import numpy as np
    import torch
    import transformers

    from meshtrain.export import export
    from meshtrain.inference import forward_logits, load

    exported = work / "exported"
    step, files = export(str(run_dir), exported)
    tokens = np.load(fixture / "reference.npz")["tokens"]
    loaded = load(str(run_dir), ["precision.compute=float32"])
    # An MoE model's expert dispatch needs whole rows on every batch shard (dp, fsdp, ep): repeat the rows.
    shape = loaded.setup.mesh.shape
    copies = -(-shape["dp"] * shape["fsdp"] * shape["ep"] // len(tokens))
    ours = np.asarray(forward_logits(loaded.setup, loaded.params, np.tile(tokens, (copies, 1))))[: len(tokens)]
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    untrained = np.load(fixture / "reference.npz")["logits"]
    return dict(fixture=str(fixture), step=step, files=files, device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
                max_abs_diff=float(np.abs(ours - theirs).max()), max_abs_logit=float(np.abs(theirs).max()),
                moved_by_training=float(np.abs(theirs - untrained).max()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixture", default=str(ROOT / "tests" / "fixtures" / "hf" / "llama31_tied"))
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="for the training run (the mesh, ...)")
    args = ap.parse_intermixed_args()  # overrides may stand before and after the options
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    result = round_trip(out, Path(args.fixture), overrides=tuple(args.overrides))
    result["seconds"] = time.time() - start
    result["ok"] = result["max_abs_diff"] <= TOLERANCE and result["moved_by_training"] > 1e-3
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n| fixture | device | step | max |logit| | max |meshtrain - transformers| | moved by training | ok |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {Path(result['fixture']).name} | {result['device']} | {result['step']} | {result['max_abs_logit']:.3f} | "
          f"{result['max_abs_diff']:.2e} | {result['moved_by_training']:.3f} | {result['ok']} |")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
