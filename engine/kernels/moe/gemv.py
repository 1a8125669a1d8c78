"""Triton MoE experts for a few tokens: one program per (pair, output tile), no sort by expert.

At decode (T = 1..8 tokens, so 9..72 (token, slot) pairs) the grouped GEMMs of `moe.triton` load 16-row
`tl.dot` tiles for one useful row, pay the align step, and launch too few programs (experts x N tiles) to
keep HBM busy. Here every pair reads its own expert's weight rows directly (ids[pair], no align), and the
M = 1 products are multiply + sum in fp32 on the CUDA cores, which at this size cost far less than the
weight bytes they consume:
  1. gate_up, grid (pair, I tile of BLOCK_N):  act[pair] = silu(x[token] . gate rows) * (x[token] . up rows)
  2. down,    grid (pair, H tile of BLOCK_N):  part[pair] = weight[pair] * (act[pair] . w2[e] rows), fp32
  3. `combine.combine`:                        out[token] = sum of its slots' parts in slot order (+ an FP8
     shared expert's shared_gate * shared_out)
At T = 1 with the real shapes (I 512, H 2048) that is 9 x 64 gate_up and 9 x 128 down programs (several per
SM of an H200's 132), each loading whole 1 KB runs of weight rows per step (`GemvTiles.k_bytes`): 16 KB per
gate_up step (8 gate + 8 up rows), 16 KB for a down program's whole K. That is enough programs without
splitting K, which for gate_up would need a second pass before the SwiGLU. The down
step keeps one program per pair and H tile and sums the slots in a separate combine, rather than looping
over a token's slots inside the program: at T = 1 the loop would leave 9 times fewer programs, each waiting
on its slots' loads one after the other, while per-pair programs put all 18 MB of down weights in flight at
once; the combine reads back 9 x H fp32 per token (74 KB at T = 1), small beside that. No atomics: the sum
order is fixed, so results are equal run to run.

The pair axis is the fastest in the launch order, so the programs running together share an N tile across
all pairs: pairs of the same expert (the shared expert of every token, a routed expert picked twice) read the
same rows at about the same time, mostly from L2.

FP8 (`experts_fp8`): e4m3 weights with block scales; the activation (x, then act rounded to x's dtype) is
quantised per token and K group inside each program with `fp8.quant.quantize_rows` (as
`fp8.reference.quantize_fp8_per_token_group`), and each K group's e4m3 products sum exactly in fp32 before
the x_scale * w_scale multiply: W8A8 as `fp8.reference.fp8_block_linear`. When x comes quantised already
(`xq`, from the norm before the block), gate_up reads its e4m3 values and scales instead of quantising x
again in each of its programs (64 per pair at the real shapes).
Everything is chosen from shapes, so the three launches can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8.quant import quantize_rows
from engine.kernels.fp8.reference import AMAX_EPS, FP8_MAX, Fp8Activation
from engine.kernels.moe import reference
from engine.kernels.moe.combine import combine, expert_rows
from engine.kernels.pdl import pdl_launch, pdl_wait

# Pairs (T * S) up to which the dispatcher prefers this path. Each pair re-reads its expert, where the
# grouped GEMM reads each distinct expert once (256 experts, top-8: pairs / distinct experts is 1.07 at T = 2,
# 1.4 at 16), but it skips the align step and streams better at small T. H200, bf16, whole MoE block, the
# same routed inputs (`benchmarks/kernels_moe.py --gemv`, 2026-11-30): T = 8 (72 pairs) grouped 112 us,
# gemv 92; T = 16 (144) 188 against 159; T = 32 (288) 257 against 274; T = 64 344 against 476. So up to
# T = 16 with the shared slot (T = 18 in FP8, where the shared expert runs outside).
MAX_PAIRS = 144

_FP8_MAX = tl.constexpr(FP8_MAX)  # globals a kernel reads must be constexprs
_AMAX_EPS = tl.constexpr(AMAX_EPS)


@dataclass(frozen=True)
class GemvTiles:
    """Output rows per program (gate_up's act columns, down's hidden rows) and the weight bytes of one row
    each loop step loads (whole K groups, at most the row)."""

    up_n: int = 8
    down_n: int = 16
    k_bytes: int = 1024
    num_warps: int = 4
    down_k_bytes: int | None = None  # the down kernel's own, when they differ (None: k_bytes, num_warps)
    down_warps: int | None = None


# FP8 weights, by token count: an H200 sweep (`benchmarks/fp8_decode_tiles.py --parts gemv`, b8bb4ee, graphs,
# cold weights, x quantised by the norm, us per MoE block's experts with the shared expert stacked) against
# the bf16 tiles: T = 1 13.1 vs 15.8, T = 4 32.3 vs 41.7, T = 16 94.0 vs 138.8. Half as many bytes per weight
# row as bf16 want narrower K steps (512 B) and, in down, more rows per program.
FP8_TILES = {
    1: GemvTiles(up_n=4, down_n=32, k_bytes=512, num_warps=4, down_k_bytes=256, down_warps=4),
    8: GemvTiles(up_n=8, down_n=32, k_bytes=512, num_warps=2, down_k_bytes=256, down_warps=2),
    16: GemvTiles(up_n=8, down_n=64, k_bytes=512, num_warps=2, down_k_bytes=256, down_warps=2),
}


def fp8_tiles(tokens: int) -> GemvTiles:
    """The FP8 tiles for `tokens` rows: the entry of the smallest tuned count at or above it."""
    return FP8_TILES[next((t for t in sorted(FP8_TILES) if tokens <= t), max(FP8_TILES))]


def _k_blocks(k: int, elem_bytes: int, k_bytes: int, group: int | None) -> dict:
    """GROUP (channels per K group: the FP8 scale block, else a power of two of at most 128), its padded width
    BLOCK_C and KG groups per step, from the K size and the bytes per row and step."""
    elems = max(1, k_bytes // elem_bytes)
    if group is None:
        group = min(128, triton.next_power_of_2(k), 1 << (elems.bit_length() - 1))
    per_step = max(1, elems // group)
    kg = min(1 << (per_step.bit_length() - 1), triton.next_power_of_2(triton.cdiv(k, group)))
    return dict(GROUP=group, BLOCK_C=triton.next_power_of_2(group), KG=kg)


@triton.jit
def _group_sums(w, a, a_scale, w_scale, USE_FP8: tl.constexpr):
    """The KG groups' sums of w [BN, KG, BC] * a [KG, BC] in fp32 -> [BN, KG]; with USE_FP8 (a quantised, the
    e4m3 products exact in fp32) each group's sum is then scaled by a_scale [KG] * w_scale [BN, KG]."""
    sums = tl.sum(w.to(tl.float32) * a[None, :, :], 2)
    if USE_FP8:
        sums = sums * w_scale * a_scale[None, :]
    return sums


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]; e4m3 with X_QUANT
    xs_ptr,  # [T, ceil(H/bk)] fp32 scales of x, read with X_QUANT
    ids_ptr,  # [T, S] expert ids, any integer dtype; E is the shared expert
    w13_ptr,  # [E, 2I, H]: gate rows, then up rows; e4m3 with USE_FP8
    ws13_ptr,  # [2Is, H] the shared expert's (not with USE_FP8)
    scale_ptr,  # [E, 2 * ceil(I/bn), ceil(H/bk)] fp32 with USE_FP8: gate's row blocks, then up's
    act_ptr,  # [T*S, max(I, Is)] out, x's dtype
    hidden,
    inter,
    shared_inter,
    num_experts,
    scale_rows_up,  # ceil(I/bn): the up half's first scale row
    block_rows,  # bn: weight rows per scale row
    stride_xt,
    stride_xh,
    stride_xst,
    stride_xsk,
    stride_it,
    stride_is,
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
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,  # channels per K group (the FP8 scale block)
    BLOCK_C: tl.constexpr,  # next_power_of_2(GROUP)
    KG: tl.constexpr,  # K groups per step
    USE_FP8: tl.constexpr,
    X_QUANT: tl.constexpr = False,  # with USE_FP8: x given as e4m3 with its scales
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (pair // NUM_SLOTS).to(tl.int64)
    expert = tl.load(ids_ptr + token * stride_it + (pair % NUM_SLOTS) * stride_is)
    w_ptr, stride_n, inter_e = expert_rows(
        w13_ptr, ws13_ptr, expert, num_experts, stride_we, stride_wn, stride_sn, inter, shared_inter
    )
    if pid_n * BLOCK_N >= inter_e:  # the N grid covers max(I, Is)
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, KG)
    offs_c = tl.arange(0, BLOCK_C)
    offs_k = offs_g[:, None] * GROUP + offs_c[None, :]  # [KG, BC] channels of one step
    n_mask = offs_n < inter_e
    x_ptrs = x_ptr + token * stride_xt + offs_k * stride_xh
    xs_ptrs = xs_ptr + token * stride_xst + offs_g * stride_xsk  # [KG], with X_QUANT
    gate_ptrs = w_ptr + offs_n[:, None, None] * stride_n + offs_k[None, :, :] * stride_wh  # [BN, KG, BC]
    up_ptrs = gate_ptrs + inter_e * stride_n
    gate_s_ptrs = scale_ptr + expert.to(tl.int64) * stride_ce + offs_g[None, :] * stride_ck  # [BN, KG]
    gate_s_ptrs += (offs_n // block_rows)[:, None] * stride_cn
    up_s_ptrs = gate_s_ptrs + scale_rows_up * stride_cn
    acc_gate = tl.zeros([BLOCK_N, KG], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, KG], dtype=tl.float32)
    for k0 in range(0, hidden, KG * GROUP):
        k_mask = (offs_c[None, :] < GROUP) & (offs_k < hidden - k0)  # [KG, BC]
        # Both weight tiles are requested before anything waits (x's layout change and the sums synchronise).
        w_mask = n_mask[:, None, None] & k_mask[None, :, :]
        w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        s_gate = tl.zeros([BLOCK_N, KG], dtype=tl.float32)
        s_up = s_gate
        if USE_FP8:
            s_mask = n_mask[:, None] & (offs_g[None, :] * GROUP < hidden - k0)
            s_gate = tl.load(gate_s_ptrs, mask=s_mask, other=0.0)
            s_up = tl.load(up_s_ptrs, mask=s_mask, other=0.0)
        xt = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        x_scale = tl.zeros([KG], dtype=tl.float32)
        if X_QUANT:  # xt holds x's e4m3 values
            x_scale = tl.load(xs_ptrs, mask=offs_g * GROUP < hidden - k0, other=0.0)
        elif USE_FP8:  # one group per row, masked channels 0: as the reference quantiser
            xt, x_scale = quantize_rows(xt, _FP8_MAX, _AMAX_EPS)
        acc_gate += _group_sums(w_gate, xt, x_scale, s_gate, USE_FP8)
        acc_up += _group_sums(w_up, xt, x_scale, s_up, USE_FP8)
        x_ptrs += KG * GROUP * stride_xh
        xs_ptrs += KG * stride_xsk
        gate_ptrs += KG * GROUP * stride_wh
        up_ptrs += KG * GROUP * stride_wh
        gate_s_ptrs += KG * stride_ck
        up_s_ptrs += KG * stride_ck
    gate = tl.sum(acc_gate, 1)
    act = gate * tl.sigmoid(gate) * tl.sum(acc_up, 1)  # SwiGLU in fp32
    act_ptrs = act_ptr + pair.to(tl.int64) * stride_ap + offs_n * stride_ai
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_kernel(
    act_ptr,  # [T*S, max(I, Is)] x's dtype
    ids_ptr,  # [T, S]
    weights_ptr,  # [T, S] routing weights, any float dtype
    w2_ptr,  # [E, H, I]; e4m3 with USE_FP8
    ws2_ptr,  # [H, Is] the shared expert's (not with USE_FP8)
    scale_ptr,  # [E, ceil(H/bn), ceil(I/bk)] fp32 with USE_FP8
    part_ptr,  # [T*S, H] out, fp32
    hidden,
    inter,
    shared_inter,
    num_experts,
    block_rows,  # bn
    stride_ap,
    stride_ai,
    stride_it,
    stride_is,
    stride_gt,
    stride_gs,
    stride_we,
    stride_wh,
    stride_wi,  # = the shared expert's K stride
    stride_sh,
    stride_ce,
    stride_cn,
    stride_ck,
    stride_pp,
    stride_ph,
    NUM_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    KG: tl.constexpr,
    USE_FP8: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    token, slot = pair // NUM_SLOTS, pair % NUM_SLOTS
    expert = tl.load(ids_ptr + token * stride_it + slot * stride_is)
    w_ptr, stride_n, inter_e = expert_rows(
        w2_ptr, ws2_ptr, expert, num_experts, stride_we, stride_wh, stride_sh, inter, shared_inter
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, KG)
    offs_c = tl.arange(0, BLOCK_C)
    offs_k = offs_g[:, None] * GROUP + offs_c[None, :]  # [KG, BC]
    n_mask = offs_n < hidden
    a_ptrs = act_ptr + pair * stride_ap + offs_k * stride_ai
    w_ptrs = w_ptr + offs_n[:, None, None] * stride_n + offs_k[None, :, :] * stride_wi  # [BN, KG, BC]
    s_ptrs = scale_ptr + expert.to(tl.int64) * stride_ce + offs_g[None, :] * stride_ck  # [BN, KG]
    s_ptrs += (offs_n // block_rows)[:, None] * stride_cn
    acc = tl.zeros([BLOCK_N, KG], dtype=tl.float32)
    for k0 in range(0, inter_e, KG * GROUP):
        k_mask = (offs_c[None, :] < GROUP) & (offs_k < inter_e - k0)
        w = tl.load(w_ptrs, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0)
        w_scale = tl.zeros([BLOCK_N, KG], dtype=tl.float32)
        if USE_FP8:
            w_scale = tl.load(
                s_ptrs, mask=n_mask[:, None] & (offs_g[None, :] * GROUP < inter_e - k0), other=0.0
            )
        a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        a_scale = tl.zeros([KG], dtype=tl.float32)
        if USE_FP8:
            a, a_scale = quantize_rows(a, _FP8_MAX, _AMAX_EPS)
        acc += _group_sums(w, a, a_scale, w_scale, USE_FP8)
        a_ptrs += KG * GROUP * stride_ai
        w_ptrs += KG * GROUP * stride_wi
        s_ptrs += KG * stride_ck
    weight = tl.load(weights_ptr + token * stride_gt + slot * stride_gs).to(tl.float32)
    out = tl.sum(acc, 1) * weight
    tl.store(part_ptr + pair * stride_pp + offs_n * stride_ph, out, mask=n_mask)


def _scale_strides(scale: torch.Tensor | None) -> dict:
    ce, cn, ck = scale.stride() if scale is not None else (0, 0, 0)
    return dict(stride_ce=ce, stride_cn=cn, stride_ck=ck)


def _run(x, w13, w2, weights, ids, shared, scales, block, extra, tiles: GemvTiles, xq=None) -> torch.Tensor:
    """The three launches; `shared` is (shared_w13, shared_w2) or None, `scales` (w13_scale, w2_scale) with
    FP8 weights or None, `extra` (shared_out, shared_gate) or None; `xq` x quantised already (FP8 only)."""
    t, hidden = x.shape
    num_experts, _, inter = w2.shape
    slots = ids.shape[1]
    n = t * slots
    use_fp8 = scales is not None
    shared_w13, shared_w2 = shared if shared is not None else (w13[0], w2[0])  # no pair has id E: any do
    shared_inter = shared_w2.shape[1]
    scale13, scale2 = scales if use_fp8 else (None, None)
    bn, bk = block if use_fp8 else (1, None)
    elem = w13.element_size()
    common = dict(
        ids_ptr=ids, hidden=hidden, inter=inter, shared_inter=shared_inter, num_experts=num_experts,
        block_rows=bn, stride_it=ids.stride(0), stride_is=ids.stride(1),
        NUM_SLOTS=slots, USE_FP8=use_fp8,
    )  # fmt: skip
    down_k_bytes = tiles.down_k_bytes or tiles.k_bytes

    x_quant = use_fp8 and xq is not None
    xin, xs = (xq.q, xq.scale) if x_quant else (x, x)
    act = torch.empty(n, max(inter, shared_inter), dtype=x.dtype, device=x.device)  # [T*S, I]
    _gate_up_kernel[(n, triton.cdiv(act.shape[1], tiles.up_n))](
        x_ptr=xin, xs_ptr=xs, w13_ptr=w13, ws13_ptr=shared_w13, scale_ptr=scale13 if use_fp8 else x,
        act_ptr=act,
        scale_rows_up=triton.cdiv(inter, bn), stride_xt=xin.stride(0), stride_xh=xin.stride(1),
        stride_xst=xs.stride(0) if x_quant else 0, stride_xsk=xs.stride(1) if x_quant else 0, X_QUANT=x_quant,
        stride_we=w13.stride(0), stride_wn=w13.stride(1), stride_wh=w13.stride(2),
        stride_sn=shared_w13.stride(0), **_scale_strides(scale13),
        stride_ap=act.stride(0), stride_ai=act.stride(1),
        BLOCK_N=tiles.up_n, **_k_blocks(hidden, elem, tiles.k_bytes, bk), num_warps=tiles.num_warps, **common,
        **pdl_launch(),
    )  # fmt: skip
    part = torch.empty(n, hidden, dtype=torch.float32, device=x.device)  # [T*S, H]
    _down_kernel[(n, triton.cdiv(hidden, tiles.down_n))](
        act_ptr=act, weights_ptr=weights, w2_ptr=w2, ws2_ptr=shared_w2, scale_ptr=scale2 if use_fp8 else x,
        part_ptr=part, stride_ap=act.stride(0), stride_ai=act.stride(1),
        stride_gt=weights.stride(0), stride_gs=weights.stride(1),
        stride_we=w2.stride(0), stride_wh=w2.stride(1), stride_wi=w2.stride(2), stride_sh=shared_w2.stride(0),
        **_scale_strides(scale2), stride_pp=part.stride(0), stride_ph=part.stride(1),
        BLOCK_N=tiles.down_n, **_k_blocks(max(inter, shared_inter), elem, down_k_bytes, bk),
        num_warps=tiles.down_warps or tiles.num_warps, **common, **pdl_launch(),
    )  # fmt: skip
    return combine(part[None], t, slots, x.dtype, *(extra or (None, None)))


_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    *,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """`moe.experts` for a few tokens (up to MAX_PAIRS pairs), streaming each pair's expert rows.

    Args:
        x: [T, H] tokens, fp16, bf16 or fp32.
        w13: [E, 2I, H] gate (first I rows) and up projections; w2: [E, H, I] down projections. Any float
            dtypes, read and multiplied in fp32.
        weights, ids: [T, S] routing weights and expert ids; id E is the shared expert.
        shared_w13, shared_w2: [2Is, H] and [H, Is], the shared expert's (id E); other K strides than the
            routed weights' go to the reference.
        shared_out, shared_gate: [T, H] and [T], a shared expert run elsewhere, added as gate * out.
        tiles: tile sizes; the defaults suit the real shapes on an H200.
    Returns:
        [T, H] in x's dtype.
    """
    shared = (shared_w13, shared_w2, shared_out, shared_gate)
    has_weights = shared_w13 is not None
    strides = not has_weights or (
        shared_w13.stride(1) == w13.stride(2) and shared_w2.stride(1) == w2.stride(2)
    )
    fp8 = any(w is not None and w.element_size() == 1 for w in (w13, w2, shared_w13, shared_w2))
    shapes = x.dim() == ids.dim() == 2 and x.shape[0] > 0 and ids.shape[1] > 0
    if not (strides and shapes and not fp8 and x.dtype in _X_DTYPES):
        reason = dispatch.first_failed(
            (x.shape[0] > 0 and ids.shape[-1] > 0, dispatch.EMPTY),
            (x.dim() == ids.dim() == 2, "x is not [T, H] or ids not [T, S]"),
            (strides, "the shared expert's K stride differs from the routed experts'"),
            (not fp8, "FP8 weights (moe_experts_fp8 takes them)"),
            (x.dtype in _X_DTYPES, "x's dtype is not fp16, bf16 or fp32"),
        )
        dispatch.fallback("moe_experts", reason, expected=reason == dispatch.EMPTY, x=x, w13=w13, ids=ids)
        return reference.experts(x, w13, w2, weights, ids, *shared)
    pair = (shared_w13, shared_w2) if has_weights else None
    extra = (shared_out, shared_gate) if shared_out is not None else None
    return _run(x, w13, w2, weights, ids, pair, None, None, extra, tiles or GemvTiles())


def experts_fp8(
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
    *,
    tiles: GemvTiles | None = None,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """W8A8 block-FP8 experts for a few tokens: x and act quantised per token and bk channels, as
    `fp8.reference.fp8_block_linear` does for each projection.

    Args:
        x: [T, H] tokens, fp16, bf16 or fp32.
        w13: [E, 2I, H] e4m3 gate and up rows; w13_scale: [E, 2 * ceil(I/bn), ceil(H/bk)] fp32, the gate
            half's row blocks first (gate row r: scale row r // bn; up row r: ceil(I/bn) + r // bn).
        w2: [E, H, I] e4m3; w2_scale: [E, ceil(H/bn), ceil(I/bk)] fp32.
        weights, ids: [T, S] routing weights and expert ids, all in [0, E) (no shared slot: an FP8 shared
            expert runs outside, as FP8 linears).
        block: (bn, bk), weight rows and channels per scale.
        shared_out, shared_gate: [T, H] and [T], that shared expert's output and weight, added as gate * out.
        tiles: tile sizes; the defaults suit the real shapes on an H200.
        xq: x quantised per token and bk channels already (ignored if its group differs).
    Returns:
        [T, H] in x's dtype.
    """
    if x.shape[0] == 0 or ids.shape[1] == 0:  # nothing routed: only the shared expert's part
        out = torch.zeros_like(x)
        return out if shared_out is None else out + shared_gate.to(x.dtype)[:, None] * shared_out
    extra = (shared_out, shared_gate) if shared_out is not None else None
    xq = xq if xq is not None and xq.fits(x, block[1]) else None
    scales = (w13_scale, w2_scale)
    tiles = tiles or fp8_tiles(x.shape[0])
    return _run(x, w13, w2, weights, ids, None, scales, block, extra, tiles, xq)
