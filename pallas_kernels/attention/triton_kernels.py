"""Flash attention in Triton's own language: the forward, dK/dV and dQ kernels.

They run where the Mosaic GPU kernels cannot: GPUs before Hopper, head dims other than 64 and 128,
float32, and (through Triton's interpreter, `pallas_kernels/triton_launch.py`) the CPU tests. Launched by
`triton_backend.py` through jax-triton.

Layouts, all contiguous and padded to whole blocks by `api.py` (so loads need no bounds
masks): q/o/do/dq [B, Tp, H, E], k/v/dk/dv [B, Sp, KH, E], lse/lse2/delta [B, H, Tp] fp32, segment
ids [B, Tp] and [B, Sp] int32 (a one-element dummy when HAS_SEG is off). The plan is static, so it
arrives as constexprs and each plan compiles its own kernels.

Scores are prescaled by SCALE2 = sm_scale * log2(e) so softmax uses exp2. Causal is bottom-right
(query i sees key j iff j <= i + OFFSET, OFFSET = S - T); the loop bounds follow plan.py:
blocks wholly visible skip the mask, blocks past the diagonal are not visited.

Imported by `triton_launch` only, after it has put Triton in the mode the launch needs (compiled or
interpreted).
"""
import triton
import triton.language as tl

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _kv_bounds(q_start, BQ: tl.constexpr, BK: tl.constexpr, S_REAL: tl.constexpr, OFFSET: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr):
    """(n_unmasked, n_total) key blocks for the query block at q_start (plan.kv_loop_bounds)."""
    hi = tl.full([], (S_REAL + BK - 1) // BK, tl.int32)
    if CAUSAL:
        hi = tl.minimum(tl.maximum(q_start + (BQ + OFFSET + BK - 1), 0) // BK, hi)
        n_safe = tl.minimum(tl.maximum(q_start + (OFFSET + 1), 0) // BK, hi)
    else:
        n_safe = hi
    n_safe = tl.minimum(n_safe, S_REAL // BK)  # the block holding padded keys is masked
    if HAS_SEG:
        n_safe = tl.full([], 0, tl.int32)
    return n_safe, hi


@triton.jit
def _q_bounds(k_start, BQ: tl.constexpr, BK: tl.constexpr, T_REAL: tl.constexpr, OFFSET: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr):
    """(lo, mid, hi) query blocks for the key block at k_start: [lo, mid) masked, [mid, hi) not
    (plan.q_loop_bounds)."""
    hi = tl.full([], (T_REAL + BQ - 1) // BQ, tl.int32)
    if CAUSAL:
        lo = tl.minimum(tl.maximum(k_start - OFFSET, 0) // BQ, hi)
        first_full = (tl.maximum(k_start + (BK - 1 - OFFSET), 0) + (BQ - 1)) // BQ
        mid = tl.minimum(tl.maximum(first_full, lo), hi)
    else:
        lo = tl.full([], 0, tl.int32)
        mid = lo
    if HAS_SEG:
        mid = hi
    return lo, mid, hi


@triton.jit
def _visible(q_pos, k_pos, q_seg, k_seg, S_REAL: tl.constexpr, OFFSET: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_SEG: tl.constexpr):
    """True where a query sees a key; q_pos/k_pos (and the ids) arrive shaped to broadcast into the
    tile, [BQ, 1] x [1, BK] or transposed, so one helper serves both orientations."""
    ok = k_pos < S_REAL
    if CAUSAL:
        ok = ok & (k_pos <= q_pos + OFFSET)
    if HAS_SEG:
        ok = ok & (q_seg == k_seg)
    return ok


@triton.jit
def _scores(q, q_pos, q_seg, k, keys, kseg_row, SCALE2: tl.constexpr, S_REAL: tl.constexpr, OFFSET: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """[BQ, BK] scores q k^T in log2 units of a query block against key block `keys`; in a MASKED block,
    -inf where a query does not see a key."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE2
    if MASKED:
        k_seg = tl.load(kseg_row + keys) if HAS_SEG else keys
        ok = _visible(q_pos[:, None], keys[None, :], q_seg[:, None], k_seg[None, :], S_REAL, OFFSET, CAUSAL,
                      HAS_SEG)
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def _fwd_step(acc, m, l, q, q_pos, q_seg, k_rows, v_rows, kseg_row, kb, cols,
              KV_STRIDE: tl.constexpr, BK: tl.constexpr, SCALE2: tl.constexpr, S_REAL: tl.constexpr,
              OFFSET: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr,
              MASKED: tl.constexpr):
    keys = kb * BK + tl.arange(0, BK)
    k = tl.load(k_rows + keys[:, None] * KV_STRIDE + cols[None, :])
    s = _scores(q, q_pos, q_seg, k, keys, kseg_row, SCALE2, S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, MASKED)
    m_new = tl.maximum(m, tl.max(s, 1))
    if MASKED:
        # A row whose keys so far are all masked has m_new = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_rows + keys[:, None] * KV_STRIDE + cols[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l


@triton.jit
def _query_block(QSEG, H: tl.constexpr, KH: tl.constexpr, E: tl.constexpr, T_PAD: tl.constexpr,
                 S_PAD: tl.constexpr, HAS_SEG: tl.constexpr, BQ: tl.constexpr):
    """What a forward or dQ program (grid (Tp/BQ, B, H)) works on: (q_start, b, h, q_pos, q_rows, q_seg,
    kv_offset). Query blocks run last-first: under a causal mask the late ones do the most work, and
    starting them first evens out the tail of the launch. q_rows are the element offsets of its query
    rows in a [B, Tp, H, E] array; kv_offset is where its kv head's rows start in [B, Sp, KH, E]."""
    q_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BQ
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_pos = q_start + tl.arange(0, BQ)
    q_rows = (b * T_PAD + q_pos) * (H * E) + h * E
    q_seg = tl.load(QSEG + b * T_PAD + q_pos) if HAS_SEG else q_pos
    kv_offset = b * S_PAD * (KH * E) + (h // (H // KH)) * E
    return q_start, b, h, q_pos, q_rows, q_seg, kv_offset


@triton.jit
def fwd_kernel(Q, K, V, QSEG, KSEG, O, LSE,
               H: tl.constexpr, KH: tl.constexpr, E: tl.constexpr, T_PAD: tl.constexpr, S_PAD: tl.constexpr,
               T_REAL: tl.constexpr, S_REAL: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
               SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, PRECISION: tl.constexpr,
               BQ: tl.constexpr, BK: tl.constexpr):
    """Grid (Tp/BQ, B, H): a program owns BQ queries of one head and streams K/V of its kv head
    (_query_block)."""
    OFFSET: tl.constexpr = S_REAL - T_REAL
    q_start, b, h, q_pos, q_rows, q_seg, kv_offset = _query_block(QSEG, H, KH, E, T_PAD, S_PAD, HAS_SEG, BQ)
    cols = tl.arange(0, E)
    q = tl.load(Q + q_rows[:, None] + cols[None, :])
    k_rows, v_rows, kseg_row = K + kv_offset, V + kv_offset, KSEG + b * S_PAD

    acc = tl.zeros([BQ, E], tl.float32)
    m = tl.full([BQ], float("-inf"), tl.float32)
    l = tl.zeros([BQ], tl.float32)
    n_safe, hi = _kv_bounds(q_start, BQ, BK, S_REAL, OFFSET, CAUSAL, HAS_SEG)
    for kb in range(0, n_safe):
        acc, m, l = _fwd_step(acc, m, l, q, q_pos, q_seg, k_rows, v_rows, kseg_row, kb, cols, KH * E, BK, SCALE2,
                              S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, False)
    for kb in range(n_safe, hi):
        acc, m, l = _fwd_step(acc, m, l, q, q_pos, q_seg, k_rows, v_rows, kseg_row, kb, cols, KH * E, BK, SCALE2,
                              S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, True)
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    tl.store(O + q_rows[:, None] + cols[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty))
    lse = tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe)) * _LN2)
    tl.store(LSE + (b * H + h) * T_PAD + q_pos, lse)


@triton.jit
def _dkdv_step(dk, dv, k, v, k_pos, k_seg, q_rows, do_rows, stat_row, qseg_row, qb, cols,
               Q_STRIDE: tl.constexpr, BQ: tl.constexpr, SCALE2: tl.constexpr, S_REAL: tl.constexpr,
               OFFSET: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr,
               LSE2, DELTA, MASKED: tl.constexpr):
    # The transposed orientation [BK, BQ] (sT = K Q^T): pT and dsT are then the A operands of the
    # dV and dK matmuls as they sit; only loaded tiles are transposed.
    q_pos = qb * BQ + tl.arange(0, BQ)
    q = tl.load(q_rows + q_pos[:, None] * Q_STRIDE + cols[None, :])
    do = tl.load(do_rows + q_pos[:, None] * Q_STRIDE + cols[None, :])
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * SCALE2
    if MASKED:
        q_seg = tl.load(qseg_row + q_pos) if HAS_SEG else q_pos
        ok = _visible(q_pos[None, :], k_pos[:, None], q_seg[None, :], k_seg[:, None], S_REAL, OFFSET, CAUSAL,
                      HAS_SEG)
        s_t = tl.where(ok, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t - tl.load(LSE2 + stat_row + q_pos)[None, :])
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - tl.load(DELTA + stat_row + q_pos)[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE2, DELTA, QSEG, KSEG, DK, DV,
                H: tl.constexpr, KH: tl.constexpr, E: tl.constexpr, T_PAD: tl.constexpr, S_PAD: tl.constexpr,
                T_REAL: tl.constexpr, S_REAL: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                BQ: tl.constexpr, BK: tl.constexpr):
    """Grid (Sp/BK, B, KH): a program owns BK keys of one kv head and walks the query blocks of
    every query head of its GQA group, so dK/dV of a kv head are summed in registers: no atomics,
    no [B, S, H, E] intermediate. lse2 = lse * log2(e) (+inf for a row that saw no key, so p = 0)
    and delta = rowsum(o * do) - dlse come from `plan.backward_stats`."""
    OFFSET: tl.constexpr = S_REAL - T_REAL
    GROUP: tl.constexpr = H // KH
    k_start = tl.program_id(0) * BK
    b = tl.program_id(1).to(tl.int64)
    kh = tl.program_id(2)
    k_pos = k_start + tl.arange(0, BK)
    cols = tl.arange(0, E)
    kv_rows = (b * S_PAD + k_pos) * (KH * E) + kh * E
    k = tl.load(K + kv_rows[:, None] + cols[None, :])
    v = tl.load(V + kv_rows[:, None] + cols[None, :])
    k_seg = tl.load(KSEG + b * S_PAD + k_pos) if HAS_SEG else k_pos
    qseg_row = QSEG + b * T_PAD
    dk = tl.zeros([BK, E], tl.float32)
    dv = tl.zeros([BK, E], tl.float32)
    lo, mid, hi = _q_bounds(k_start, BQ, BK, T_REAL, OFFSET, CAUSAL, HAS_SEG)
    for g in tl.static_range(GROUP):
        h = kh * GROUP + g
        q_rows = Q + b * T_PAD * (H * E) + h * E
        do_rows = DO + b * T_PAD * (H * E) + h * E
        stat_row = (b * H + h) * T_PAD
        for qb in range(lo, mid):
            dk, dv = _dkdv_step(dk, dv, k, v, k_pos, k_seg, q_rows, do_rows, stat_row, qseg_row, qb, cols, H * E,
                                BQ, SCALE2, S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, LSE2, DELTA, True)
        for qb in range(mid, hi):
            dk, dv = _dkdv_step(dk, dv, k, v, k_pos, k_seg, q_rows, do_rows, stat_row, qseg_row, qb, cols, H * E,
                                BQ, SCALE2, S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, LSE2, DELTA, False)
    tl.store(DK + kv_rows[:, None] + cols[None, :], (dk * SM_SCALE).to(DK.dtype.element_ty))
    tl.store(DV + kv_rows[:, None] + cols[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_step(dq, q, do, lse2, delta, q_pos, q_seg, k_rows, v_rows, kseg_row, kb, cols,
             KV_STRIDE: tl.constexpr, BK: tl.constexpr, SCALE2: tl.constexpr, S_REAL: tl.constexpr,
             OFFSET: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr,
             MASKED: tl.constexpr):
    keys = kb * BK + tl.arange(0, BK)
    k = tl.load(k_rows + keys[:, None] * KV_STRIDE + cols[None, :])
    v = tl.load(v_rows + keys[:, None] * KV_STRIDE + cols[None, :])
    s = _scores(q, q_pos, q_seg, k, keys, kseg_row, SCALE2, S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, MASKED)
    p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def dq_kernel(Q, K, V, DO, LSE2, DELTA, QSEG, KSEG, DQ,
              H: tl.constexpr, KH: tl.constexpr, E: tl.constexpr, T_PAD: tl.constexpr, S_PAD: tl.constexpr,
              T_REAL: tl.constexpr, S_REAL: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
              SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, PRECISION: tl.constexpr,
              BQ: tl.constexpr, BK: tl.constexpr):
    """Grid (Tp/BQ, B, H): like the forward, a program owns a query block and walks keys,
    recomputing p and dp rather than adding dQ up with atomics in the dK/dV kernel."""
    OFFSET: tl.constexpr = S_REAL - T_REAL
    q_start, b, h, q_pos, q_rows, q_seg, kv_offset = _query_block(QSEG, H, KH, E, T_PAD, S_PAD, HAS_SEG, BQ)
    cols = tl.arange(0, E)
    q = tl.load(Q + q_rows[:, None] + cols[None, :])
    do = tl.load(DO + q_rows[:, None] + cols[None, :])
    stat_row = (b * H + h) * T_PAD
    lse2 = tl.load(LSE2 + stat_row + q_pos)
    delta = tl.load(DELTA + stat_row + q_pos)
    k_rows, v_rows, kseg_row = K + kv_offset, V + kv_offset, KSEG + b * S_PAD

    dq = tl.zeros([BQ, E], tl.float32)
    n_safe, hi = _kv_bounds(q_start, BQ, BK, S_REAL, OFFSET, CAUSAL, HAS_SEG)
    for kb in range(0, n_safe):
        dq = _dq_step(dq, q, do, lse2, delta, q_pos, q_seg, k_rows, v_rows, kseg_row, kb, cols, KH * E, BK, SCALE2,
                      S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, False)
    for kb in range(n_safe, hi):
        dq = _dq_step(dq, q, do, lse2, delta, q_pos, q_seg, k_rows, v_rows, kseg_row, kb, cols, KH * E, BK, SCALE2,
                      S_REAL, OFFSET, CAUSAL, HAS_SEG, PRECISION, True)
    tl.store(DQ + q_rows[:, None] + cols[None, :], (dq * SM_SCALE).to(DQ.dtype.element_ty))
