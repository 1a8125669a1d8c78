"""e4m3 in Triton, shared by the attention kernels: rounding to e4m3 exactly in fp32 (the FP8 KV cache's
write) and the cast of queries and softmax weights for e4m3 products (the rows and packed prefill kernels)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.attention import fp8_kv

E4M3_MAX = tl.constexpr(fp8_kv.FP8_MAX)
SCALE_TINY = tl.constexpr(fp8_kv.SCALE_TINY)


@triton.jit
def round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the cast after
    it is exact, so the result (up to the sign of zero) does not hang on the cast's rounding (Triton's
    interpreter rounds half up and can carry into the exponent: 126.8 -> 64)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |x|) for normal x
    step_exp = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormals' fixed 2^-9
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)  # 2^step_exp, exact
    # Times 2^-step_exp, exact: the GPU's `/` is an approximate division (up to 2 ulp), which moved 36 of 55M
    # values across a rounding boundary on the H200 (one e4m3 step off torch's cast).
    y = x * ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)  # a tie rounded up to an odd value goes down
    return r * step


@triton.jit
def to_e4m3(x, EXACT_E4M3: tl.constexpr):
    """x (fp32, |x| <= 448 up to rounding) as e4m3; EXACT_E4M3 rounds in fp32 first (the interpreter's
    cast is faulty, see `round_to_e4m3`; the GPU's cast rounds to nearest even, saturating, the same)."""
    x = tl.clamp(x, -E4M3_MAX, E4M3_MAX)
    if EXACT_E4M3:
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_rows(x, EXACT_E4M3: tl.constexpr):
    """x [M, D] (any float) as (e4m3 [M, D], fp32 scale [M]): one scale a row, amax / 448 (the queries of an
    e4m3 QK product)."""
    xf = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), 1) / E4M3_MAX, SCALE_TINY)
    return to_e4m3(xf / scale[:, None], EXACT_E4M3), scale


@triton.jit
def pv_e4m3(acc, alpha, p, vs, v, EXACT_E4M3: tl.constexpr):
    """acc * alpha + P V with an e4m3 product: P [M, N] (softmax weights, fp32) times the values' scales
    vs [N], quantised per row (one fp32 factor a row, e4m3's full range), against V [N, D] e4m3 as stored."""
    pv = p * vs[None, :]
    pv_scale = tl.maximum(tl.max(pv, 1) / E4M3_MAX, SCALE_TINY)  # [M]
    pv8 = to_e4m3(pv / pv_scale[:, None], EXACT_E4M3)
    return acc * alpha[:, None] + tl.dot(pv8, v) * pv_scale[:, None]


@triton.jit
def pv_e4m3_in_units(acc, unit, alpha, p, vs, v, EXACT_E4M3: tl.constexpr):
    """`pv_e4m3` for an accumulator kept in units of a per-row factor (acc * unit [M] is the true sum), so the
    e4m3 product accumulates into it in place (wgmma's accumulator registers) instead of beside it: with s
    the new rows' scale, acc' = acc * (unit * alpha / s) + (P vs / s) V and unit' = s; returns both."""
    pv = p * vs[None, :]
    pv_scale = tl.maximum(tl.max(pv, 1) / E4M3_MAX, SCALE_TINY)  # [M]
    pv8 = to_e4m3(pv / pv_scale[:, None], EXACT_E4M3)
    acc = acc * (unit * alpha / pv_scale)[:, None]
    return tl.dot(pv8, v, acc), pv_scale
