"""XLA flags a config needs, set in the environment before jax starts its backend.

fp8 recipes on GPUs: `--xla_gpu_enable_triton_gemm=false`. With Triton GEMMs enabled, XLA's GEMM
autotuner compiles Triton candidates for every fp8 dot; on one H100 (jax 0.11.2) the train step of an
8-layer Llama-3-8B stack with `precision.matmul=fp8` was still compiling after 110 s, and with the flag
it compiled and ran in 49 s in all, every fp8 dot a cuBLASLt fp8 GEMM (docs/PERFORMANCE.md). bf16 runs
are left alone: their GEMMs go to cuBLAS either way.

Tensor parallelism with `parallel.tp_overlap=windowed_einsum`: XLA's SPMD partitioner turns a matmul whose
operand must first be all-gathered over tp (sequence parallelism's gather before the column-parallel
matmuls) or whose result is reduce-scattered (after the row-parallel ones) into a loop of partial
matmuls, each overlapped with the collective-permute that brings the next shard ("collective matmul";
Wang et al., ASPLOS 2023). The threshold 0 makes every such matmul a candidate; multi-streamed runs the
permutes and the matmuls on separate streams; memcpy p2p moves a single process's shards by copies.
These flags only act on GPUs; with tp=1 nothing is added, because the same rewrite would also apply to
fsdp's weight gathers, which the latency-hiding scheduler already overlaps. Measured on 2 H100s
(docs/PERFORMANCE.md): right (losses within 4e-4 of fsdp) but its steps take 15-16% longer than
without it on an 8B-shaped stack, so it is not the default.

FSDP (`parallel.fsdp_combine_mib`, default 128): XLA combines the per-layer all-gathers and reduce-scatters
of the sharded weights and gradients into collectives of up to this size. On 2 H100s with the 1B config
and ZeRO-3 this took the step from 296.6-297.4 to 292.5-293.4 ms (two interleaved pairs in one call);
512 MiB gave 295.7 ms, and the 8B-shaped stack did not move (274.0 vs 273.4 ms). A later call, with
this default on, measured 297.2 ms, so the gain is at the edge of the run-to-run spread.

GPU memory (`run.gpu_memory_fraction`): jax's allocator takes 75% of each GPU by default, leaving the
rest to other processes. The full Llama-3-8B at 6 sequences per GPU (fsdp=4, 121 GiB peak on 141 GB
H200s) runs only with 0.95 (docs/PERFORMANCE.md, "Four H200s"), so a config can raise it.

A flag the user already set in XLA_FLAGS wins, as does an XLA_PYTHON_CLIENT_MEM_FRACTION in the
environment.
"""
from __future__ import annotations

import os

FP8_GPU_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)
TP_OVERLAP_GPU_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                        "--xla_gpu_multi_streamed_windowed_einsum=true",
                        "--xla_gpu_use_memcpy_local_p2p=true")


def fsdp_combine_flags(mib: int) -> tuple[str, ...]:
    return (f"--xla_gpu_all_gather_combine_threshold_bytes={mib << 20}",
            f"--xla_gpu_reduce_scatter_combine_threshold_bytes={mib << 20}")


def flags_for(matmul_recipe: str, tp: int = 1, tp_overlap: str = "none", fsdp: int = 1,
              fsdp_combine_mib: int = 0) -> tuple[str, ...]:
    """The flags for a config's matmul recipe and layout. A degree of -1 takes the rest: maybe > 1."""
    flags = FP8_GPU_FLAGS if matmul_recipe.startswith("fp8") else ()
    if tp != 1 and tp_overlap == "windowed_einsum":
        flags += TP_OVERLAP_GPU_FLAGS
    if fsdp != 1 and fsdp_combine_mib > 0:
        flags += fsdp_combine_flags(fsdp_combine_mib)
    return flags


MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_MEM_FRACTION = 0.75


def apply_config(cfg, environ=os.environ) -> list[str]:
    """`apply` for a whole Config, and its GPU memory fraction: what `python -m meshtrain.run` calls
    before jax starts."""
    m = cfg.mesh
    if cfg.run.gpu_memory_fraction and MEM_FRACTION_VAR not in environ:
        environ[MEM_FRACTION_VAR] = str(cfg.run.gpu_memory_fraction)
    return apply(flags_for(cfg.precision.matmul, m.tp, cfg.parallel.tp_overlap, m.fsdp, cfg.parallel.fsdp_combine_mib),
                 environ)


def gpu_memory_fraction(environ=os.environ) -> float:
    """The share of each GPU that jax's allocator takes in this process."""
    try:
        return float(environ.get(MEM_FRACTION_VAR, JAX_DEFAULT_MEM_FRACTION))
    except ValueError:  # jax itself will complain about it
        return JAX_DEFAULT_MEM_FRACTION


def apply(flags: tuple[str, ...], environ=os.environ) -> list[str]:
    """Append these flags to XLA_FLAGS (unless that flag is already named); returns those added."""
    current = environ.get("XLA_FLAGS", "")
    added = [f for f in flags if f.split("=")[0] not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
