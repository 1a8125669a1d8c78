"""Triton MoE: fused top-k softmax routing, and the routed experts as two grouped GEMMs over sorted rows.

`experts` sorts the T*k (token, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M
(vLLM's "moe_align_block_size"), so every BLOCK_M rows of the sorted list belong to one expert. Then
  1. gate/up GEMM: act[pair] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   -> [T*k, I]
  2. down GEMM:    out[pair] = weight[pair] * (act[pair] @ w2[e].T)                         -> [T*k, H]
and the k slots of each token are summed in torch. One design serves every T; see `_config` for the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.moe import reference

_DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] any float dtype
    weights_ptr,  # [T, TOP_K] fp32
    ids_ptr,  # [T, TOP_K] int64
    num_experts,
    stride_lt,
    stride_le,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_RENORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logits = tl.load(logits_ptr + row * stride_lt + offs * stride_le, mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)  # fp32 softmax, as the reference
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(mask, p, 0.0)
    p = p / tl.sum(p, 0)
    # Top-k by repeated argmax: descending like torch.topk; ties go to the lowest expert id.
    # Padding experts hold -1 so they never win over a real probability (>= 0).
    remaining = tl.where(mask, p, -1.0)
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, 0)
        idx = tl.min(tl.where(remaining == best, offs, BLOCK_E), 0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        remaining = tl.where(offs == idx, -1.0, remaining)
    if USE_RENORM:
        top_w = top_w / tl.sum(top_w, 0)  # slots >= TOP_K hold 0
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the fp32 softmax of `router_logits` [..., E]: (weights [..., k] fp32, expert ids [..., k])."""
    num_experts = router_logits.shape[-1]
    # The reference raises on top_k > E; rows of more than 8192 experts would not fit one program.
    if not 0 < top_k <= num_experts or num_experts > 8192 or router_logits.numel() == 0:
        return reference.route(router_logits, top_k, renormalize)
    logits = router_logits.reshape(-1, num_experts)  # [T, E]
    t = logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(t,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        logits.stride(1),
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        USE_RENORM=renormalize,
        num_warps=max(1, min(8, block_e // 256)),
    )
    lead = router_logits.shape[:-1]
    return weights.view(*lead, top_k), ids.view(*lead, top_k)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]: gate rows, then up rows
    act_ptr,  # [T*k, I] out, x's dtype
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32 pair ids; num_pairs marks padding
    block_experts_ptr,  # [num_blocks] int64; num_experts marks an unused block
    num_pairs,
    hidden,
    inter,
    num_experts,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_ap,
    stride_ai,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    # [BK, BN] tiles of w13[e].T: gate rows n, up rows I + n
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        xt = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
        acc_gate = tl.dot(xt, wg, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(xt, wu, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        gate_ptrs += BLOCK_K * stride_wh
        up_ptrs += BLOCK_K * stride_wh
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SwiGLU in fp32
    act_ptrs = act_ptr + pairs.to(tl.int64)[:, None] * stride_ap + offs_n[None, :] * stride_ai
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [T*k, I]
    w2_ptr,  # [E, H, I]
    weights_ptr,  # [T*k] fp32 routing weights
    out_ptr,  # [T*k, H] out, x's dtype
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32
    block_experts_ptr,  # [num_blocks] int64
    num_pairs,
    hidden,
    inter,
    num_experts,
    stride_ap,
    stride_ai,
    stride_we,
    stride_wh,
    stride_wi,
    stride_op,
    stride_oh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < hidden
    a_ptrs = act_ptr + rows[:, None] * stride_ap + offs_k[None, :] * stride_ai  # [BM, BK]
    w_ptrs = (
        w2_ptr + expert * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None] * stride_wi
    )  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ai
        w_ptrs += BLOCK_K * stride_wi
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_op + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class ExpertsConfig:
    """Tile sizes of both grouped GEMMs (BLOCK_M also sets the padding of each expert's rows)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> ExpertsConfig:
    """Blocks by the mean rows per expert (shapes only, so no host sync); untuned starting points for H200.

    Decode (a handful of rows per expert) is bound by reading expert weights: short M tiles waste less MMA
    work on padding, and narrow N tiles give more programs to stream weights with. A dedicated small-batch
    path would go further: one program per (pair, N tile) doing a GEMV with tl.sum instead of padding to 16
    rows, split-K over H for the gate/up GEMM so more SMs read weights at once, and the down GEMM plus the
    k-slot sum fused (atomics or one program per token) to skip the [T*k, H] round trip.
    """
    rows_per_expert = num_pairs / num_experts
    wide = dtype == torch.float32  # 4-byte elements: halve K so a stage fits shared memory
    if rows_per_expert <= 16:
        return ExpertsConfig(16, 32, 64 if wide else 128, num_stages=3 if wide else 4)
    if rows_per_expert <= 64:
        return ExpertsConfig(32, 64, 32 if wide else 64, num_stages=3 if wide else 4)
    return ExpertsConfig(64, 64, 32 if wide else 64, num_stages=2 if wide else 3)


def align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pair ids (token * k + slot) sorted by expert, each expert's run padded to a multiple of `block_m`.

    Returns (sorted_pairs [num_blocks * block_m] int32, padding = T*k; block_experts [num_blocks] int64,
    num_experts for blocks past the last used one; num_blocks). num_blocks is an upper bound from shapes
    alone (each expert that has rows wastes under one block), so nothing here syncs with the host.
    """
    flat = ids.reshape(-1)  # [N]
    n = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync on CUDA
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    row_start = (block_end - blocks) * block_m  # [E] first padded row of each expert
    count_start = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    order = torch.argsort(flat, stable=True)  # [N] pair ids grouped by expert
    sorted_experts = flat[order]
    dest = row_start[sorted_experts] + torch.arange(n, device=device) - count_start[sorted_experts]
    sorted_pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_ids = torch.arange(num_blocks, dtype=torch.int64, device=device)
    block_experts = torch.searchsorted(block_end, block_ids, right=True)  # [num_blocks]
    return sorted_pairs, block_experts, num_blocks


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: ExpertsConfig,
) -> torch.Tensor:
    """`experts` with explicit tile sizes; x, w13 and w2 share one of fp16, bf16, fp32."""
    t, hidden = x.shape
    num_experts, _, inter = w2.shape
    top_k = ids.shape[-1]
    n = t * top_k
    sorted_pairs, block_experts, num_blocks = align_block_size(
        ids.to(torch.int64), num_experts, config.block_m
    )
    flat_weights = weights.reshape(-1).to(torch.float32)  # [N]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 matches the reference, not tf32
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    blocks = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k)

    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, config.block_n))](
        x, w13, act, sorted_pairs, block_experts, n, hidden, inter, num_experts,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), act.stride(1),
        TOP_K=top_k, DOT_PRECISION=precision, **blocks, **launch,
    )  # fmt: skip
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)  # [T*k, H]
    _down_kernel[(num_blocks, triton.cdiv(hidden, config.block_n))](
        act, w2, flat_weights, out, sorted_pairs, block_experts, n, hidden, inter, num_experts,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        DOT_PRECISION=precision, **blocks, **launch,
    )  # fmt: skip
    return out.view(t, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)  # [T, H]


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Sum over each token's experts of weight * down(silu(gate(x)) * up(x)); x [T, H] -> [T, H]."""
    # Mixed dtypes (say FP8 weights) and empty batches go to the reference: tl.dot wants equal operand types.
    same = x.dtype == w13.dtype == w2.dtype and x.dtype in _DOT_DTYPES
    if not same or x.dim() != 2 or ids.dim() != 2 or x.shape[0] == 0 or ids.shape[1] == 0:
        return reference.experts(x, w13, w2, weights, ids)
    config = _config(ids.numel(), w2.shape[0], x.dtype)
    return fused_experts(x, w13, w2, weights, ids, config)
