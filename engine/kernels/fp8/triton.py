"""Triton w8a8 block FP8: per-token-group activation quantisation, then a GEMM on the e4m3 tiles.

For one token and up to 4096 outputs (`linear.triton.FP8_PREFER_MAX_ROWS`, `FP8_PREFER_MAX_N`: where it
measured faster) `fp8_block_linear` runs the weight-streaming kernel of `engine.kernels.linear.triton` (x
quantised inside it). Everything else takes `fp8_block_gemm`: the quantiser (`fp8.quant`) writes x as e4m3
plus one fp32 scale per (token, 128 channels) (or x comes quantised, `Fp8Activation`), then from
`cublas.MIN_ROWS` rows on an H100/H200 cuBLASLt's block-scaled FP8 GEMM runs (`fp8.cublas`, 2-4x the Triton
GEMM there), else the Triton GEMM, which walks K one scale block (BLOCK_K = 128) at a time, so each K step is
one e4m3 `tl.dot` scaled by x_scale[m, kb] * w_scale[n // 128, kb] before it joins the fp32 accumulator. Edge
blocks (N or K not multiples of 128) are masked to zero on both sides.
"""

import math
from dataclasses import astuple

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8 import cublas, reference
from engine.kernels.fp8.config import GemmConfig, tuned_config
from engine.kernels.fp8.quant import has_fp8_dot, quantize_fp8_per_token_group
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.linear import triton as linear_triton
from engine.kernels.pdl import pdl_launch, pdl_wait

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by the largest token count they serve; BLOCK_K is the scale block.
# Small batches are bound by reading the weight, so narrow N tiles spread it over more programs.
_CONFIGS = ((16, 64, 4, 4), (32, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3))
_CONFIG_MAX_M = (16, 32, 64)
_GROUP_M = 8  # M tiles that walk the same N tiles together, so weight tiles are reused from L2


