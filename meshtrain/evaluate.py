"""`python -m meshtrain.evaluate --checkpoint DIR|hf:DIR [--step N] [section.key=value ...]`

Prints the held-out loss and perplexity of a saved model, computed exactly as during training
(meshtrain/evaluation.py): on the run's eval data (data.eval_path, the data.eval_fraction end of
data.path, or the synthetic corpus's eval stream), or on all of data.path in order when the run held
nothing out. Overrides choose other data (data.eval_path=F), eval.batches, the mesh, ...
"""
from __future__ import annotations


from meshtrain import launch


def describe_data(cfg, split: str) -> str:
    d = cfg.data
    if d.source == "synthetic":
        return "the synthetic corpus's eval stream"
    source = d.path or d.mixture  # data.source=hf may read a mixture
    if split == "eval":
        return d.eval_path if d.eval_path else f"the last {d.eval_fraction:g} of {source}"
    return f"{source} (all of it: the run held out no eval data)"


def main(argv: list[str] | None = None) -> int:
    p = launch.with_overrides(launch.checkpoint_parser("evaluate", __doc__.splitlines()[2].strip()))
    args = p.parse_intermixed_args(argv)

    def body() -> int:
        launch.prepare_devices(args.overrides)  # before jax: the rest of the start-up is inference.load's
        from meshtrain.evaluation import evaluate, make_eval_step
        from meshtrain.inference import load
        from meshtrain.step.state import make_batches

        loaded = load(args.checkpoint, args.overrides, step=args.step)
        cfg = loaded.cfg
        d = cfg.data
        split = "eval" if d.source == "synthetic" or d.eval_path or d.eval_fraction else "all"
        result = evaluate(make_eval_step(loaded.setup), loaded.params, make_batches(loaded.setup, split),
                          cfg.eval.batches)
        at = f" step {loaded.step}" if loaded.step is not None else ""
        print(f"evaluate: {args.checkpoint}{at} on {describe_data(cfg, split)}: {cfg.eval.batches} batches of "
              f"{cfg.train.global_batch} x {d.seq_len}, {result['eval_tokens']:,} tokens", flush=True)
        print(f"eval loss {result['eval_loss']:.6f}  perplexity {result['eval_ppl']:.4f}", flush=True)
        return 0

    return launch.guarded(body)


if __name__ == "__main__":
    launch.program(main)
