"""RMSNorm in Triton's own language: the forward and backward kernels of `rms_norm.py`.

Layouts, contiguous and padded by `rms_norm.py` so that loads need no bounds masks: x/r/y/s/dy/ds/dx
[NP, DP] with NP a multiple of every row block and DP = max(16, next_pow2(D)), w [DP] (zero past D, so
padded columns add nothing to a row's sum of squares and come out 0), rstd [NP] fp32, dw partials
[programs, DP] fp32. Without a residual, R/S/DS are one-element stand-ins the kernels never touch
(HAS_RES off). The plan is static, so it arrives as constexprs and each plan compiles its own kernels.
Row offsets are int64: NP * DP passes 2^31 at, e.g., 128k rows of 16k.

Named rms_norm_fwd / rms_norm_bwd, the names the device trace shows (profile/trace.py files them under
"elementwise" by the name).

Imported by `triton_launch` only, after it has put Triton in the mode the launch needs (compiled or
interpreted). Interpreted, bf16 arrays arrive as fp32 (the launcher's rule), so the stored sum s is
not rounded to bf16 before the statistics there; on the GPU it is, as in the reference.
"""
import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd(X, R, W, Y, S, RSTD, D: tl.constexpr, DP: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr,
                 HAS_RES: tl.constexpr):
    """Grid (NP/BR,): a program normalizes BR whole rows. s = x + r (stored in x.dtype, then read back
    rounded, so y normalizes the sum the caller gets), rstd = rsqrt(mean(s^2) + eps), y = s * rstd * w."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, DP)
    offs = rows[:, None] * DP + cols[None, :]
    s = tl.load(X + offs).to(tl.float32)
    if HAS_RES:
        s_stored = (s + tl.load(R + offs).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + offs, s_stored)
        s = s_stored.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=1) / D + EPS)  # / D: padded columns are zeros
    w = tl.load(W + cols).to(tl.float32)
    tl.store(Y + offs, (s * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty))
    tl.store(RSTD + rows, rstd)


@triton.jit
def _load_chunk(S, DY, DS, RSTD, chunk, cols, CHUNK: tl.constexpr, DP: tl.constexpr, HAS_RES: tl.constexpr):
    """(s, dy, ds, rstd) of rows [chunk * CHUNK, (chunk + 1) * CHUNK); without a residual ds is dy again
    (never read: the dummy DS holds one element)."""
    rows = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    offs = rows[:, None] * DP + cols[None, :]
    s = tl.load(S + offs)
    dy = tl.load(DY + offs)
    ds = tl.load(DS + offs) if HAS_RES else dy
    return s, dy, ds, tl.load(RSTD + rows)


@triton.jit
def _bwd_chunk(s, dy, ds, rstd, w, dw, DX, chunk, cols, D: tl.constexpr, CHUNK: tl.constexpr, DP: tl.constexpr,
               HAS_RES: tl.constexpr):
    """Stores dx of one chunk and returns dw plus the chunk's sum over rows of dy * s_hat (fp32).
    dx = rstd * (g - s_hat * mean(g * s_hat)), g = dy * w; + ds, added in fp32 and rounded once."""
    s_hat = s.to(tl.float32) * rstd[:, None]
    dy = dy.to(tl.float32)
    g = dy * w[None, :]
    dx = rstd[:, None] * (g - s_hat * (tl.sum(g * s_hat, axis=1) / D)[:, None])
    if HAS_RES:
        dx = dx + ds.to(tl.float32)
    rows = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    tl.store(DX + rows[:, None] * DP + cols[None, :], dx.to(DX.dtype.element_ty))
    return dw + tl.sum(dy * s_hat, axis=0)


@triton.jit
def rms_norm_bwd(S, W, RSTD, DY, DS, DX, DW, D: tl.constexpr, DP: tl.constexpr, CHUNK: tl.constexpr,
                 N_CHUNKS: tl.constexpr, PROGRAMS: tl.constexpr, PREFETCH: tl.constexpr, HAS_RES: tl.constexpr):
    """PROGRAMS = 0: grid (NP/RB,), program i walks its own N_CHUNKS = RB/CHUNK chunks in order.
    PROGRAMS = P > 0: persistent grid (P,) over all N_CHUNKS = NP/CHUNK chunks; program p walks the
    chunks p, p + P, p + 2P, ... (at least one: P <= N_CHUNKS), so the dw partials are [P, DP] whatever N is.
    A program keeps its dw partial in fp32 registers and writes it once, to row pid of DW.
    PREFETCH: step c issues the loads of step c + 1 (the last step reloads its own chunk, harmlessly)
    before its own reductions and store, so one step of loads is always in flight."""
    pid = tl.program_id(0)
    if PROGRAMS > 0:
        first, stride = pid, PROGRAMS
        steps = (N_CHUNKS - 1 - pid) // PROGRAMS + 1  # operands >= 0
    else:
        first, stride = pid * N_CHUNKS, 1
        steps = N_CHUNKS
    cols = tl.arange(0, DP)
    w = tl.load(W + cols).to(tl.float32)
    dw = tl.zeros([DP], tl.float32)
    if PREFETCH:
        s, dy, ds, rstd = _load_chunk(S, DY, DS, RSTD, first, cols, CHUNK, DP, HAS_RES)
        for c in range(steps):
            nxt = first + tl.minimum(c + 1, steps - 1) * stride
            s_n, dy_n, ds_n, rstd_n = _load_chunk(S, DY, DS, RSTD, nxt, cols, CHUNK, DP, HAS_RES)
            dw = _bwd_chunk(s, dy, ds, rstd, w, dw, DX, first + c * stride, cols, D, CHUNK, DP, HAS_RES)
            s, dy, ds, rstd = s_n, dy_n, ds_n, rstd_n
    else:
        for c in range(steps):
            chunk = first + c * stride
            s, dy, ds, rstd = _load_chunk(S, DY, DS, RSTD, chunk, cols, CHUNK, DP, HAS_RES)
            dw = _bwd_chunk(s, dy, ds, rstd, w, dw, DX, chunk, cols, D, CHUNK, DP, HAS_RES)
    tl.store(DW + pid * DP + cols, dw)
