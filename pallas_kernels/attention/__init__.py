"""Flash attention: one public entry (`api.py`) over two kernel backends, Mosaic GPU on Hopper
(`mosaic_*.py`) and Triton's language elsewhere (`triton_*.py`), with the static plan they share
(`plan.py`) and the jnp reference that defines their semantics (`reference.py`)."""
from pallas_kernels.attention.api import FORWARD_OUTPUTS, flash_attention, flash_attention_backward, mosaic_unavailable
from pallas_kernels.attention.plan import FlashAttentionBlockSizes, MosaicBlockSizes
from pallas_kernels.attention.reference import flash_attention_reference

__all__ = [
    "FORWARD_OUTPUTS",
    "FlashAttentionBlockSizes",
    "MosaicBlockSizes",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_reference",
    "mosaic_unavailable",
]
