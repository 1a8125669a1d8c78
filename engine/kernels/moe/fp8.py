"""Triton FP8 experts: the fused MoE's grouped GEMMs on block-FP8 (e4m3) expert weights, W8A8.

The same three steps as `triton.fused_experts` (align, gate/up GEMM with the SwiGLU epilogue, down GEMM with
the routing weight, combine; align and combine are the same kernels, `moe.align` and `moe.combine`), with
BLOCK_K = bk, one activation scale group per K step. The activations are quantised once, before each GEMM, by
`fp8.quant.quantize_fp8_per_token_group` (x per token, act per (token, slot) pair; per row and bk channels,
amax / 448): each K step then loads an e4m3 tile [BLOCK_M, bk] (x rows gathered by token, or act rows by
pair) and its scales [BLOCK_M], takes the e4m3 `tl.dot` with the weight tile [bk, BLOCK_N] and adds it to the
fp32 accumulator times x_scale[m] * w_scale[n // bn]. Quantising inside the GEMMs instead (as an earlier
version did) repeats the quantiser for every N tile of the same rows (16 times per tile at Qwen3.5's shapes
with 32- and 128-wide N tiles), and FP8 (b, 64) ran at 1,570 tok/s against bf16's 3,349 on an H200.

Scales: w13_scale [E, 2 * ceil(I/bn), ceil(H/bk)] holds the gate half's row blocks, then the up half's (up
row n uses row ceil(I/bn) + n // bn), which is the stacked [2I, H] block scale when bn divides I; w2_scale
[E, ceil(H/bn), ceil(I/bk)]. The shared expert (FP8 `Fp8Linear`s) runs outside; the combine adds its output.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8.quant import has_fp8_dot, quantize_fp8_per_token_group
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe import gemv, reference
from engine.kernels.moe.align import align_block_size
from engine.kernels.moe.combine import block_and_tile, combine
from engine.kernels.moe.config import ExpertsConfig, GemmTiles, choose_config, table_key, tuned_config
from engine.kernels.pdl import pdl_launch, pdl_wait

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fp8_gate_up_kernel(
    xq_ptr,  # [T, H] e4m3: x quantised per token and bk channels
    xs_ptr,  # [T, ceil(H/bk)] fp32 scales
    w13_ptr,  # [E, 2I, H] e4m3: gate rows, then up rows
    s13_ptr,  # [E, 2 * ceil(I/bn), ceil(H/bk)] fp32: gate row blocks, then up row blocks
    act_ptr,  # [T*S, I] out, x's dtype
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32 pair ids
    block_experts_ptr,  # [num_blocks] int32; -1 marks an unused block
    block_rows_ptr,  # [num_blocks] int32 rows of the block that hold pairs
    hidden,
    inter,
    group_n,  # bn: weight rows per scale row
    half_blocks,  # ceil(I/bn): the up half's first scale row
    stride_xt,
    stride_xh,
    stride_xst,
    stride_xsk,
    stride_we,
    stride_wn,
    stride_wh,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ap,
    stride_ai,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = bk, the activation group and the weight's K scale block
    USE_FP8_DOT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid_m, pid_n = block_and_tile(tl.cdiv(inter, BLOCK_N))
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < tl.load(block_rows_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + offs_m, mask=valid, other=0)  # [BM]
    tokens = (pairs // NUM_SLOTS).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    x_ptrs = xq_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    xs_ptrs = xs_ptr + tokens * stride_xst  # [BM]
    # [BK, BN] tiles of w13[e].T: gate rows n, up rows I + n; their scale rows [BN]
    expert = expert.to(tl.int64)
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
    up_ptrs = gate_ptrs + inter * stride_wn
    gate_s_ptrs = s13_ptr + expert * stride_se + (offs_n // group_n) * stride_sn
    up_s_ptrs = gate_s_ptrs + half_blocks * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_mask = offs_k < hidden - kb * BLOCK_K
        xq = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] e4m3
        x_scale = tl.load(xs_ptrs + kb * stride_xsk, mask=valid, other=0.0)  # [BM]
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
        sg = tl.load(gate_s_ptrs + kb * stride_sk, mask=n_mask, other=0.0)  # [BN]
        su = tl.load(up_s_ptrs + kb * stride_sk, mask=n_mask, other=0.0)
        if not USE_FP8_DOT:  # before sm_89: e4m3 values are exact in fp16
            xq, wg, wu = xq.to(tl.float16), wg.to(tl.float16), wu.to(tl.float16)
        acc_gate += tl.dot(xq, wg) * (x_scale[:, None] * sg[None, :])
        acc_up += tl.dot(xq, wu) * (x_scale[:, None] * su[None, :])
        x_ptrs += BLOCK_K * stride_xh
        gate_ptrs += BLOCK_K * stride_wh
        up_ptrs += BLOCK_K * stride_wh
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SwiGLU in fp32
    act_ptrs = act_ptr + pairs.to(tl.int64)[:, None] * stride_ap + offs_n[None, :] * stride_ai
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _fp8_down_kernel(
    aq_ptr,  # [T*S, I] e4m3: act quantised per pair and bk channels
    as_ptr,  # [T*S, ceil(I/bk)] fp32 scales
    w2_ptr,  # [E, H, I] e4m3
    s2_ptr,  # [E, ceil(H/bn), ceil(I/bk)] fp32
    weights_ptr,  # [T, S] routing weights, any float dtype and strides
    part_ptr,  # [SPLIT_K, T*S, H] out: fp32 when split, else x's dtype
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32
    block_experts_ptr,  # [num_blocks] int32
    block_rows_ptr,  # [num_blocks] int32
    hidden,
    inter,
    group_n,
    stride_ap,
    stride_ai,
    stride_asp,
    stride_ask,
    stride_we,
    stride_wh,
    stride_wi,
    stride_se,
    stride_sh,
    stride_sk,
    stride_gt,
    stride_gs,
    stride_ps,
    stride_pp,
    stride_ph,
    NUM_SLOTS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = bk
    USE_FP8_DOT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid_m, pid_n = block_and_tile(tl.cdiv(hidden, BLOCK_N))
    pid_k = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < tl.load(block_rows_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + offs_m, mask=valid, other=0)  # [BM]
    rows = pairs.to(tl.int64)
    # This program's share of the K (= intermediate) groups, whole groups; it may be empty (zeros).
    groups = tl.cdiv(inter, BLOCK_K)
    per_split = tl.cdiv(groups, SPLIT_K)
    kb_lo = pid_k * per_split
    kb_hi = tl.minimum(groups, kb_lo + per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < hidden
    k0 = kb_lo * BLOCK_K
    a_ptrs = aq_ptr + rows[:, None] * stride_ap + (k0 + offs_k)[None, :] * stride_ai  # [BM, BK]
    as_ptrs = as_ptr + rows * stride_asp  # [BM]
    expert = expert.to(tl.int64)
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wh + (k0 + offs_k)[:, None] * stride_wi
    s_ptrs = s2_ptr + expert * stride_se + (offs_n // group_n) * stride_sh  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k_mask = offs_k < inter - kb * BLOCK_K
        aq = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] e4m3
        a_scale = tl.load(as_ptrs + kb * stride_ask, mask=valid, other=0.0)  # [BM]
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        ws = tl.load(s_ptrs + kb * stride_sk, mask=n_mask, other=0.0)
        if not USE_FP8_DOT:
            aq, w = aq.to(tl.float16), w.to(tl.float16)
        acc += tl.dot(aq, w) * (a_scale[:, None] * ws[None, :])
        a_ptrs += BLOCK_K * stride_ai
        w_ptrs += BLOCK_K * stride_wi
    tokens, slots = rows // NUM_SLOTS, rows % NUM_SLOTS
    weight = tl.load(weights_ptr + tokens * stride_gt + slots * stride_gs, mask=valid, other=0.0)
    acc *= weight.to(tl.float32)[:, None]
    out_ptrs = part_ptr + pid_k * stride_ps + rows[:, None] * stride_pp + offs_n[None, :] * stride_ph
    tl.store(out_ptrs, acc.to(part_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _launch(block_m: int, tiles: GemmTiles) -> dict:
    return dict(
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: tuple[int, int],
    config: ExpertsConfig,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """`experts` with explicit tiles (their BLOCK_K is ignored: it is bk); bk a power of two >= 16, T > 0;
    `xq`: x quantised already (no quantiser launch for x)."""
    t, hidden = x.shape
    num_experts, _, inter = w2.shape
    bn, bk = block
    slots = ids.shape[1]
    n = t * slots
    sorted_pairs, block_experts, block_rows = align_block_size(ids, num_experts, config.block_m)
    num_blocks = block_experts.numel()
    table = (sorted_pairs, block_experts, block_rows)
    common = dict(NUM_SLOTS=slots, BLOCK_K=bk, USE_FP8_DOT=has_fp8_dot(x.device))

    if xq is not None and xq.fits(x, bk):
        xq, xs = xq.q, xq.scale  # [T, H] e4m3, [T, ceil(H/bk)] fp32
    else:
        xq, xs = quantize_fp8_per_token_group(x, bk)
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # [T*S, I]
    tiles = config.gate_up
    _fp8_gate_up_kernel[(num_blocks * triton.cdiv(inter, tiles.block_n),)](
        xq, xs, w13, w13_scale, act, *table, hidden, inter, bn, triton.cdiv(inter, bn),
        xq.stride(0), xq.stride(1), xs.stride(0), xs.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2), act.stride(0), act.stride(1),
        **common, **_launch(config.block_m, tiles), **pdl_launch()
    )  # fmt: skip
    aq, as_ = quantize_fp8_per_token_group(act, bk)  # [T*S, I] e4m3, [T*S, ceil(I/bk)] fp32
    split, tiles = config.split_k, config.down
    part = torch.empty(split, n, hidden, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    _fp8_down_kernel[(num_blocks * triton.cdiv(hidden, tiles.block_n), split)](
        aq, as_, w2, w2_scale, weights, part, *table, hidden, inter, bn,
        aq.stride(0), aq.stride(1), as_.stride(0), as_.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2), weights.stride(0), weights.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        SPLIT_K=split, **common, **_launch(config.block_m, tiles), **pdl_launch()
    )  # fmt: skip
    return combine(part, t, slots, x.dtype, shared_out, shared_gate)


def choose(num_tokens: int, x: torch.Tensor, w2: torch.Tensor, top_k: int, bk: int) -> ExpertsConfig:
    """Tiles for the FP8 experts: a tuned entry keyed by float8_e4m3fn (bf16 tunings do not apply), else the
    shape rules for x's dtype; BLOCK_K forced to bk either way."""
    num_experts, hidden, inter = w2.shape
    key = table_key(num_experts, hidden, inter, top_k, torch.float8_e4m3fn)
    config = tuned_config(num_tokens, key, x.device) or choose_config(num_tokens, top_k, num_experts, x.dtype)
    return dataclasses.replace(
        config,
        gate_up=dataclasses.replace(config.gate_up, block_k=bk),
        down=dataclasses.replace(config.down, block_k=bk),
    )


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """`moe.experts_fp8` on Triton; x [T, H] -> [T, H]."""
    args = (x, w13, w13_scale, w2, w2_scale, weights, ids, block, shared_out, shared_gate)
    bk = block[1]
    # BLOCK_K is the scale group and tl.dot wants a power of two >= 16 (real checkpoints: 128); other
    # activation dtypes, other weight dtypes and empty batches go to the reference.
    fp8 = w13.dtype == w2.dtype == torch.float8_e4m3fn
    shapes = x.dim() == ids.dim() == 2 and x.shape[0] > 0 and ids.shape[1] > 0
    if fp8 and shapes and x.dtype in _ACT_DTYPES and ids.numel() <= gemv.MAX_PAIRS:
        dispatch.choose("moe_experts_fp8", "triton-gemv")
        return gemv.experts_fp8(*args, xq=xq)  # a few tokens: stream each pair's expert rows, no align
    if bk < 16 or bk & (bk - 1) or not (fp8 and shapes and x.dtype in _ACT_DTYPES):
        reason = dispatch.first_failed(
            (x.shape[0] > 0 and ids.shape[-1] > 0, dispatch.EMPTY),
            (x.dim() == ids.dim() == 2, "x is not [T, H] or ids not [T, S]"),
            (fp8, "expert weights are not float8_e4m3fn"),
            (x.dtype in _ACT_DTYPES, "x's dtype is not fp16, bf16 or fp32"),
            (bk >= 16 and not bk & (bk - 1), "scale block K is not a power of two >= 16 (tl.dot)"),
        )
        dispatch.fallback("moe_experts_fp8", reason, expected=reason == dispatch.EMPTY, x=x, w13=w13, ids=ids)
        return reference.fp8_experts(*args, xq)
    dispatch.choose("moe_experts_fp8", "triton-grouped")
    config = choose(x.shape[0], x, w2, ids.shape[1], bk)
    return fused_experts(
        x, w13, w13_scale, w2, w2_scale, weights, ids, block, config, shared_out, shared_gate, xq
    )
