"""Trackers: where every logged record goes besides metrics.jsonl (run.tracker, a comma list).

One small interface. A tracker records the run's config and its start-up banner when it opens, then
metrics.MetricsLog calls `log` once per logged record with its numbers named `train/<key>` or
`eval/<key>`, and `close` at the end, saying whether the run failed. Trackers live on the process that
writes metrics (process 0) only: every process computes the same numbers, and one W&B run per process
would be N copies.

  tensorboard  events in <run.dir>/tensorboard (tensorboardX)
  wandb        a Weights & Biases run; WANDB_MODE=offline keeps it on disk (`wandb sync` uploads it later)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Protocol

from meshtrain.config import Config, ConfigError, to_yaml, tracker_names


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


def open_trackers(cfg: Config, banner: str, *, resumed: bool) -> list[Tracker]:
    """The trackers run.tracker names (validate() checked the names and their packages), opened."""
    kinds = {"tensorboard": TensorBoard, "wandb": WandB}
    opened: list[Tracker] = []
    try:
        for name in tracker_names(cfg.run):
            opened.append(kinds[name](cfg, banner, resumed=resumed))
    except BaseException:
        for t in opened:
            t.close(failed=True)
        raise
    return opened


class TensorBoard:
    def __init__(self, cfg: Config, banner: str, *, resumed: bool):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(Path(cfg.run.dir) / "tensorboard"))
        # Text summaries render as Markdown: indented by four spaces they stay preformatted.
        indent = lambda text: "\n".join("    " + line for line in text.splitlines())  # noqa: E731
        self.writer.add_text("config", indent(to_yaml(cfg)))
        if banner:
            self.writer.add_text("banner", indent(banner))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandB:
    """A W&B run: the config as its config, the banner in its summary and as banner.txt among its files.

    project, name and directory: the run.wandb_* field, else W&B's own variable (WANDB_PROJECT, WANDB_NAME,
    WANDB_DIR), else meshtrain's default. WANDB_MODE (online, offline, disabled) is W&B's to read. A resumed
    meshtrain run continues the W&B run whose id <run.dir>/wandb_run_id holds."""

    def __init__(self, cfg: Config, banner: str, *, resumed: bool):
        import wandb

        r = cfg.run
        directory = Path(r.wandb_dir or os.environ.get("WANDB_DIR") or r.dir)
        directory.mkdir(parents=True, exist_ok=True)
        id_file = Path(r.dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=r.wandb_project or os.environ.get("WANDB_PROJECT") or "meshtrain",
                name=r.wandb_name or os.environ.get("WANDB_NAME") or Path(r.dir).resolve().name,
                dir=str(directory), config=cfg.to_dict(), id=run_id, resume="allow" if run_id else None)
        except Exception as e:  # no login for an online run, a server that refuses it: say so, not a traceback
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"run.tracker=wandb: W&B could not start a run ({reason}); log in (`wandb login` or "
                              f"WANDB_API_KEY), or set WANDB_MODE=offline to keep the run on disk and `wandb sync` "
                              f"it later") from None
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id)
        if banner:
            self.run.summary["banner"] = banner
            # The run's files directory: W&B keeps (and uploads) what is written there with the run.
            Path(self.run.dir, "banner.txt").write_text(banner + "\n")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
