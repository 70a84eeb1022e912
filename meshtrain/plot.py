"""`python -m meshtrain.plot RUN_DIR [RUN_DIR ...] --out F.png [--width PX] [--height PX]`

Draws panels against step from each run's metrics.jsonl, the runs overlaid in one colour each:
training loss (solid) with eval loss (dashed markers), tokens/s, and, where the backend reported it (a
GPU; a CPU reports none), device memory in use and its peak. Needs matplotlib (`pip install -e ".[plot]"`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DPI = 100
PANELS = ("loss", "tokens/s", "memory (GiB)")


def read_metrics(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, eval records) of `run_dir`/metrics.jsonl, each sorted by step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a run.dir?)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    evals = sorted((r for r in records if "eval_loss" in r), key=lambda r: r["step"])
    return train, evals


def plot_runs(run_dirs: list[str], out: str | Path, *, width: int = 1200, height: int = 900):
    """Write the PNG (`width` x `height` pixels) and return the matplotlib Figure."""
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    runs = [read_metrics(run_dir) for run_dir in run_dirs]
    memory = any("mem_gib" in r or "peak_mem_gib" in r for train, _ in runs for r in train)
    panels = PANELS if memory else PANELS[:2]  # no empty memory panel for CPU runs
    fig, axes = plt.subplots(len(panels), 1, figsize=(width / DPI, height / DPI), dpi=DPI, sharex=True)
    for i, (run_dir, (train, evals)) in enumerate(zip(run_dirs, runs)):
        color = f"C{i % 10}"
        name = Path(run_dir).resolve().name
        steps = [r["step"] for r in train]
        dots = "." if len(train) < 50 else None  # a short run is a few points: show them
        axes[0].plot(steps, [r["loss"] for r in train], color=color, marker=dots, label=f"{name} train")
        if evals:
            axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], color=color, linestyle="--",
                         marker="o", label=f"{name} eval")
        timed = [r for r in train if not r.get("includes_compile")]  # the compiling interval is no throughput
        axes[1].plot([r["step"] for r in timed], [r["tokens_per_s"] for r in timed], color=color, marker=dots,
                     label=name)
        for key, style in (("mem_gib", "-"), ("peak_mem_gib", ":")):
            have = [r for r in train if key in r]
            if have and memory:
                axes[2].plot([r["step"] for r in have], [r[key] for r in have], color=color, linestyle=style,
                             label=f"{name} {'peak' if key.startswith('peak') else 'in use'}")
    for ax, title in zip(axes, panels):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not reported", transform=ax.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshtrain.plot", description=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--width", type=int, default=1200, help="pixels")
    p.add_argument("--height", type=int, default=900, help="pixels")
    args = p.parse_args(argv)
    try:
        plot_runs(args.runs, args.out, width=args.width, height=args.height)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print('error: plotting needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    print(f"plot: {', '.join(args.runs)} -> {args.out} ({args.width} x {args.height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
