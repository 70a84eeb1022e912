"""Pallas kernels for meshtrain (imports jax only). Each kernel has a jnp reference beside it."""
from pallas_kernels.attention_plan import FlashAttentionBlockSizes
from pallas_kernels.attention_reference import flash_attention_reference
from pallas_kernels.flash_attention import flash_attention

__all__ = [
    "FlashAttentionBlockSizes",
    "flash_attention",
    "flash_attention_reference",
]
