"""Activation recomputation policies by name (`train.remat`).

The block marks its intermediate values with `checkpoint_name` (see CHECKPOINT_POINTS in config);
a policy says which of them the backward pass keeps instead of recomputing.

  none       keep everything (fastest, most memory)
  full       keep only the block input; recompute the whole block in the backward pass
  save_dots  keep every matmul output without a batch dim (projections), recompute the rest
  save_dots_attn
             save_dots, the rotated q and k (point "qkv") and the fused attention kernel's outputs (o and
             the log-sum-exp its backward reads), so the backward reruns neither attention's forward nor
             RoPE; as much memory as save_dots plus o, since the projections before RoPE are then not
             kept (RoPE's backward needs only its tables). The jnp reference attention has no such
             kernel and recomputes its scores
  save_attn  keep the q/k/v projections and the attention output (attention is the costly part)
  names:a,b  keep exactly the named points
  p+q        keep what either policy keeps, e.g. save_dots_attn+names:moe_in,moe_hidden,moe_out (the projections,
             the attention kernel's outputs and the routed experts' GEMM outputs: an MoE block whose backward
             reruns only its elementwise work and the exchange's small index collectives)
"""
from __future__ import annotations

import functools

import jax

from meshtrain.config import CHECKPOINT_POINTS, remat_parts
from pallas_kernels import FLASH_FORWARD_OUTPUTS


def fused_attention_forward(prim, *_, **params) -> bool:
    """The forward kernel of a fused attention: cuDNN's (jax.nn.dot_product_attention) or the flash
    attention's of pallas_kernels. Each sits inside a custom_vjp whose forward rule the policy sees, and
    their outputs are exactly the residuals the matching backward reads.

    The flash attention names its outputs (o, lse) whichever backend ran; that is enough where the kernel
    is pure (Triton's), since what the backward does not read is then dropped from the recomputation.
    A Mosaic GPU kernel (an mpmd_map) has effects and is never dropped, so it is itself what is saved."""
    if prim.name == "dot_product_attention_fwd_wrapper":
        return True
    if prim.name == "mpmd_map":
        return str(params.get("name", "")).startswith("flash_attention_fwd")
    return prim.name == "name" and params.get("name") == FLASH_FORWARD_OUTPUTS


def remat_policy(name: str):
    """The jax.checkpoint policy for `name`, or None when the block is not rematerialized at all."""
    cp = jax.checkpoint_policies
    parts = remat_parts(name)
    if len(parts) > 1:
        if ("none", ()) in parts:
            raise ValueError(f"train.remat={name!r}: 'none' keeps everything already; join only recomputing policies")
        return functools.reduce(cp.save_from_both_policies, [remat_policy(p) for p in name.split("+")])
    (policy, points), = parts
    if policy == "none":
        return None
    if policy == "full":
        return cp.nothing_saveable
    if policy == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if policy == "save_dots_attn":
        return functools.reduce(cp.save_from_both_policies, [cp.dots_with_no_batch_dims_saveable,
                                                             fused_attention_forward, cp.save_only_these_names("qkv")])
    if policy == "save_attn":
        return cp.save_only_these_names("qkv", "attn_out")
    if policy == "names":
        unknown = [p for p in points if p not in CHECKPOINT_POINTS]
        if unknown:
            raise ValueError(f"train.remat={name!r}: unknown points {unknown}; known: {CHECKPOINT_POINTS}")
        return cp.save_only_these_names(*points)
    raise ValueError(f"train.remat={name!r}: unknown policy")
