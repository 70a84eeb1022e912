"""The per-stage op orders of each pipeline schedule: what a stage runs next, not when.

Each builder returns, for every stage, its ops in execution order as (kind, microbatch, chunk)
triples; schedules.py then places them in time (as early as their inputs allow) and checks them.
Keeping the order apart from the timing means a schedule is one short loop here, and every
timing property (bubble, ticks, memory) follows from the order alone.

Notation: p stages, m microbatches, v model chunks per stage, stage s, warm-up w_s forwards.

    afab         F0 F1 ... F(m-1)  B0 B1 ... B(m-1)                      (GPipe)
    1f1b         F0 .. F(w-1) | F(w) B0 F(w+1) B1 ... | B(m-w) .. B(m-1)   w_s = p-1-s
    interleaved  the 1F1B pattern over the m·v (microbatch, chunk) forwards taken in
                 groups of p microbatches per chunk, w_s = (p-1-s) + (v-1)·p
    zb_h1        1F1B with B split into B (input grad) and W (weight grad); stage s runs
                 W(i-s) right after B(i), and its last s+1 W fill the cool-down bubble
    dualpipe_v   two chunks per stage laid out as a V (chunk 0 goes down the stages, chunk 1
                 comes back up), DeepSeek's DualPipeV phase by phase
"""
from __future__ import annotations

OpKey = tuple[str, int, int]  # (kind, microbatch, chunk)
Orders = list[list[OpKey]]


def afab(p: int, m: int) -> Orders:
    """All forwards, then all backwards: m microbatches in flight at once."""
    return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Orders:
    """PipeDream-flush 1F1B: stage s runs p-1-s forwards ahead, then alternates F and B."""
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        ops = [("F", i, 0) for i in range(warm)]
        for i in range(m):
            if i + warm < m:
                ops.append(("F", i + warm, 0))
            ops.append(("B", i, 0))
        orders.append(ops)
    return orders


def interleaved(p: int, m: int, v: int) -> Orders:
    """Megatron's interleaved 1F1B over v chunks per stage (m must be a multiple of p).

    The k-th forward of a stage is microbatch (k // (p·v))·p + k % p on chunk (k // p) % v: p
    microbatches go through chunk 0, then the same p through chunk 1, and so on; backwards walk
    the chunks in reverse. The warm-up is (p-1-s) + (v-1)·p forwards, one chunk-round of p fewer
    than Megatron's 2·(p-1-s) + (v-1)·p: with each op placed as soon as its input exists the
    smaller warm-up loses no time (same bubble, same ticks) and stage 0 holds v·p chunk
    activations, i.e. p microbatches of its layers, as in 1F1B. With v = 1 this is 1F1B.
    """
    total = m * v
    forwards = [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(total)]
    orders = []
    for s in range(p):
        warm = min(p - 1 - s + (v - 1) * p, total)
        ops = [("F", mb, c) for mb, c in forwards[:warm]]
        for k in range(total):
            if k + warm < total:
                mb, c = forwards[k + warm]
                ops.append(("F", mb, c))
            mb, c = forwards[k]
            ops.append(("B", mb, v - 1 - c))
        orders.append(ops)
    return orders


def zb_h1(p: int, m: int) -> Orders:
    """Zero-bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", fig. 3).

    1F1B's F/B order with the backward split in two; stage s delays each W by s microbatches.
    The last stage thus keeps p-1 W for the end, where stages nearer the input would otherwise
    wait for the last input grads to come back: each stage idles p-1 units instead of 1F1B's
    3·(p-1), and no stage holds more than p microbatches before their W (1F1B's stage-0 peak).
    """
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        ops = [("F", i, 0) for i in range(warm)]
        for i in range(m):
            if i + warm < m:
                ops.append(("F", i + warm, 0))
            ops.append(("B", i, 0))
            if i >= s:
                ops.append(("W", i - s, 0))
        ops += [("W", i, 0) for i in range(max(m - s, 0), m)]
        orders.append(ops)
    return orders


def dualpipe_v(p: int, m: int) -> Orders:
    """DualPipeV ("cut-in-half" DualPipe; DeepSeek-V3 report, github.com/deepseek-ai/DualPipe).

    Stage s holds virtual stages s (chunk 0) and 2p-1-s (chunk 1), so stage 0 holds the first
    and the last layers. The eight phases of the reference implementation, with its F&B pairs
    (a forward overlapped with another microbatch's backward, to hide expert-parallel
    all-to-alls) written as F then B. A backward that the reference runs whole is B then W at
    once; a "zero-bubble" one queues its W (first in, first out) for a later W slot. Needs m >= 2p.
    """
    orders = []
    for s in range(p):
        ops: list[OpKey] = []
        n_f, n_b, w_queue = [0, 0], [0, 0], []

        def fwd(c: int) -> None:
            ops.append(("F", n_f[c], c))
            n_f[c] += 1

        def bwd(c: int, defer_w: bool = False) -> None:
            ops.append(("B", n_b[c], c))
            if defer_w:
                w_queue.append(("W", n_b[c], c))
            else:
                ops.append(("W", n_b[c], c))
            n_b[c] += 1

        def weight() -> None:
            ops.append(w_queue.pop(0))

        for _ in range(2 * (p - s - 1)):  # 1: chunk-0 warm-up
            fwd(0)
        for _ in range(s + 1):  # 2: both arms of the V fill
            fwd(0)
            fwd(1)
        for _ in range(p - s - 1):  # 3: first backwards, W deferred by one slot
            bwd(1, defer_w=True)
            weight()
            fwd(1)
        for _ in range(m - 2 * p + s + 1):  # 4: steady state, two F&B pairs
            fwd(0)
            bwd(1)
            fwd(1)
            bwd(0)
        for _ in range(p - s - 1):  # 5: chunk 0 has run out of forwards
            bwd(1)
            fwd(1)
            bwd(0)
        defer = False
        for i in range(s + 1):  # 6: backwards only; the second half defers its W
            defer = defer or (i == (s + 1) // 2 and s % 2 == 1)
            bwd(1, defer)
            defer = defer or (i == (s + 1) // 2 and s % 2 == 0)
            bwd(0, defer)
        for _ in range(p - s - 1):  # 7: W fill the wait for the last chunk-0 input grads
            weight()
            bwd(0, defer_w=True)
        while w_queue:  # 8
            weight()
        orders.append(ops)
    return orders
