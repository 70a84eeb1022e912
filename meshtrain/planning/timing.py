"""Step time from stated rates: compute, and the communication each mesh axis adds.

    compute   = model FLOPs (6N + attention, x4/3 for full recomputation's second forward)
                / (devices · peak · matmul efficiency)
    per axis  = bytes each device moves / link bandwidth; ring collectives move (n-1)/n of the
                buffer per all-gather or reduce-scatter and 2(n-1)/n per all-reduce
    exposed   = the part of communication not hidden behind compute: dp/fsdp gradient and weight
                traffic overlaps with the backward pass (overlap fraction), tp/sp/cp traffic sits on
                the critical path of every layer
    pipeline  = bubble (p-1)/m of the compute for 1F1B-like schedules

The bytes per axis follow how meshtrain lays the model out (sharding.py):
    dp        all-reduce of the gradients (replicated params)            2(n-1)/n · 4·P
    fsdp      ZeRO-1/2: reduce-scatter grads + all-gather params         2(n-1)/n · 4·P
              ZeRO-3:   + the weights gathered again for the backward     3(n-1)/n · 4·P
    tp        per layer, 2 all-reduces forward and 2 backward of the
              [tokens, D] activations (or all-gather + reduce-scatter with SP: the same bytes)
    cp, sp    K/V ring (cp) and all-to-all of q/k/v/o (sp) per layer
    pp        activations [tokens, D] per microbatch boundary, forward and backward
P is the number of parameters on the device before fsdp sharding (params / tp / pp).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import Config
from meshtrain.metrics import flops_per_token
from meshtrain.planning.memory import DTYPE_BYTES, Layout, param_count


@dataclass(frozen=True)
class Rates:
    """Per-device rates. Defaults: one H100/H200 SXM, NVLink inside a node, InfiniBand across."""

    peak_flops: float = 989e12  # dense bf16 FLOP/s (fp32: set it lower)
    matmul_efficiency: float = 0.55  # fraction of peak a real step reaches on matmuls
    hbm_bw: float = 3.35e12  # bytes/s (H200: 4.8e12)
    nvlink_bw: float = 450e9  # bytes/s per direction per GPU, inside a node (bus bandwidth)
    ib_bw: float = 50e9  # bytes/s per GPU across nodes (400 Gb/s NIC)
    devices_per_node: int = 8
    overlap: float = 0.8  # fraction of dp/fsdp traffic hidden behind the backward pass

    @classmethod
    def preset(cls, name: str) -> "Rates":
        return {"h100": cls(), "h200": cls(hbm_bw=4.8e12), "cpu": cls(peak_flops=1e11, matmul_efficiency=0.5,
                                                                       hbm_bw=2e10, nvlink_bw=1e10, ib_bw=1e10)}[name]


def link_bw(rates: Rates, axis: str, lay: Layout) -> float:
    """Bandwidth of an axis: inner axes stay in a node; an outer axis crosses nodes when the
    product of it and all inner axes exceeds a node."""
    order = ("pp", "dp", "fsdp", "ep", "cp", "sp", "tp")
    span = 1
    for a in order[order.index(axis):]:
        span *= lay.degrees[a]
    return rates.nvlink_bw if span <= rates.devices_per_node else rates.ib_bw


def comm_bytes(cfg: Config, lay: Layout) -> dict[str, float]:
    """Bytes each device sends per step, by axis."""
    g, m = lay.degrees, cfg.model
    p_local = param_count(cfg, g["tp"]) / g["tp"] / g["pp"]  # close enough: replicated norms are tiny
    ring = lambda n: (n - 1) / n  # noqa: E731
    out = {a: 0.0 for a in g}
    out["dp"] = 2 * ring(g["dp"]) * 4 * p_local
    if g["fsdp"] > 1:
        out["fsdp"] = (3 if lay.zero_stage >= 3 else 2) * ring(g["fsdp"]) * 4 * p_local
    c = DTYPE_BYTES[cfg.precision.compute]
    tokens = lay.micro_batch * lay.grad_accum / (g["dp"] * g["fsdp"]) * cfg.data.seq_len / (g["cp"] * g["sp"])
    layers = m.n_layers / g["pp"]
    if g["tp"] > 1:
        out["tp"] = 4 * 2 * ring(g["tp"]) * tokens * m.d_model * c * layers
    if g["sp"] > 1:  # all-to-all of q, k, v before attention and o after, forward and backward
        qkvo = (2 * m.n_heads + 2 * m.n_kv_heads) * m.kv_dim / g["tp"]
        out["sp"] = 2 * ring(g["sp"]) * tokens * qkvo * c * layers
    if g["cp"] > 1:  # K and V blocks around the ring, forward; twice that backward (dK, dV)
        kv = 2 * m.n_kv_heads * m.kv_dim / g["tp"]
        out["cp"] = 3 * (g["cp"] - 1) * tokens * kv * c * layers
    if g["pp"] > 1:
        out["pp"] = 2 * tokens * m.d_model * c
    return out


def step_time(cfg: Config, lay: Layout, rates: Rates, n_devices: int) -> dict[str, float]:
    """Seconds per optimizer step: compute, exposed communication per axis, bubble, total."""
    g = lay.degrees
    tokens = lay.micro_batch * lay.grad_accum * cfg.data.seq_len
    n_params = param_count(cfg, g["tp"])
    flops = flops_per_token(cfg.model, n_params, cfg.data.seq_len) * tokens
    if lay.remat != "none":  # the forward again in the backward: full 4/3, the partial policies less
        flops *= 4 / 3 if lay.remat == "full" else 1.15
    peak = rates.peak_flops if cfg.precision.compute != "float32" else rates.peak_flops / 2
    compute = flops / (n_devices * peak * rates.matmul_efficiency)
    comm = comm_bytes(cfg, lay)
    exposed = {}
    for axis, nbytes in comm.items():
        t = nbytes / link_bw(rates, axis, lay) if nbytes else 0.0
        hidden = rates.overlap if axis in ("dp", "fsdp") else 0.0
        exposed[axis] = t * (1 - hidden)
    bubble = 0.0
    if g["pp"] > 1:
        bubble = compute * (g["pp"] - 1) / max(lay.grad_accum, 1)
    total = compute + sum(exposed.values()) + bubble
    return {"compute_s": compute, "bubble_s": bubble, **{f"comm_{a}_s": t for a, t in exposed.items() if t},
            "total_s": total}
