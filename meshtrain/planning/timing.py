"""Step time from stated rates: compute, and the communication each mesh axis adds.

    compute   = model FLOPs (6N + attention, and what the remat policy reruns: recomputed_fraction)
                / (devices · peak · matmul efficiency)
    per axis  = bytes each device moves / link bandwidth; ring collectives move (n-1)/n of the
                buffer per all-gather or reduce-scatter and 2(n-1)/n per all-reduce
    exposed   = the part of communication not hidden behind compute: dp/fsdp gradient and weight
                traffic overlaps with the backward pass (overlap fraction), tp/sp/cp traffic sits on
                the critical path of every layer
    passes    = the memory-bound passes over the parameters (memory_passes_bytes) at HBM bandwidth, and under a
                split backward what B keeps for W, written and read back
    latency   = a fixed cost per collective (Rates.latency_*), times the collectives each axis launches on
                the step's critical path (collective_counts)
    pipeline  = the program the executor runs (step/pipeline/ticks.py), timed: Σ over its lockstep ticks of
                the busiest stage's ops, each op priced in chunk forwards (ticks.executor_op_units) and the
                last chunk's backward also carrying the head and loss (head_units); what exceeds the stage's
                share of the compute is the bubble. So the bubble is the schedule's as the executor runs it,
                not the formula's (p-1)/m: measured on 2x H200 (llama1b pp=2, m=8, docs/PERFORMANCE.md
                2026-11-28 evening), zb_h1 / 1f1b = 0.967 and dualpipe_v / 1f1b = 1.012 against 0.970 and 1.012
                from this model (earlier programs, on 2x H100: 1.21 against 1.22, and 1.39 against 1.43 at pp=4)

The bytes per axis follow how meshtrain lays the model out (sharding.py):
    dp        all-reduce of the gradients (replicated params)            2(n-1)/n · 4·P
    fsdp      ZeRO-0/1: gradients reduced, params gathered, once a step  2(n-1)/n · 4·P
              ZeRO-2:   gradients reduce-scattered every microbatch       (n-1)/n · (4m + 4)·P
              ZeRO-3:   + weights gathered for forward and backward       (n-1)/n · m(2c + 4)·P  (c: compute bytes)
    tp        per layer, 2 all-reduces forward and 2 backward of the
              [tokens, D] activations (or all-gather + reduce-scatter with SP: the same bytes)
    cp, sp    K/V ring (cp) and all-to-all of q/k/v/o (sp) per layer
    pp        activations [tokens, D] per microbatch boundary, forward and backward; interleaved and
              dualpipe_v also move the blocks that change stage each step (weights in the compute dtype
              there, gradients in fp32 back: step/pipeline/layout.py)
P is the number of parameters on the device before fsdp sharding (params / tp / pp).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from meshtrain.config import Config, padded_vocab, remat_parts
from meshtrain.metrics import flops_per_token
from meshtrain.planning.layout import DTYPE_BYTES, Layout, moe_layers
from meshtrain.planning.memory import param_count, param_tensors, sharded_elems
from meshtrain.planning.memory_layer import split_backward_bytes
from meshtrain.planning.memory_pipeline import chunk_layers, is_tapped, program
from meshtrain.step.pipeline.ticks import B, LAST, executor_op_units


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
    # A collective's fixed cost (launch and synchronisation, NCCL's small-message latency), inside a node and
    # across nodes: assumed figures of the usual order, not measured here.
    latency_nvlink_s: float = 15e-6
    latency_ib_s: float = 40e-6
    # The pipeline executor's fixed cost per tick beyond its ops and its two permutes (its switches, the lockstep
    # wait): fitted to 2x H100 (llama1b seq 2048, pp=2, 2026-11-27, docs/PERFORMANCE.md), where interleaved with
    # twice 1F1B's ticks took 0.989x and 1.014x its step at 8 and 16 microbatches, which this model, ticks free,
    # put at 0.957x and 0.977x; dualpipe_v (not fitted) came out at 1.050x at 8, predicted 1.040x. One shape only:
    # how the cost scales with the model is not measured, nor where it goes (the trace has ~0.3 ms idle gaps after
    # some switches' index reads, where a switch over small branches costs ~20 us). It is priced by the tick, not
    # by the switch: zb_h1's third switch a tick did not make its steps slower than 1F1B's.
    tick_s: float = 0.65e-3

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
    c = DTYPE_BYTES[cfg.precision.compute]
    if g["fsdp"] > 1:
        # ZeRO-3 gathers the compute-dtype weights for every microbatch's forward and again for its backward, and
        # ZeRO-2/3 reduce-scatter every microbatch's fp32 gradients into their sharded accumulator; ZeRO-0/1 reduce
        # the accumulated gradients once a step, and ZeRO-1/2 gather the updated parameters once a step.
        micro = lay.grad_accum
        per_param = {3: micro * (2 * c + 4), 2: micro * 4 + 4, 1: 4 + 4, 0: 2 * 4}[lay.zero_stage]
        out["fsdp"] = ring(g["fsdp"]) * per_param * p_local
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
    if g["pp"] > 1:  # the stages' messages; the state keeps every stage's chunks on it (step/pipeline/layout.py)
        out["pp"] = 2 * tokens * m.d_model * c
    return out


def collective_counts(cfg: Config, lay: Layout) -> dict[str, float]:
    """Collectives each device launches per step, by axis (what the latency term multiplies). Per layer and
    microbatch: tp 4 (2 forward, 2 backward; Megatron SP: an all-gather and a reduce-scatter in their place,
    twice as many), sp 8 all-to-alls, cp a ring step per other rank forward and two backward (1 and 2
    gathers for cp_impl=allgather), fsdp 2 all-gathers and a reduce-scatter under ZeRO-3 (1 and 1
    otherwise), ep 4 all-to-alls per MoE layer; dp one all-reduce per layer per step; pp 2 permutes per tick."""
    g, m = lay.degrees, cfg.model
    micro = lay.grad_accum
    layers = m.n_layers / g["pp"]
    out = {a: 0.0 for a in g}
    if g["tp"] > 1:
        out["tp"] = (8 if lay.sequence_parallel else 4) * layers * micro
    if g["sp"] > 1:
        out["sp"] = 8 * layers * micro
    if g["cp"] > 1:
        ring = cfg.parallel.cp_impl != "allgather" and not lay.gathers_kv_in_stages
        out["cp"] = (3 * (g["cp"] - 1) if ring else 3) * layers * micro
    if g["fsdp"] > 1:
        out["fsdp"] = (3 if lay.zero_stage >= 3 else 2) * layers * micro
    if g["ep"] > 1:
        out["ep"] = 4 * moe_layers(cfg) / g["pp"] * micro
    if g["dp"] > 1:
        out["dp"] = layers
    if g["pp"] > 1:
        out["pp"] = 2 * executor_ticks(lay)
    return out


def executor_ticks(lay: Layout) -> int:
    """The ticks of the pipeline executor's program for this layout (a schedule that cannot run these arguments is
    priced as all forwards, then all backwards)."""
    ticks = program(lay.schedule, lay.degrees["pp"], lay.grad_accum, lay.virtual_stages)
    return ticks.n_ticks if ticks is not None else 2 * lay.grad_accum


def head_units(cfg: Config, lay: Layout) -> float:
    """The head and loss (the last chunk's extra work per microbatch) in forwards of one pipeline chunk: the
    [D, V] matmul against the chunk's layers' matmuls and causal attention."""
    m = cfg.model
    layer_params = sum(t.elems for t in param_tensors(cfg, 1) if t.layer) / m.n_layers
    per_layer = layer_params + cfg.data.seq_len * m.n_heads * m.kv_dim  # flops_per_token's terms, per layer
    return padded_vocab(m, 1) * m.d_model / (chunk_layers(m.n_layers, lay) * per_layer)


def pipeline_span(cfg: Config, lay: Layout) -> float:
    """The executor's program for this layout, in chunk-forward units: Σ over ticks of the busiest stage's
    ops (module docstring), over the stage's even share of the same work. 1 is a pipeline without a bubble;
    the schedule's formula would say 1 + bubble_ratio."""
    g = lay.degrees
    return _span(lay.schedule, g["pp"], lay.grad_accum, lay.virtual_stages, head_units(cfg, lay))


@functools.lru_cache(maxsize=4096)  # the planner times many layouts of one program
def _span(kind: str, p: int, m: int, v: int, h: float) -> float:
    ticks = program(kind, p, m, v)
    if ticks is None:  # a schedule that cannot run these arguments: all forwards, then all backwards
        return 1 + (p - 1) / m
    units = np.vectorize(lambda op, pos: executor_op_units(op, pos, ticks.split_backward) +
                         (h if op == B and pos == LAST else 0.0), otypes=[float])(ticks.kind, ticks.position)
    span = units.sum(axis=2).max(axis=1).sum()
    return float(span / ((p * m * v * 3 + m * h) / p))


def recomputed_fraction(cfg: Config, remat: str) -> float:
    """The forward work a remat policy reruns in the backward, over a layer's forward and backward (6N + attention,
    as flops_per_token counts them), per token: full reruns all of the forward (1/3); save_dots the attention
    kernel's forward (every matmul output is kept); save_dots_attn only elementwise work (0); save_attn the
    output projection and the FFN's matmuls; a union the least of its parts; `names:` points half the forward
    (a rough middle: which matmuls they spare depends on the points)."""
    if len(remat_parts(remat)) > 1:
        return min(recomputed_fraction(cfg, part) for part in remat.split("+"))
    m = cfg.model
    attention = 2 * cfg.data.seq_len * m.n_heads * m.kv_dim  # the causal attention's forward FLOPs per token
    ffn = 2 * 3 * m.d_model * m.d_ff
    out_proj = 2 * m.n_heads * m.kv_dim * m.d_model
    matmuls = out_proj + ffn + 2 * m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.kv_dim  # wo, the FFN, wq, wk, wv
    forward = matmuls + attention
    rerun = {"none": 0.0, "save_dots_attn": 0.0, "save_dots": attention, "save_attn": out_proj + ffn,
             "full": forward}.get(remat, forward / 2)
    return rerun / (3 * forward)


def step_time(cfg: Config, lay: Layout, rates: Rates, n_devices: int) -> dict[str, float]:
    """Seconds per optimizer step: compute, exposed communication per axis, collective latency, bubble, total."""
    g = lay.degrees
    tokens = lay.micro_batch * lay.grad_accum * cfg.data.seq_len
    n_params = param_count(cfg, g["tp"])
    flops = flops_per_token(cfg.model, n_params, cfg.data.seq_len) * tokens
    flops *= 1 + recomputed_fraction(cfg, lay.remat)
    peak = rates.peak_flops if cfg.precision.compute != "float32" else rates.peak_flops / 2
    compute = flops / (n_devices * peak * rates.matmul_efficiency)
    comm = comm_bytes(cfg, lay)
    exposed = {}
    for axis, nbytes in comm.items():
        t = nbytes / link_bw(rates, axis, lay) if nbytes else 0.0
        hidden = rates.overlap if axis in ("dp", "fsdp") else 0.0
        exposed[axis] = t * (1 - hidden)
    passes = memory_passes_bytes(cfg, lay) / rates.hbm_bw
    latency = 0.0
    for axis, count in collective_counts(cfg, lay).items():
        per = rates.latency_nvlink_s if link_bw(rates, axis, lay) == rates.nvlink_bw else rates.latency_ib_s
        latency += count * per * (1 - (rates.overlap if axis in ("dp", "fsdp") else 0.0))
    bubble = compute * (pipeline_span(cfg, lay) - 1) if g["pp"] > 1 else 0.0
    if g["pp"] > 1:  # the executor's ticks (collective_counts prices their permutes)
        bubble += executor_ticks(lay) * rates.tick_s
    total = compute + passes + sum(exposed.values()) + latency + bubble
    return {"compute_s": compute, "passes_s": passes, "bubble_s": bubble,
            **{f"comm_{a}_s": t for a, t in exposed.items() if t}, "latency_s": latency, "total_s": total}


def memory_passes_bytes(cfg: Config, lay: Layout) -> float:
    """HBM bytes of the passes over the parameters that no matmul hides, per device and step: each microbatch (a
    pipeline: each step) casts its sites' weights (4 B read, the compute dtype written; under ZeRO-3 its shard),
    each microbatch of an accumulating step adds its fp32 gradient to the accumulator (12 B), and the optimizer
    reads and writes every local parameter, its gradient and AdamW's moments once a step (20 B + 2x the first
    moment's dtype). A split backward (zb_h1, dualpipe_v) also writes what each tapped layer keeps for W in B and
    reads it back in W, for every microbatch and layer of the stage (memory_layer.split_backward_bytes): on two H200s
    (llama1b, pp=2, 8 microbatches, docs/PERFORMANCE.md 2026-11-28 evening) that predicts 8.6 ms a stage and step,
    where zb_h1's stages were busy 8.1 and 8.4 ms longer than 1F1B's."""
    g = lay.degrees
    tensors = param_tensors(cfg, g["tp"], g["ep"])
    c, mu = DTYPE_BYTES[cfg.precision.compute], DTYPE_BYTES[cfg.train.adam_mu_dtype]
    cast = (4 + c) * sharded_elems(tensors, lay, lay.zero_stage >= 3)
    accumulate = 12 * sharded_elems(tensors, lay, lay.zero_stage >= 2) if lay.grad_accum > 1 else 0.0
    optimizer = (20 + 2 * mu) * sharded_elems(tensors, lay, lay.zero_stage >= 1)
    casts = 1 if g["pp"] > 1 else lay.grad_accum  # a pipeline stage casts its chunks once a step (ops.chunk_weights)
    split = 0.0
    if g["pp"] > 1 and is_tapped(lay):
        split = 2 * split_backward_bytes(cfg, lay) * cfg.model.n_layers / g["pp"] * lay.grad_accum
    return casts * cast + lay.grad_accum * accumulate + optimizer + split