@triton.jit
def _block_fp8_matmul_kernel(
    a,  # [M, K] e4m3 activations
    a_s,  # [M, KB] fp32 per-token-group scales
    b,  # [N, K] e4m3 weight
    b_s,  # [NB, KB] fp32 weight block scales
    bias,  # [N] (only read if HAS_BIAS)
    c,  # [M, N] output
    part,  # [SPLIT_K, M, N] fp32 partial sums (only with SPLIT_K > 1)
    counters,  # [tiles] int32 zeros, one per (M tile, N tile) (only with SPLIT_K > 1; left zero)
    M,
    N,
    K,
    GROUP_N,  # weight rows per scale block
    kb_per_split,  # K blocks each split walks
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = the K scale block
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_FP8_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    i_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    i_n = (pid % (GROUP_M * num_n)) // group_rows

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    kb_begin = pid_k * kb_per_split
    kb_end = tl.minimum(tl.cdiv(K, BLOCK_K), kb_begin + kb_per_split)
    p_a = a + o_m[:, None] * stride_am + (kb_begin * BLOCK_K + o_k)[None, :] * stride_ak  # [BM, BK]
    p_b = b + o_n[None, :] * stride_bn + (kb_begin * BLOCK_K + o_k)[:, None] * stride_bk  # [BK, BN]
    p_as = a_s + o_m * stride_asm  # [BM]
    p_bs = b_s + (o_n // GROUP_N) * stride_bsn  # [BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        m_k = o_k < K - kb * BLOCK_K
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_k[:, None] & m_n[None, :], other=0.0)
        s_a = tl.load(p_as + kb * stride_ask, mask=m_m, other=0.0)
        s_b = tl.load(p_bs + kb * stride_bsk, mask=m_n, other=0.0)
        if not USE_FP8_DOT:
            # Before sm_89: e4m3 values are exact in fp16, and the dot still accumulates in fp32.
            b_a, b_b = b_a.to(tl.float16), b_b.to(tl.float16)
        acc += tl.dot(b_a, b_b) * s_a[:, None] * s_b[None, :]  # e4m3 x e4m3 -> fp32 on sm_89+
        p_a += BLOCK_K * stride_ak
        p_b += BLOCK_K * stride_bk

    mask = m_m[:, None] & m_n[None, :]
    last = True
    if SPLIT_K > 1:
        # Each split stores its fp32 sums; the last split of the tile to finish (a per-tile counter, acq_rel,
        # as in `linear.triton`) adds them in split order, so the result is the same every run.
        p_part = part + o_m[:, None] * N + o_n[None, :]  # [BM, BN] of split 0, contiguous [S, M, N]
        tl.store(p_part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the increment releases them
        last = tl.atomic_add(counters + pid, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            tl.store(counters + pid, 0)
            tl.debug_barrier()  # the acquire before every thread's loads of the other splits' sums
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(SPLIT_K):
                acc += tl.load(p_part + split * M * N, mask=mask, other=0.0)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        p_c = c + o_m[:, None] * stride_cm + o_n[None, :] * stride_cn
        tl.store(p_c, acc.to(c.dtype.element_ty), mask=mask)


def gemm_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """The GEMM's tiles for M rows of an [N, K] weight: this GPU's tuned entry (`fp8.config`), else by M."""
    tuned = tuned_config(m, n, k, device)
    if tuned is not None:
        return tuned
    index = next((i for i, top in enumerate(_CONFIG_MAX_M) if m <= top), len(_CONFIG_MAX_M))
    return GemmConfig(*_CONFIGS[index])


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    xq = xq if xq is not None and xq.fits(x, block[1]) else None
    if linear_triton.fits(x, weight, linear_triton.FP8_PREFER_MAX_ROWS):
        # Wide outputs: x quantised once by its own launch (every program would repeat it inline); x that
        # comes quantised is read as it is, at any width.
        wide = weight.shape[0] > linear_triton.FP8_PREFER_MAX_N
        dispatch.choose("fp8_block_linear", "triton-gemv")
        return linear_triton.fp8_linear(x, weight, weight_scale_inv, bias, block, prequantize=wide, xq=xq)
    return fp8_block_gemm(x, weight, weight_scale_inv, bias, block, xq=xq)


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    *,
    config: GemmConfig | None = None,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """`fp8_block_linear` as the quantiser launch and the tensor-core GEMM, at any token count (larger
    batches; benchmarks compare the few-token kernel with it). `config`: the GEMM's tiles (default:
    `gemm_config`); `xq`: x already quantised (no quantiser launch)."""
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        # BLOCK_K is the K scale block and tl.dot needs a power of two >= 16; real checkpoints use 128.
        reason = "scale block K is not a power of two >= 16 (tl.dot)"
        dispatch.fallback("fp8_block_linear", reason, x=x, weight_scale_inv=weight_scale_inv)
        return reference.fp8_block_linear(x, weight, weight_scale_inv, bias, block)
    k = x.shape[-1]
    n = weight.shape[0]
    rows = math.prod(x.shape[:-1])
    if xq is not None and xq.fits(x, bk):
        x_q, x_s = xq.q.reshape(rows, k), xq.scale.reshape(rows, -1)
    else:
        x_q, x_s = quantize_fp8_per_token_group(x.reshape(rows, k), bk)  # [M, K] e4m3, [M, KB] fp32
    if config is None and cublas.fits(rows, weight, block, x.dtype, bias is not None) is None:
        out = cublas.block_gemm(x_q, x_s, weight, weight_scale_inv, x.dtype)
        if out is not None:
            dispatch.choose("fp8_block_linear", "cublas")  # many rows: cuBLASLt's block-scaled GEMM
            return out.view(*x.shape[:-1], n)
        reason = "cuBLASLt refused the block-scaled GEMM (no algorithm); the Triton GEMM runs this shape"
        dispatch.fallback("fp8_block_linear", reason, "triton-gemm", x=x_q, weight=weight)
    dispatch.choose("fp8_block_linear", "triton-gemm")
    m = x_q.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        config = config or gemm_config(m, n, k, x.device)
        block_m, block_n, num_warps, num_stages, split_k = astuple(config)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        k_blocks = triton.cdiv(k, bk)
        per_split = triton.cdiv(k_blocks, max(1, min(split_k, k_blocks)))
        split_k = triton.cdiv(k_blocks, per_split)
        counters = linear_triton.tile_counters(x.device, tiles) if split_k > 1 else None
        if counters is None:  # no split, or no counters to be had (a first use inside a graph capture)
            split_k, per_split = 1, k_blocks
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
        _block_fp8_matmul_kernel[(tiles, split_k)](
            x_q,
            x_s,
            weight,
            weight_scale_inv,
            bias if bias is not None else out,
            out,
            part,
            counters if counters is not None else out,
            m,
            n,
            k,
            bn,
            per_split,
            x_q.stride(0),
            x_q.stride(1),
            x_s.stride(0),
            x_s.stride(1),
            weight.stride(0),
            weight.stride(1),
            weight_scale_inv.stride(0),
            weight_scale_inv.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=bk,
            GROUP_M=_GROUP_M,
            HAS_BIAS=bias is not None,
            USE_FP8_DOT=has_fp8_dot(x.device),
            SPLIT_K=split_k,
            num_warps=num_warps,
            num_stages=num_stages,
            **pdl_launch(),
        )
    return out.view(*x.shape[:-1], n)
