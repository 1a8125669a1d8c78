"""Triton MoE: fused top-k softmax routing; the experts as two grouped GEMMs over sorted rows, then a combine.

`experts` groups the T*S (token, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M
(`align.align_block_size`, vLLM's "moe_align_block_size"), so every BLOCK_M rows of the sorted list belong to
one expert. Expert id E (one past the routed experts) is the shared expert, whose weights come as separate
tensors: it is one more slot of every token, weighted by sigmoid(its gate logit). Then
  1. gate/up GEMM: act[pair] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   -> [T*S, I]
  2. down GEMM:    part[pair] = weight[pair] * (act[pair] @ w2[e].T)                        -> [T*S, H]
     (optionally split over I into fp32 partial sums, `ExpertsConfig.split_k`)
  3. combine:      out[token] = sum over its slots (and splits) of part, in fp32            -> [T, H]
     (plus, for an FP8 shared expert run outside, shared_gate * shared_out; `moe.combine`)
Four launches in all (align takes two above 256 pairs); each choice comes from shapes, none from data, so
all of it can be captured in a CUDA graph. See `config.choose_config` for the blocks.

The two GEMM kernels also run the W8A8 FP8 experts (`moe.fp8`, USE_FP8): e4m3 x or act with fp32 scales per
(row, bk channels), e4m3 weights with block scales, and no separate shared expert (FP8 stacks it as expert E).
The arguments one mode does not read are passed as None, which Triton makes a constexpr, not a kernel
parameter, and the FP8 mode keeps its own K indices (K steps, which index the scale columns, where the other
counts channels): each mode compiles to the code of the separate kernel it replaced (sm_90 PTX, every launch
of `tests/engine/kernels/launch_calls*.py` compared), so the H200 tunings hold for both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.moe import gemv, reference
from engine.kernels.moe.align import _align_kernel, _count_kernel, align_block_size  # noqa: F401 (sm_90 test)
from engine.kernels.moe.combine import block_and_tile, combine, expert_rows
from engine.kernels.moe.config import ExpertsConfig, GemmTiles, choose_config, table_key, tuned_config
from engine.kernels.pdl import pdl_launch, pdl_wait

_DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E (+1)] any float dtype; with HAS_SHARED the last column is the shared expert's gate
    weights_ptr,  # [T, TOP_K (+1)] fp32
    ids_ptr,  # [T, TOP_K (+1)] int64
    num_experts,
    stride_lt,
    stride_le,
    TOP_K: tl.constexpr,
    OUT_SLOTS: tl.constexpr,  # TOP_K (+1 with HAS_SHARED)
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_RENORM: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
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
    if HAS_SHARED:  # slot TOP_K: the shared expert (id E), weight sigmoid(gate logit)
        gate = tl.load(logits_ptr + row * stride_lt + num_experts * stride_le).to(tl.float32)
        top_w = tl.where(slots == TOP_K, tl.sigmoid(gate), top_w)
        top_i = tl.where(slots == TOP_K, num_experts, top_i)
    out = row * OUT_SLOTS + slots
    tl.store(weights_ptr + out, top_w, mask=slots < OUT_SLOTS)
    tl.store(ids_ptr + out, top_i, mask=slots < OUT_SLOTS)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` on Triton: weights [..., k (+1)] fp32, ids [..., k (+1)] int64, logits [..., E (+1)]."""
    num_experts = router_logits.shape[-1] - shared
    # The reference raises on top_k > E; rows of more than 8192 experts would not fit one program.
    if not 0 < top_k <= num_experts or num_experts > 8192 or router_logits.numel() == 0:
        empty = router_logits.numel() == 0
        reason = dispatch.EMPTY if empty else "top_k not in 1..E, or more than 8192 experts"
        dispatch.fallback("moe_route", reason, expected=empty, router_logits=router_logits)
        return reference.route(router_logits, top_k, renormalize, shared)
    logits = router_logits.reshape(-1, router_logits.shape[-1])  # [T, E (+1)]
    t, slots = logits.shape[0], top_k + shared
    weights = torch.empty(t, slots, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, slots, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(t,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        logits.stride(1),
        TOP_K=top_k,
        OUT_SLOTS=slots,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(slots),
        USE_RENORM=renormalize,
        HAS_SHARED=shared,
        num_warps=max(1, min(8, block_e // 256)),
        **pdl_launch(),
    )
    lead = router_logits.shape[:-1]
    return weights.view(*lead, slots), ids.view(*lead, slots)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]; with USE_FP8 e4m3, x quantised per token and bk channels
    xs_ptr,  # [T, ceil(H/bk)] fp32 scales of x (USE_FP8)
    w13_ptr,  # [E, 2I, H]: gate rows, then up rows; e4m3 with USE_FP8
    ws13_ptr,  # [2Is, H] the shared expert's, id E (not with USE_FP8, which stacks it as expert E)
    scale_ptr,  # [E, 2 * ceil(I/bn), ceil(H/bk)] fp32 (USE_FP8): gate row blocks, then up row blocks
    act_ptr,  # [T*S, max(I, Is)] out, x's dtype (before quantisation)
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32 pair ids
    block_experts_ptr,  # [num_blocks] int32; -1 marks an unused block
    block_rows_ptr,  # [num_blocks] int32 rows of the block that hold pairs
    hidden,
    inter,
    shared_inter,  # not with USE_FP8
    num_experts,  # not with USE_FP8
    group_n,  # USE_FP8: bn, weight rows per scale row
    half_blocks,  # USE_FP8: ceil(I/bn), the up half's first scale row
    stride_xt,
    stride_xh,
    stride_xst,
    stride_xsk,
    stride_we,
    stride_wn,
    stride_wh,  # = the shared expert's K stride
    stride_sn,
    stride_ce,
    stride_cn,
    stride_ck,
    stride_ap,
    stride_ai,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # USE_FP8: = bk, the activation group and the weight's K scale block
    USE_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr = None,  # without USE_FP8: tl.dot's input_precision
    USE_FP8_DOT: tl.constexpr = None,  # with USE_FP8: e4m3 tl.dot (sm_89+), else on fp16 copies
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    # FP8 has no separate shared expert (stacked as expert E): every expert has I rows.
    pid_m, pid_n = block_and_tile(tl.cdiv(inter if USE_FP8 else tl.maximum(inter, shared_inter), BLOCK_N))
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    if USE_FP8:
        inter_e = inter
    else:
        w_ptr, stride_n, inter_e = expert_rows(
            w13_ptr, ws13_ptr, expert, num_experts, stride_we, stride_wn, stride_sn, inter, shared_inter
        )
        if pid_n * BLOCK_N >= inter_e:  # the N grid covers max(I, Is)
            return
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < tl.load(block_rows_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + offs_m, mask=valid, other=0)  # [BM]
    tokens = (pairs // NUM_SLOTS).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter_e
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    if USE_FP8:
        xs_ptrs = xs_ptr + tokens * stride_xst  # [BM]
        expert = expert.to(tl.int64)
        w_ptr, stride_n = w13_ptr + expert * stride_we, stride_wn
    # [BK, BN] tiles of w13[e].T: gate rows n, up rows I + n
    gate_ptrs = w_ptr + offs_n[None, :] * stride_n + offs_k[:, None] * stride_wh
    up_ptrs = gate_ptrs + inter_e * stride_n
    if USE_FP8:  # the tiles' scale rows [BN]
        gate_s_ptrs = scale_ptr + expert * stride_ce + (offs_n // group_n) * stride_cn
        up_s_ptrs = gate_s_ptrs + half_blocks * stride_cn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # FP8 counts K steps (k indexes the scale columns), the other mode channels.
    for k in range(0, tl.cdiv(hidden, BLOCK_K) if USE_FP8 else hidden, 1 if USE_FP8 else BLOCK_K):
        k_mask = offs_k < hidden - (k * BLOCK_K if USE_FP8 else k)
        xt = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if USE_FP8:
            x_scale = tl.load(xs_ptrs + k * stride_xsk, mask=valid, other=0.0)  # [BM]
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if USE_FP8:
            sg = tl.load(gate_s_ptrs + k * stride_ck, mask=n_mask, other=0.0)  # [BN]
            su = tl.load(up_s_ptrs + k * stride_ck, mask=n_mask, other=0.0)
            if not USE_FP8_DOT:  # before sm_89: e4m3 values are exact in fp16
                xt, wg, wu = xt.to(tl.float16), wg.to(tl.float16), wu.to(tl.float16)
            acc_gate += tl.dot(xt, wg) * (x_scale[:, None] * sg[None, :])
            acc_up += tl.dot(xt, wu) * (x_scale[:, None] * su[None, :])
        else:
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
    act_ptr,  # [T*S, max(I, Is)]; with USE_FP8 e4m3, act quantised per pair and bk channels
    as_ptr,  # [T*S, ceil(I/bk)] fp32 scales of act (USE_FP8)
    w2_ptr,  # [E, H, I]; e4m3 with USE_FP8
    ws2_ptr,  # [H, Is] the shared expert's (not with USE_FP8)
    scale_ptr,  # [E, ceil(H/bn), ceil(I/bk)] fp32 (USE_FP8)
    weights_ptr,  # [T, S] routing weights, any float dtype and strides
    part_ptr,  # [SPLIT_K, T*S, H] out: fp32 when split, else x's dtype
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32
    block_experts_ptr,  # [num_blocks] int32
    block_rows_ptr,  # [num_blocks] int32
    hidden,
    inter,
    shared_inter,  # not with USE_FP8
    num_experts,  # not with USE_FP8
    group_n,  # USE_FP8: bn
    stride_ap,
    stride_ai,
    stride_asp,
    stride_ask,
    stride_we,
    stride_wh,
    stride_wi,  # = the shared expert's K stride
    stride_sh,
    stride_ce,
    stride_cn,
    stride_ck,
    stride_gt,
    stride_gs,
    stride_ps,
    stride_pp,
    stride_ph,
    NUM_SLOTS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # USE_FP8: = bk
    USE_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr = None,  # without USE_FP8: tl.dot's input_precision
    USE_FP8_DOT: tl.constexpr = None,  # with USE_FP8: e4m3 tl.dot (sm_89+), else on fp16 copies
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid_m, pid_n = block_and_tile(tl.cdiv(hidden, BLOCK_N))
    pid_k = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    if not USE_FP8:
        w_ptr, stride_n, inter_e = expert_rows(
            w2_ptr, ws2_ptr, expert, num_experts, stride_we, stride_wh, stride_sh, inter, shared_inter
        )
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < tl.load(block_rows_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + offs_m, mask=valid, other=0)  # [BM]
    rows = pairs.to(tl.int64)
    # This program's share of the K (= intermediate) range [k_lo, k_hi), whole BLOCK_Ks; it may be empty
    # (zeros). FP8 counts K steps (k indexes the scale columns), the other mode channels.
    if USE_FP8:
        groups = tl.cdiv(inter, BLOCK_K)
        per_split = tl.cdiv(groups, SPLIT_K)
        k_lo = pid_k * per_split
        k_hi = tl.minimum(groups, k_lo + per_split)
    else:
        k_chunk = tl.cdiv(tl.cdiv(inter_e, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(inter_e, k_lo + k_chunk)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K) if USE_FP8 else k_lo + tl.arange(0, BLOCK_K)
    n_mask = offs_n < hidden
    k0 = k_lo * BLOCK_K if USE_FP8 else 0  # FP8's offs_k count from 0 (its mask bound moves instead)
    a_ptrs = act_ptr + rows[:, None] * stride_ap + (k0 + offs_k)[None, :] * stride_ai  # [BM, BK]
    if USE_FP8:
        as_ptrs = as_ptr + rows * stride_asp  # [BM]
        expert = expert.to(tl.int64)
        w_ptr, stride_n = w2_ptr + expert * stride_we, stride_wh
    w_ptrs = w_ptr + offs_n[None, :] * stride_n + (k0 + offs_k)[:, None] * stride_wi  # [BK, BN]
    if USE_FP8:
        s_ptrs = scale_ptr + expert * stride_ce + (offs_n // group_n) * stride_cn  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, 1 if USE_FP8 else BLOCK_K):
        k_mask = offs_k < (inter - k * BLOCK_K if USE_FP8 else k_hi - k + k_lo)
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if USE_FP8:
            a_scale = tl.load(as_ptrs + k * stride_ask, mask=valid, other=0.0)  # [BM]
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if USE_FP8:
            ws = tl.load(s_ptrs + k * stride_ck, mask=n_mask, other=0.0)  # [BN]
            if not USE_FP8_DOT:
                a, w = a.to(tl.float16), w.to(tl.float16)
            acc += tl.dot(a, w) * (a_scale[:, None] * ws[None, :])
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ai
        w_ptrs += BLOCK_K * stride_wi
    tokens, slots = rows // NUM_SLOTS, rows % NUM_SLOTS
    weight = tl.load(weights_ptr + tokens * stride_gt + slots * stride_gs, mask=valid, other=0.0)
    acc *= weight.to(tl.float32)[:, None]
    out_ptrs = part_ptr + pid_k * stride_ps + rows[:, None] * stride_pp + offs_n[None, :] * stride_ph
    tl.store(out_ptrs, acc.to(part_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _blocks(block_m: int, tiles: GemmTiles) -> dict:
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


# The GEMM kernels' arguments that one mode does not read, passed as None: Triton makes a None a constexpr,
# not a kernel parameter, so each mode compiles to the code of a kernel without them.
GATE_UP_FP8_ONLY = dict.fromkeys(
    ("xs_ptr", "scale_ptr", "group_n", "half_blocks", "stride_xst", "stride_xsk", "stride_ce", "stride_cn",
     "stride_ck")
)  # fmt: skip
DOWN_FP8_ONLY = dict.fromkeys(
    ("as_ptr", "scale_ptr", "group_n", "stride_asp", "stride_ask", "stride_ce", "stride_cn", "stride_ck")
)
GATE_UP_SHARED_ONLY = dict.fromkeys(("ws13_ptr", "shared_inter", "num_experts", "stride_sn"))
DOWN_SHARED_ONLY = dict.fromkeys(("ws2_ptr", "shared_inter", "num_experts", "stride_sh"))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: ExpertsConfig,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`experts` with explicit tile sizes; x, w13, w2 (and the shared weights) share one of fp16, bf16, fp32,
    and the shared weights' K strides equal the routed ones'."""
    t, hidden = x.shape
    num_experts, _, inter = w2.shape
    has_shared = shared_w13 is not None
    if not has_shared:  # no block has expert id E, so any pointer does
        shared_w13, shared_w2 = w13[0], w2[0]
    shared_inter = shared_w2.shape[1]
    slots = ids.shape[1]
    n = t * slots
    sorted_pairs, block_experts, block_rows = align_block_size(ids, num_experts + has_shared, config.block_m)
    num_blocks = block_experts.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 matches the reference, not tf32
    common = dict(
        sorted_pairs_ptr=sorted_pairs, block_experts_ptr=block_experts, block_rows_ptr=block_rows,
        hidden=hidden, inter=inter, shared_inter=shared_inter, num_experts=num_experts,
        NUM_SLOTS=slots, USE_FP8=False, DOT_PRECISION=precision,
    )  # fmt: skip

    act = torch.empty(n, max(inter, shared_inter), dtype=x.dtype, device=x.device)  # [T*S, I]
    tiles = config.gate_up
    _gate_up_kernel[(num_blocks * triton.cdiv(act.shape[1], tiles.block_n),)](
        x_ptr=x, w13_ptr=w13, ws13_ptr=shared_w13, act_ptr=act,
        stride_xt=x.stride(0), stride_xh=x.stride(1), stride_we=w13.stride(0), stride_wn=w13.stride(1),
        stride_wh=w13.stride(2), stride_sn=shared_w13.stride(0), stride_ap=act.stride(0),
        stride_ai=act.stride(1), **GATE_UP_FP8_ONLY, **common, **_blocks(config.block_m, tiles),
        **pdl_launch(),
    )  # fmt: skip
    split, tiles = config.split_k, config.down
    part = torch.empty(split, n, hidden, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    _down_kernel[(num_blocks * triton.cdiv(hidden, tiles.block_n), split)](
        act_ptr=act, w2_ptr=w2, ws2_ptr=shared_w2, weights_ptr=weights, part_ptr=part,
        stride_ap=act.stride(0), stride_ai=act.stride(1), stride_we=w2.stride(0), stride_wh=w2.stride(1),
        stride_wi=w2.stride(2), stride_sh=shared_w2.stride(0), stride_gt=weights.stride(0),
        stride_gs=weights.stride(1), stride_ps=part.stride(0), stride_pp=part.stride(1),
        stride_ph=part.stride(2), SPLIT_K=split, **DOWN_FP8_ONLY, **common, **_blocks(config.block_m, tiles),
        **pdl_launch(),
    )  # fmt: skip
    return combine(part, t, slots, x.dtype, shared_out, shared_gate)


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe.experts` on Triton; x [T, H] -> [T, H]."""
    shared = (shared_w13, shared_w2, shared_out, shared_gate)
    has_weights = shared_w13 is not None
    # Mixed dtypes (say FP8 weights) and empty batches go to the reference: tl.dot wants equal operand types.
    same = all(w.dtype == x.dtype for w in (w13, w2, shared_w13, shared_w2) if w is not None)
    strides = not has_weights or (
        shared_w13.stride(1) == w13.stride(2) and shared_w2.stride(1) == w2.stride(2)
    )
    shapes = x.dim() == ids.dim() == 2 and x.shape[0] > 0 and ids.shape[1] > 0
    if not (same and strides and shapes and x.dtype in _DOT_DTYPES):
        reason = dispatch.first_failed(
            (x.shape[0] > 0 and ids.shape[-1] > 0, dispatch.EMPTY),
            (x.dim() == ids.dim() == 2, "x is not [T, H] or ids not [T, S]"),
            (same, "expert weights' dtype differs from x's"),
            (strides, "the shared expert's K stride differs from the routed experts'"),
            (x.dtype in _DOT_DTYPES, "x's dtype is not fp16, bf16 or fp32"),
        )
        dispatch.fallback("moe_experts", reason, expected=reason == dispatch.EMPTY, x=x, w13=w13, ids=ids)
        return reference.experts(x, w13, w2, weights, ids, *shared)
    if ids.numel() <= gemv.MAX_PAIRS:  # a few tokens: stream each pair's expert rows, no align
        dispatch.choose("moe_experts", "triton-gemv")
        return gemv.experts(x, w13, w2, weights, ids, *shared)
    dispatch.choose("moe_experts", "triton-grouped")
    top_k = ids.shape[1] - has_weights
    key = table_key(w2.shape[0], x.shape[1], w2.shape[2], top_k, x.dtype)
    config = tuned_config(x.shape[0], key, x.device) or choose_config(
        x.shape[0], max(1, top_k), w2.shape[0], x.dtype
    )
    return fused_experts(x, w13, w2, weights, ids, config, *shared)
