"""The memory estimate (backend "gpu", as the guard and the planner use it on GPUs) against peaks measured on GPUs.

Each row is a config as it ran, with the allocator's peak per device measured on H200s (jax 0.11.2): XLA:GPU's own
memory_analysis() peak of the same compiled steps equalled it (38.25, 17.43, 118.6 GiB for the first three rows then).
The pp=2 rows are XLA:GPU's memory_analysis() peaks on H100s (2026-11-27, jax 0.11.2, `docs/results/2026-11-27g_*`),
17.59 GiB where the last chunk keeps everything (pipeline.last_chunk_remat=auto), 17.43-17.46 where it did not.
Three more layouts ran out of memory at 0.95 of an H200 (134 GiB): the estimate must put them above what they had.
Sources: docs/PERFORMANCE.md, 2026-11-27 (the planner and the memory estimate against four H200s:
`scripts/bench_plan.py --set calibration` and `--plan-top 3`; the OLMoE row from "OLMoE at ep=2"), and 2026-11-28
for configs/llama3_8b_2xh200.yaml (the allocator's peak in `scripts/bench_step.py`; an out-of-memory error for
7 sequences a GPU). Pure
arithmetic: nothing is compiled here.
"""
from __future__ import annotations

import pytest

from meshtrain.config import load_config, resolve_mesh, with_mesh
from meshtrain.planning.memory import run_estimate
from meshtrain.resolve import resolve

GIB = 2.0**30
LLAMA1B, LLAMA8B, OLMOE = "configs/llama1b_h100.yaml", "configs/llama3_8b_fsdp.yaml", "configs/olmoe_1b7b_ep2.yaml"
LLAMA8B_2X = "configs/llama3_8b_2xh200.yaml"
PP2 = ["mesh.pp=2", "mesh.fsdp=1", "pipeline.schedule=1f1b", "train.grad_accum=8", "model.scan_layers=true",
       "train.remat=save_dots_attn"]  # the config's policy when these were measured
B8 = ["train.global_batch=8"]
PLAIN_LOSS = ["model.loss=reference"]

# (config, overrides, devices, measured peak GiB per device)
MEASURED = {
    "1.36B config, 1 GPU": (LLAMA1B, [], 1, 42.0),  # 2026-11-28, the norms' outputs kept (38.25 without)
    "1.36B config, pp=2 1f1b, 8 microbatches": (LLAMA1B, PP2, 2, 17.59),
    "1.36B config, pp=2 1f1b, the last chunk as the rest": (
        LLAMA1B, PP2 + ["pipeline.last_chunk_remat=save_dots_attn"], 2, 17.46),
    "1.36B config, pp=2 1f1b, remat none": (LLAMA1B, PP2 + ["train.remat=none"], 2, 23.29),
    "Llama-3-8B config, fsdp=2, 4 sequences a GPU": (LLAMA8B, B8, 2, 118.62),
    "Llama-3-8B fsdp=2 ZeRO-3 save_dots": (LLAMA8B, B8 + ["train.remat=save_dots"], 2, 114.56),
    "Llama-3-8B fsdp=2 ZeRO-3, 2 microbatches": (LLAMA8B, B8 + ["train.grad_accum=2"], 2, 107.90),
    "Llama-3-8B fsdp=2 ZeRO-3 remat none, 4 microbatches": (LLAMA8B, B8 + ["train.remat=none", "train.grad_accum=4"], 2,
                                                            116.0),
    "Llama-3-8B tp=2 ZeRO-0 remat none, 4 microbatches": (
        LLAMA8B, B8 + ["train.remat=none", "train.grad_accum=4", "mesh.fsdp=1", "mesh.tp=2", "train.zero_stage=0"],
        2, 118.0),
    "OLMoE-1B-7B config, ep=2": (OLMOE, [], 2, 65.8),
    # 2026-11-26 (docs/PERFORMANCE.md, "Four H200s"): the config's layout on four GPUs, scanned
    "Llama-3-8B config, fsdp=4, 4 sequences a GPU": (LLAMA8B, [], 4, 91.9),
    "Llama-3-8B config, fsdp=4, 6 sequences a GPU": (LLAMA8B, ["train.global_batch=24"], 4, 121.2),
    # 2026-11-28 (docs/PERFORMANCE.md, "Llama-3-8B on two H200s"): unrolled, ZeRO along the rows
    "Llama-3-8B 2xH200, 5 sequences a GPU, plain loss": (LLAMA8B_2X, PLAIN_LOSS + ["train.global_batch=10"], 2, 127.2),
    "Llama-3-8B 2xH200, 4 sequences a GPU, plain loss": (LLAMA8B_2X, PLAIN_LOSS + B8, 2, 112.8),
    # 2026-11-28 (docs/PERFORMANCE.md, "Llama-3-8B on two H200s at 60% MFU"): the loss by token chunks
    "Llama-3-8B 2xH200 config, 6 sequences a GPU": (LLAMA8B_2X, [], 2, 127.2),  # 128.6 before RoPE's own backward
    "Llama-3-8B 2xH200 config, 5 sequences a GPU": (LLAMA8B_2X, ["train.global_batch=10"], 2, 118.4),
}


