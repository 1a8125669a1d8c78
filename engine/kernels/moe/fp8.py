"""Triton FP8 experts: the fused MoE's grouped GEMMs on block-FP8 (e4m3) expert weights, W8A8.

The same steps as `triton.fused_experts` on the same kernels (align, gate/up GEMM with the SwiGLU epilogue,
down GEMM with the routing weight, combine; the GEMMs are `triton._gate_up_kernel` and `triton._down_kernel`
with USE_FP8), with BLOCK_K = bk, one activation scale group per K step. The activations are quantised once,
before each GEMM, by `fp8.quant.quantize_fp8_per_token_group` (x per token, act per (token, slot) pair; per
row and bk channels, amax / 448): each K step then loads an e4m3 tile [BLOCK_M, bk] (x rows gathered by
token, or act rows by pair) and its scales [BLOCK_M], takes the e4m3 `tl.dot` with the weight tile
[bk, BLOCK_N] and adds it to the fp32 accumulator times x_scale[m] * w_scale[n // bn]. Quantising inside the
GEMMs instead (as an earlier version did) repeats the quantiser for every N tile of the same rows (16 times
per tile at Qwen3.5's shapes with 32- and 128-wide N tiles), and FP8 (b, 64) ran at 1,570 tok/s against
bf16's 3,349 on an H200.

Scales: w13_scale [E, 2 * ceil(I/bn), ceil(H/bk)] holds the gate half's row blocks, then the up half's (up
row n uses row ceil(I/bn) + n // bn), which is the stacked [2I, H] block scale when bn divides I; w2_scale
[E, ceil(H/bn), ceil(I/bk)]. The shared expert (FP8 `Fp8Linear`s) runs outside; the combine adds its output.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from engine.kernels import dispatch
from engine.kernels.fp8.quant import has_fp8_dot, quantize_fp8_per_token_group
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe import gemv, reference
from engine.kernels.moe.align import align_block_size
from engine.kernels.moe.combine import combine
from engine.kernels.moe.config import ExpertsConfig, GemmTiles, choose_config, table_key, tuned_config
from engine.kernels.moe.triton import (
    DOWN_SHARED_ONLY,
    GATE_UP_SHARED_ONLY,
    _down_kernel,
    _gate_up_kernel,
)
from engine.kernels.pdl import pdl_launch

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _launch(block_m: int, tiles: GemmTiles) -> dict:
    return dict(
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages
    )


def _scale_strides(scale: torch.Tensor) -> dict:
    ce, cn, ck = scale.stride()
    return dict(stride_ce=ce, stride_cn=cn, stride_ck=ck)


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
    common = dict(
        sorted_pairs_ptr=sorted_pairs, block_experts_ptr=block_experts, block_rows_ptr=block_rows,
        hidden=hidden, inter=inter, group_n=bn, NUM_SLOTS=slots, BLOCK_K=bk, USE_FP8=True,
        USE_FP8_DOT=has_fp8_dot(x.device),
    )  # fmt: skip

    if xq is not None and xq.fits(x, bk):
        xq, xs = xq.q, xq.scale  # [T, H] e4m3, [T, ceil(H/bk)] fp32
    else:
        xq, xs = quantize_fp8_per_token_group(x, bk)
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # [T*S, I]
    tiles = config.gate_up
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, tiles.block_n),)](
        x_ptr=xq, xs_ptr=xs, w13_ptr=w13, scale_ptr=w13_scale, act_ptr=act,
        half_blocks=triton.cdiv(inter, bn), stride_xt=xq.stride(0), stride_xh=xq.stride(1),
        stride_xst=xs.stride(0), stride_xsk=xs.stride(1), stride_we=w13.stride(0), stride_wn=w13.stride(1),
        stride_wh=w13.stride(2), **_scale_strides(w13_scale), stride_ap=act.stride(0),
        stride_ai=act.stride(1), **GATE_UP_SHARED_ONLY, **common, **_launch(config.block_m, tiles),
        **pdl_launch(),
    )  # fmt: skip
    aq, as_ = quantize_fp8_per_token_group(act, bk)  # [T*S, I] e4m3, [T*S, ceil(I/bk)] fp32
    split, tiles = config.split_k, config.down
    part = torch.empty(split, n, hidden, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    _down_kernel[(num_blocks * triton.cdiv(hidden, tiles.block_n), split)](
        act_ptr=aq, as_ptr=as_, w2_ptr=w2, scale_ptr=w2_scale, weights_ptr=weights, part_ptr=part,
        stride_ap=aq.stride(0), stride_ai=aq.stride(1), stride_asp=as_.stride(0), stride_ask=as_.stride(1),
        stride_we=w2.stride(0), stride_wh=w2.stride(1), stride_wi=w2.stride(2), **_scale_strides(w2_scale),
        stride_gt=weights.stride(0), stride_gs=weights.stride(1), stride_ps=part.stride(0),
        stride_pp=part.stride(1), stride_ph=part.stride(2), SPLIT_K=split, **DOWN_SHARED_ONLY, **common,
        **_launch(config.block_m, tiles), **pdl_launch(),
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
