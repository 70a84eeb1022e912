"""What a mixture-of-experts FFN keeps for the backward pass, per layer, per microbatch, per device.

The routed experts run on rows, not tokens (parallel/expert.py): every token's k assignments, gathered into
a buffer grouped by local expert. The buffer's row count is the term that matters:

    dropless, ep = 1     N·k            the device's own assignments
    dropless, ep > 1     ep·N·k         allgather: every assignment of the ep group, other ranks' experts past
                                        the groups' end (zeros); padded: an [ep, N·k] slot per source
    capacity             X·C, C = ceil(cf·N·k/X)   slots per expert, filled or not

Under remat none the region keeps, besides the dense block's attention and norm tensors (memory_layer.RESIDUALS):
the gathered rows [R, D], six [R, F/tp] tensors (where a dense SwiGLU keeps six [N, F/tp]), the experts'
outputs back at their tokens [N, k, D], the local experts' weights [X/ep, D, F/tp] (x3: the region's inputs,
sliced per layer out of the stacked parameters) and the router's fp32 logits and probabilities [N, X]. The
grouped matmuls are not dots without batch dims, so save_dots keeps none of the rows, only the router's logits;
full and save_attn keep nothing of the FFN. Checked against jax's saved_residuals like the dense table
(tests/test_planning.py).

The backward of the layer being differentiated holds more while XLA's ragged_dot runs as a dense dot over the
local experts (grouped_matmul_working_bytes): in the compiled step's buffers, three [X/ep, R, F/tp] and two
[R, 2F/tp] (gate and up fused) beside the residuals.
"""
from __future__ import annotations

import math

from meshtrain.config import Config, remat_parts

# Per remat policy: [R, F/tp] rows, [R, D] rows, [N·k, D] outputs, the expert weights, [N, X] fp32 router tensors,
# and [ep·N, D] tokens as the all-gather exchange delivers them.
EXPERT_RESIDUALS = {
    "none": dict(rows_f=6, rows_d=1, out_d=1, weights=1, router=2),
    "save_dots": dict(router=1),
    "save_dots_attn": dict(router=1),
}
# The experts' remat points (parallel/expert.py): moe_in the delivered tokens (all-gathered: ep·N of them; the
# padded exchange delivers its [ep·N·k] rows, here counted as the all-gather's, an underestimate there), moe_hidden
# the gate and up outputs, moe_out the down GEMM's output.
EXPERT_POINTS = {"moe_in": dict(tokens_d=1), "moe_hidden": dict(rows_f=2), "moe_out": dict(rows_d=1)}


def expert_counts(remat: str) -> dict:
    """EXPERT_RESIDUALS for any policy: a named one, names:<points> (the experts' points), or a union p+q (the sum
    of its parts: a bound where both keep the same buffer)."""
    counts: dict = {}
    for policy, points in remat_parts(remat):
        entries = [EXPERT_POINTS.get(p, {}) for p in points] if policy == "names" else [EXPERT_RESIDUALS.get(policy, {})]
        for entry in entries:
            for k, v in entry.items():
                counts[k] = counts.get(k, 0) + v
    return counts


def expert_rows(cfg: Config, ep: int, n_tokens: float) -> float:
    """Rows of the experts' buffer on one device for `n_tokens` tokens there (module docstring)."""
    moe = cfg.moe
    if moe.capacity_factor > 0:
        return moe.n_experts * math.ceil(moe.capacity_factor * n_tokens * moe.top_k / moe.n_experts)
    return n_tokens * moe.top_k * ep


def expert_layer_bytes(cfg: Config, remat: str, degrees: dict[str, int], n_tokens: float, c: int) -> float:
    """Bytes an MoE FFN keeps beyond what the dense table counts for the rest of its block (`c`: compute dtype
    bytes). The dense FFN's own [N, F] entries are the caller's to leave out."""
    counts = expert_counts(remat)
    m, moe = cfg.model, cfg.moe
    tp, ep = degrees["tp"], degrees["ep"]
    f = moe.expert_ffn(m) / tp
    rows = expert_rows(cfg, ep, n_tokens)
    out = c * rows * (f * counts.get("rows_f", 0) + m.d_model * counts.get("rows_d", 0))
    out += c * n_tokens * moe.top_k * m.d_model * counts.get("out_d", 0)
    out += c * 3 * moe.n_experts / ep * m.d_model * f * counts.get("weights", 0)
    out += 4 * n_tokens * moe.n_experts * counts.get("router", 0)
    out += c * ep * n_tokens * m.d_model * counts.get("tokens_d", 0)
    return out


def grouped_matmul_working_bytes(cfg: Config, degrees: dict[str, int], n_tokens: float, c: int) -> float:
    """What one MoE layer's backward holds beyond its residuals when XLA lowers jax.lax.ragged_dot (CPUs, and GPUs
    without the gmm kernel) as a dense dot over the local experts: three [X/ep, R, F/tp] products and gate|up,
    fused, [R, 2F/tp] and its gradient."""
    moe = cfg.moe
    f = moe.expert_ffn(cfg.model) / degrees["tp"]
    rows = expert_rows(cfg, degrees["ep"], n_tokens)
    return c * rows * f * (3 * moe.n_experts / degrees["ep"] + 2 * 2)