# (config, overrides, devices): out of memory at run.gpu_memory_fraction=0.95 of an H200
RAN_OUT = {
    "Llama-3-8B fsdp=2 ZeRO-1, 4 sequences a GPU": (LLAMA8B, B8 + ["train.zero_stage=1"], 2),
    "Llama-3-8B fsdp=2 ZeRO-2, 4 sequences a GPU": (LLAMA8B, B8 + ["train.zero_stage=2"], 2),
    "Llama-3-8B 2xH200 config, 7 sequences a GPU, Adam's mu in bf16": (
        LLAMA8B_2X, ["train.global_batch=14", "train.adam_mu_dtype=bfloat16"], 2),
}
H200_AT_095 = 0.95 * 143771 * 2**20 / GIB  # 133.4 GiB


def gpu_estimate_gib(path: str, overrides: list[str], n: int) -> float:
    cfg = load_config(path, overrides)
    degrees, problems = resolve_mesh(cfg.mesh, n)
    assert not problems, problems
    cfg = with_mesh(cfg, degrees)
    return run_estimate(cfg, resolve(cfg, degrees, "gpu", packages_here=False)).total / GIB


@pytest.mark.parametrize("name", MEASURED)
def test_gpu_estimate_within_10_percent_of_the_measured_peak(name):
    path, overrides, n, measured = MEASURED[name]
    est = gpu_estimate_gib(path, overrides, n)
    assert est == pytest.approx(measured, rel=0.10), f"{name}: estimate {est:.1f} GiB, measured {measured} GiB"


@pytest.mark.parametrize("name", RAN_OUT)
def test_gpu_estimate_does_not_fit_what_ran_out_of_memory(name):
    est = gpu_estimate_gib(*RAN_OUT[name])
    assert est > H200_AT_095, f"{name}: estimate {est:.1f} GiB fits the {H200_AT_095:.1f} GiB it ran out of"


@pytest.mark.parametrize("path, overrides, n, too_many", [
    (LLAMA8B_2X, [], 2, ["train.global_batch=14"]),
    (LLAMA8B, ["train.global_batch=24", "run.gpu_memory_fraction=0.95"], 4, ["train.global_batch=28"]),
], ids=["2xh200_config", "4xh200_6_a_gpu"])
def test_the_8b_recipes_pass_the_guard_they_run_under(path, overrides, n, too_many):
    """The 8B recipes run with the memory guard on: their estimates fit the 95% of an H200 they ask for (their
    measured peaks, 127.2 and 121.2 GiB, do), and one more sequence a GPU, which would not fit, is refused.
    The allocator's limit is a little under the share of nvidia-smi's total: on an H100 at 0.92 the guard read
    72.8 GiB, not 73.3 (docs/PERFORMANCE.md, OLMoE on two H100s); the same 0.7% off an H200's 133.4 is 132.5."""
    limit_gib = H200_AT_095 * 72.8 / (0.92 * 81559 / 1024)
    from meshtrain.config import ConfigError
    from meshtrain.planning import guard

    def check(more):
        cfg = load_config(path, overrides + more)
        assert cfg.run.memory_guard and cfg.run.gpu_memory_fraction == 0.95
        guard.check(with_mesh(cfg, resolve_mesh(cfg.mesh, n)[0]), n, "gpu", limit_gib * GIB, memory_fraction=0.95)

    check([])
    with pytest.raises(ConfigError, match="memory: the estimate is"):
        check(too_many)


def test_the_guard_names_unrolled_layers_first_where_they_fit():
    """ZeRO-2 at fsdp=2 ran out of memory with the layers scanned (RAN_OUT); unrolled, each layer's gradient goes where
    its residuals were, and the guard names that change first (under ZeRO-3 on the same GPUs unrolled ran 1.6% faster
    than scanned)."""
    from meshtrain.config import ConfigError
    from meshtrain.planning import guard
    path, overrides, n = RAN_OUT["Llama-3-8B fsdp=2 ZeRO-2, 4 sequences a GPU"]
    cfg = load_config(path, overrides)
    with pytest.raises(ConfigError, match=r"the cheapest change that fits: model\.scan_layers=false \("):
        guard.check(with_mesh(cfg, resolve_mesh(cfg.mesh, n)[0]), n, "gpu", 132.5 * GIB, memory_fraction=0.95)
    assert gpu_estimate_gib(path, overrides + ["model.scan_layers=false"], n) < 132.5


def test_the_guard_names_the_fused_loss_where_the_logits_stand_in_the_way():
    """Six sequences a GPU of the 2xH200 recipe with the plain loss: 148 GiB estimated, 22 of them the fp32 logits and
    their gradient; the fused loss, which costs no step time (docs/PERFORMANCE.md), is the change named (127.2 GiB
    measured with it)."""
    from meshtrain.config import ConfigError
    from meshtrain.planning import guard
    cfg = load_config(LLAMA8B_2X, PLAIN_LOSS)
    with pytest.raises(ConfigError, match=r"the cheapest change that fits: model\.loss=fused \("):
        guard.check(with_mesh(cfg, resolve_mesh(cfg.mesh, 2)[0]), 2, "gpu", 132.5 * GIB, memory_fraction=0.95)
