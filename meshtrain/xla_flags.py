"""XLA flags a config needs, set in the environment before jax starts its backend.

fp8 recipes on GPUs: `--xla_gpu_enable_triton_gemm=false`. With Triton GEMMs enabled, XLA's GEMM
autotuner compiles Triton candidates for every fp8 dot; on one H100 (jax 0.11.2) the train step of an
8-layer Llama-3-8B stack with `precision.matmul=fp8` was still compiling after 110 s, and with the flag
it compiled and ran in 49 s in all, every fp8 dot a cuBLASLt fp8 GEMM (docs/PERFORMANCE.md). bf16 runs
are left alone: their GEMMs go to cuBLAS either way.

A flag the user already set in XLA_FLAGS wins.
"""
from __future__ import annotations

import os

FP8_GPU_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def flags_for(matmul_recipe: str) -> tuple[str, ...]:
    return FP8_GPU_FLAGS if matmul_recipe.startswith("fp8") else ()


def apply(matmul_recipe: str, environ=os.environ) -> list[str]:
    """Append the recipe's flags to XLA_FLAGS (unless that flag is already named); returns those added."""
    current = environ.get("XLA_FLAGS", "")
    added = [f for f in flags_for(matmul_recipe) if f.split("=")[0] not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
