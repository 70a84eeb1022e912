"""Kernels for meshtrain, each with a jnp reference beside it: Pallas on Mosaic GPU (flash attention on
Hopper) and kernels in Triton's own language (attention's fallback, RMSNorm, the grouped matmul, the fp8
cast), launched by triton_launch.py. Imports jax only; triton and jax-triton when a Triton kernel first runs.

Layout: a kernel family of several files has its own folder (attention/: flash attention's entry,
plan, reference and its Mosaic GPU and Triton backends); a single-file kernel sits here beside
_common.py, the helpers they share."""
from pallas_kernels.attention import (FORWARD_OUTPUTS as FLASH_FORWARD_OUTPUTS, FlashAttentionBlockSizes,
                                      MosaicBlockSizes, flash_attention, flash_attention_backward,
                                      flash_attention_reference, mosaic_unavailable)
from pallas_kernels.cross_entropy import (LinearCrossEntropyBlockSizes, linear_cross_entropy,
                                          linear_cross_entropy_reference)
from pallas_kernels.cross_entropy_sum import linear_cross_entropy_sum
from pallas_kernels.fp8_cast import Fp8CastBlockSizes, cast_transpose, cast_transpose_reference
from pallas_kernels.grouped_matmul import GroupedMatmulBlockSizes, gmm, grouped_matmul_reference
from pallas_kernels.rms_norm import RmsNormBlockSizes, rms_norm, rms_norm_reference

__all__ = [
    "FLASH_FORWARD_OUTPUTS",
    "FlashAttentionBlockSizes",
    "Fp8CastBlockSizes",
    "GroupedMatmulBlockSizes",
    "LinearCrossEntropyBlockSizes",
    "MosaicBlockSizes",
    "RmsNormBlockSizes",
    "cast_transpose",
    "cast_transpose_reference",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_reference",
    "gmm",
    "grouped_matmul_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_sum",
    "mosaic_unavailable",
    "rms_norm",
    "rms_norm_reference",
]
