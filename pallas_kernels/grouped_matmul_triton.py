"""The grouped matmul in Triton's own language: the gmm (forward and d_lhs) and tgmm (d_rhs) kernels.

Launched by `grouped_matmul.py` through `triton_launch.launch` (jax-triton on the GPU, Triton's
interpreter in the CPU tests), which imports this module only after it has put Triton in the mode the
launch needs (compiled or interpreted).

Layouts, all contiguous, row-major and padded to whole blocks by `grouped_matmul.py` (so the only
masks are the group masks): lhs/dy/out [Mp, Kp] / [Mp, Np], rhs [G, Kp, Np] (or [G, Np, Kp] read
transposed for d_lhs), d_rhs [G, Kp, Np]. The schedule (LO/HI per row tile, START/END per group) is
int32, built with jnp inside jit; the padded widths and tiles are constexprs, so each shape and plan
compiles its own kernels (the row count M is not one: it only sizes the grid).
"""
import triton
import triton.language as tl


@triton.jit
def _group_rows(first_row, start, end, BM: tl.constexpr):
    """(row index [BM] int64, mask [BM, 1] of the rows that belong to [start, end))."""
    rows = first_row + tl.arange(0, BM)
    return rows.to(tl.int64), ((rows >= start) & (rows < end))[:, None]


@triton.jit
def gmm_kernel(LO, HI, START, END, LHS, RHS, OUT,
               K_PAD: tl.constexpr, N_PAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
               TRANS_RHS: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (Np/BN, Mp/BM): program (j, i) owns output tile rows [i·BM, +BM) x cols [j·BN, +BN), written
    once. It loops over the groups [LO[i], HI[i]) whose rows meet its tile; a group's K loop reads the
    lhs rows outside the group as 0, so a straddled tile sums each row's one group. Axis 0 (n-tiles)
    is the fastest-launched: the programs sharing an lhs row panel run together and reuse it in L2."""
    j = tl.program_id(0)
    i = tl.program_id(1)
    cols_n = (j * BN + tl.arange(0, BN)).to(tl.int64)
    ks = tl.arange(0, BK)
    lo = tl.load(LO + i)
    hi = tl.load(HI + i)
    acc_mn = tl.zeros([BM, BN], tl.float32)
    # int64 bounds give an int64 group index: g·Kp·Np may pass 2^31 (64 experts of 8192 x 8192).
    for g in range(lo.to(tl.int64), hi.to(tl.int64)):
        rows_m, in_g_m1 = _group_rows(i * BM, tl.load(START + g), tl.load(END + g), BM)
        x_ptrs = LHS + rows_m[:, None] * K_PAD + ks[None, :]
        w_base = RHS + g * (K_PAD * N_PAD)
        if TRANS_RHS:  # rhs[g] stored [Np, Kp]: the [BK, BN] tile is its [BN, BK] block read transposed
            w_ptrs = w_base + cols_n[None, :] * K_PAD + ks[:, None]
            w_step = BK
        else:
            w_ptrs = w_base + ks[:, None] * N_PAD + cols_n[None, :]
            w_step = BK * N_PAD
        for kb in range(0, K_PAD // BK):
            # A masked (predicated, zero-filled) load, which Triton pipelines like a plain one; a select
            # after the load would sit between the load and the dot.
            x_mk = tl.load(x_ptrs, mask=in_g_m1, other=0.0)
            w_kn = tl.load(w_ptrs)
            acc_mn = tl.dot(x_mk, w_kn, acc_mn, input_precision=PRECISION)
            x_ptrs += BK
            w_ptrs += w_step
    rows_out = (i * BM + tl.arange(0, BM)).to(tl.int64)
    tl.store(OUT + rows_out[:, None] * N_PAD + cols_n[None, :], acc_mn.to(OUT.dtype.element_ty))


@triton.jit
def tgmm_kernel(START, END, LHS, DY, OUT,
                K_PAD: tl.constexpr, N_PAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                PRECISION: tl.constexpr):
    """Grid (Np/BN, Kp/BK, G): out[g] tile [BK, BN] = lhs[rows of g, k-tile]^T @ dy[rows of g, n-tile],
    over the row tiles of group g (a runtime trip count: 0 for an empty group, whose tile is stored 0).
    Groups are the slowest axis: one group's programs run together and share its rows in L2."""
    ni = tl.program_id(0)
    ki = tl.program_id(1)
    g = tl.program_id(2)
    start = tl.load(START + g)
    end = tl.load(END + g)
    first = start // BM
    last = tl.where(end > start, (end + BM - 1) // BM, first)  # exclusive; == first when empty
    cols_k = (ki * BK + tl.arange(0, BK)).to(tl.int64)
    cols_n = (ni * BN + tl.arange(0, BN)).to(tl.int64)
    acc_kn = tl.zeros([BK, BN], tl.float32)
    for r in range(first, last):
        rows_m, in_g_m1 = _group_rows(r * BM, start, end, BM)
        # Both operands masked: a non-finite row of the neighbour's dy times a zero would still be NaN.
        x_mk = tl.load(LHS + rows_m[:, None] * K_PAD + cols_k[None, :], mask=in_g_m1, other=0.0)
        dy_mn = tl.load(DY + rows_m[:, None] * N_PAD + cols_n[None, :], mask=in_g_m1, other=0.0)
        acc_kn = tl.dot(tl.trans(x_mk), dy_mn, acc_kn, input_precision=PRECISION)
    out_base = OUT + g.to(tl.int64) * (K_PAD * N_PAD)
    tl.store(out_base + cols_k[:, None] * N_PAD + cols_n[None, :], acc_kn.to(OUT.dtype.element_ty))
