"""One way to run a model: the mesh degrees and the knobs that trade memory for time (`Layout`), and what the
memory and time estimates derive from one alike (tensor-parallel degrees, tokens per device, MoE layers)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from meshtrain.config import Config

AXES = ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by config dtype name


@dataclass(frozen=True)
class Layout:
    """One way to run a model: mesh degrees and the knobs that trade memory for time."""

    degrees: dict[str, int]
    zero_stage: int = 1
    remat: str = "none"
    micro_batch: int = 16  # sequences per microbatch, over all devices
    grad_accum: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # pipeline schedule, used when pp > 1
    virtual_stages: int = 1  # its chunks per stage
    loss: str = "reference"  # model.loss: `fused` holds one token chunk's logits, not all of them

    @classmethod
    def of(cls, cfg: Config) -> "Layout":
        """The layout `cfg` asks for, its pipeline schedule included."""
        return cls({a: getattr(cfg.mesh, a) for a in AXES}, cfg.train.zero_stage, cfg.train.remat,
                   cfg.train.global_batch // cfg.train.grad_accum, cfg.train.grad_accum,
                   cfg.parallel.sequence_parallel, cfg.pipeline.schedule, cfg.pipeline.virtual_stages, cfg.model.loss)

    def overrides(self) -> list[str]:
        """The config overrides that select this layout."""
        return ([f"mesh.{a}={self.degrees[a]}" for a in AXES] +
                [f"train.zero_stage={self.zero_stage}", f"train.remat={self.remat}",
                 f"train.grad_accum={self.grad_accum}",
                 f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}", f"model.loss={self.loss}"]
                + ([f"pipeline.schedule={self.schedule}", f"pipeline.virtual_stages={self.virtual_stages}",
                    "model.scan_layers=true"]  # the stages split the stacked layer axis (a chunk runs it unrolled)
                   if self.degrees["pp"] > 1 else [])
                + (["parallel.cp_impl=allgather"] if self.gathers_kv_in_stages else []))

    @property
    def gathers_kv_in_stages(self) -> bool:
        """Inside a pipeline stage the ring runs on two ranks only (config validation): the planner gathers K/V
        there instead."""
        return self.degrees["pp"] > 1 and self.degrees["cp"] > 2

    def label(self) -> str:
        mesh = " ".join(f"{a}{n}" for a, n in self.degrees.items() if n > 1) or "1 device"
        sp = "+SP" if self.sequence_parallel else ""
        pipe = ""
        if self.degrees["pp"] > 1:
            pipe = f" {self.schedule}" + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        loss = " fused-loss" if self.loss == "fused" else ""
        return f"{mesh}{sp}{pipe} Z{self.zero_stage} {self.remat} mb{self.micro_batch}x{self.grad_accum}{loss}"


def moe_layers(cfg: Config) -> int:
    """Layers whose FFN is a mixture of experts (every `moe.every`-th; none in a dense model)."""
    return _moe_layers(cfg.moe, cfg.model.n_layers)


@functools.lru_cache(maxsize=64)  # the planner asks once per layout it estimates
def _moe_layers(moe, n_layers: int) -> int:
    return sum(moe.is_moe_layer(i) for i in range(n_layers))


def tp_degrees(cfg: Config, lay: Layout) -> tuple[int, int]:
    """(tp, tp over the kv heads): kv heads fewer than tp, or not divided by it, are replicated."""
    tp = lay.degrees["tp"]
    return tp, (tp if cfg.model.n_kv_heads % tp == 0 else 1)


def tokens_per_device(cfg: Config, lay: Layout) -> float:
    """Tokens of one microbatch on a device: sequences over dp, fsdp and ep (outside the experts ep is one more
    data axis), each sequence over cp and sp."""
    g = lay.degrees
    return lay.micro_batch / (g["dp"] * g["fsdp"] * g["ep"]) * cfg.data.seq_len / (g["cp"] * g["sp"])
