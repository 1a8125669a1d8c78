"""Triton activation quantiser for the W8A8 block-FP8 kernels: x to e4m3 with one fp32 scale per (token,
group channels), as `fp8.reference.quantize_fp8_per_token_group`, bit for bit.

Two ways in: `quantize_rows`, a `@triton.jit` helper for kernels that quantise their activation tiles inline
(the few-token linear in `linear.triton`, the MoE GEMV experts in `moe.gemv`), and
`quantize_fp8_per_token_group`, one launch that writes x quantised for a GEMM to read (`fp8.triton`,
`moe.fp8`, `linear.triton` with `prequantize`). `has_fp8_dot` says whether those GEMMs may take e4m3
tensor-core dots on a device. They sit in a module of their own so that every FP8 kernel module imports
them from here and none imports another's GEMM for them.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8.reference import AMAX_EPS, FP8_MAX
from engine.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _round_to_e4m3(v):
    # v [BM, BG] fp32 with |v| <= 448, rounded (to nearest even) onto the e4m3 grid in fp32, so the cast after
    # it is exact. Triton's interpreter casts fp32 -> e4m3 without the carry into the exponent (1.97 becomes
    # 1.0); rounding here makes the GPU and the interpreter agree with torch bit for bit.
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # keep 3 mantissa bits, ties to even
    normal = bits.to(tl.float32, bitcast=True)
    # Below 2**-6 e4m3 is subnormal, with a fixed step of 2**-9: adding 2**14 (fp32 step 2**-9) rounds to it.
    small = ((tl.abs(v) + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    small = (small | (v.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)  # v's sign
    return tl.where(tl.abs(v) < 0.015625, small, normal)


@triton.jit
def quantize_rows(x, fp8_max, eps):
    """Each row of x [R, C] fp32 (one activation group per row; masked-out elements 0) quantised as
    `reference.quantize_fp8_per_token_group` does: (q [R, C] fp32 on the e4m3 grid, exactly castable to
    tl.float8e4nv, and scale [R] fp32 = amax / fp8_max), with x ~= q * scale. For kernels that quantise
    their activation tiles inline (the FP8 experts) as well as the quantiser below."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)  # [R]
    # div_rn: Triton's `/` on fp32 is approximate on the GPU; the reference divides exactly.
    scale = tl.math.div_rn(amax, fp8_max)
    q = tl.math.div_rn(x, scale[:, None])
    return _round_to_e4m3(tl.minimum(tl.maximum(q, -fp8_max), fp8_max)), scale


@triton.jit
def _quantize_kernel(
    x,  # [M, K]
    q,  # [M, K] e4m3, contiguous
    s,  # [M, G] fp32 scales, contiguous
    M,
    K,
    G,
    GROUP,
    stride_xm,
    stride_xk,
    fp8_max,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_c = tl.arange(0, BLOCK_G)
    o_k = i_g * GROUP + o_c
    m_m = o_m < M
    mask = m_m[:, None] & ((o_c < GROUP) & (o_k < K))[None, :]
    b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :] * stride_xk, mask=mask, other=0.0).to(
        tl.float32
    )
    b_q, scale = quantize_rows(b_x, fp8_max, eps)
    tl.store(q + o_m[:, None] * K + o_k[None, :], b_q.to(tl.float8e4nv), mask=mask)
    tl.store(s + o_m * G + i_g, scale, mask=m_m)


@functools.cache
def has_fp8_dot(device: torch.device) -> bool:
    """Whether the FP8 GEMMs take e4m3 tensor-core dots on `device` (sm_89+, or the interpreter's CPU
    tensors); else they multiply in fp16, where e4m3 values are exact (logged once as a fallback)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return True
    dispatch.fallback("fp8_dot", "e4m3 tensor-core dots need sm_89+: FP8 GEMMs multiply in fp16", "fp16")
    return False


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_fp8_per_token_group` on Triton: x_fp8 [..., K] e4m3, scales [..., ceil(K/group)] fp32."""
    k = x.shape[-1]
    groups = triton.cdiv(k, group)
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)  # [M, K], a view where the strides allow
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m > 0 and k > 0:
        # 64 rows per program for prefill-sized M: 16-row programs ran at a third of the copy bandwidth
        # (35 us for 8,192 x 2,048 bf16 on an H200).
        block_m = min(64 if m >= 1024 else 16, triton.next_power_of_2(m))
        grid = (triton.cdiv(m, block_m), groups)
        _quantize_kernel[grid](
            x2,
            q,
            s,
            m,
            k,
            groups,
            group,
            x2.stride(0),
            x2.stride(1),
            FP8_MAX,
            AMAX_EPS,
            BLOCK_M=block_m,
            BLOCK_G=triton.next_power_of_2(group),
            **pdl_launch(),
        )
    return q.view(*x.shape[:-1], k), s.view(*x.shape[:-1], groups)
