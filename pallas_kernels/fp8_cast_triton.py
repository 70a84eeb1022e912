"""fp8 quantization in Triton's own language: the kernel of `fp8_cast.py`.

One read of x [NB, R, C] (any float dtype), and per tile of BR x BC: q = fp8(clip(x / scale)) written in
x's layout, its transpose qT [NB, C, R] (the K-major operand a backward GEMM needs) and the tile's amax
of |x|, as the plan asks. Grid (R/BR, C/BC, NB); edges masked, so any R and C run.

Named fp8_cast_transpose, the name the device trace shows.

Imported by `triton_launch` only, after it has put Triton in the mode the launch needs (compiled or
interpreted).
"""
import triton
import triton.language as tl


@triton.jit
def _on_fp8_grid(v, MANT: tl.constexpr, EMIN: tl.constexpr):
    """v (fp32, |v| within the format's max) rounded to the nearest value of an fp8 format with MANT mantissa
    bits and least normal exponent EMIN, ties to even, still in fp32 and with v's sign (-0 where a negative v
    rounds to zero). The cast that follows is then exact: Triton's interpreter (3.9) rounds fp32 -> fp8 wrongly
    where rounding carries into the exponent (7.86 -> 4 in e4m3), and the CPU tests run the kernel there; on
    the GPU the cast would round the same way."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)  # |v|'s binade; subnormals take the least one's spacing
    spacing = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MANT), exact
    r = tl.abs(v) / spacing  # < 2^(MANT + 1): an exact division by a power of two
    r = (r + 12582912.0) - 12582912.0  # + 1.5 * 2^23 and back: fp32 addition rounds r to an integer, ties to even
    # v's sign bit put back on the magnitude (Triton's unary minus is 0 - x, which would turn -0 into +0).
    return ((r * spacing).to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_cast_transpose(X, SCALE, Q, QT, AMAX, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr,
                       BC: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr, WRITE_AMAX: tl.constexpr):
    """q = fp8(clip(x / scale, -max, max)) [NB, R, C]; with TRANSPOSE also qT [NB, C, R]; with WRITE_AMAX the
    tile's max |x| at AMAX[(nb * R/BR + r) * C/BC + c]. E4M3: e4m3fn, else e5m2. A NaN in x is NaN in q on the
    GPU (Triton's interpreter writes 384 in e4m3), and the amax may pass it over: a step with a NaN is dropped
    whole, its histories with it, and current scaling's amax (XLA's) is NaN."""
    pr, pc, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    base = nb.to(tl.int64) * R * C  # int64: NB * R * C can pass 2^31
    x = tl.load(X + base + rows[:, None].to(tl.int64) * C + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    fmax: tl.constexpr = 448.0 if E4M3 else 57344.0
    v = x / tl.load(SCALE)  # a power of two: exact
    v = tl.minimum(tl.maximum(v, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax, propagate_nan=tl.PropagateNan.ALL)
    if E4M3:
        q = _on_fp8_grid(v, 3, -6).to(tl.float8e4nv)
    else:
        q = _on_fp8_grid(v, 2, -14).to(tl.float8e5)
    tl.store(Q + base + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=inside)
    if TRANSPOSE:
        tl.store(QT + base + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(q), mask=tl.trans(inside))
    if WRITE_AMAX:
        a = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.store(AMAX + (nb * tl.num_programs(0) + pr) * tl.num_programs(1) + pc, a)
