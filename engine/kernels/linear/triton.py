"""Triton dense linear for a few tokens (M <= MAX_ROWS): the weight read once, at memory bandwidth.

At decode a projection reads its whole weight [N, K] for one to eight token rows, so its time is the weight's
bytes over HBM bandwidth, plus launches. `_linear_kernel` has one program per (tile of BLOCK_N weight rows, K
split). Each loop step loads a [BLOCK_N, KG, BLOCK_C] tile, `k_bytes` of every row contiguous along K (the
weight is row-major [N, K]; 16-byte vector loads), converts it to fp32 once and, for each of the M rows of x
in turn (read again from L1/L2, they are small), multiplies and sums each K group in fp32 on the CUDA cores.
Nothing waits on a tensor-core tile of 16 token rows, and no activation quantiser runs before it. A K group
is 16 bytes (one thread's vector, so its sum needs no shuffles; the FP8 groups are the scale blocks), and the
[BLOCK_N, KG, M] group sums are only summed over KG, across lanes and warps, after the loop: the rows sit
where the tile has its channels, so adding a row's sums needs no layout change.

MAX_ROWS = 8: every weight element costs M fp32 FMAs (plus its share of the reductions). An H200 streams
~2.4 G bf16 elements per microsecond and its CUDA cores do ~33 G FMAs per microsecond. At M = 8 the loop's
sm_90 PTX is ~9 instructions per weight byte and thread, against the ~7 an SM issues while its share of HBM
bandwidth delivers a byte: still near bandwidth, and twice over by M = 16, where cuBLAS's tensor cores win;
`linear` hands larger batches to `torch.nn.functional.linear`. FP8 weights are half the bytes
for the same products, plus the inline quantisation: ~8 instructions per byte at M = 1, ~21 at M = 4, ~35 at
M = 8, so above a row or two the FP8 variant is bound by the CUDA cores, not HBM. FP8_MAX_ROWS is its own
knob for that reason (MAX_ROWS until an H200 run of `benchmarks/kernels_linear.py` says otherwise).

Enough programs: a tile is BLOCK_N = 8 rows, so N = 2048 (out_proj, o_proj) is 256 programs, N = 257 (the
router) 33 and N = 64 (in_proj_ba) 8, too few to keep HBM busy on 132 SMs. Where the N tiles are fewer than
PROGRAMS_PER_SM per SM, K is split into equal runs of whole steps; each split writes fp32 partial sums
[splits, M, N], and the last split of each N tile to finish adds them in split order, adds the bias and rounds
once to the output dtype. Which program is last is decided as in `deltanet_step`: after a CTA barrier (every
thread's partial sums stored), each program adds one to its N tile's counter (acq_rel); the one that finds
splits - 1 there has seen every other split's stores, resets the counter for the next launch and sums. One
launch per projection: a separate sum kernel (the earlier design, kept as `_sum_splits_kernel` for when no
counters can be had) cost a launch per FP8 projection, about 150 per decode step at batch 1. The sum order is
fixed, so results are equal run to run. Without a split the first kernel writes the output itself. Tiles and
splits come from the shapes alone, so a call can be captured in a CUDA graph.

FP8 (`fp8_linear`, W8A8 as `fp8.reference.fp8_block_linear`): e4m3 weights with one fp32 scale per (bn rows,
bk channels) block. A K group is one scale block (GROUP = bk, BLOCK_C its next power of two, masked); each
x row's group is quantised inline with `fp8.quant.quantize_rows` (as `quantize_fp8_per_token_group`), its
exact e4m3 products summed in fp32, then scaled by x_scale * w_scale[n // bn, kb]. Any bn and bk work.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8.quant import quantize_fp8_per_token_group, quantize_rows
from engine.kernels.fp8.reference import AMAX_EPS, FP8_MAX, Fp8Activation
from engine.kernels.pdl import pdl_launch, pdl_wait

MAX_ROWS = 8  # token rows up to which `linear` takes this kernel
FP8_MAX_ROWS = MAX_ROWS  # and up to which the W8A8 variant (`fp8_linear`) is built for
# Where the kernel beats the alternative, from an H200 run of `benchmarks/kernels_linear.py` (2026-11-30,
# L2 flushed before each call, us per call). bf16 against cuBLAS: it wins only for narrow outputs
# (in_proj_ba, N 64: 2.9 vs 5.0 at M 1, 3.8 vs 5.0 at 4; the router, N 257: 3.6 vs 3.5, 4.3 vs 7.8, 6.1
# vs 7.6 at 8) and loses from N 2048 up (out_proj 9.8 vs 10.0 at 1 but 16.0 vs 9.9 at 4; in_proj_qkvz 24.7
# vs 19.1 at 1). FP8 against the quantiser + GEMM: it wins at one row with few N tiles (out_proj 8.8 vs
# 15.9) and loses on wide outputs (in_proj_qkvz 15.9 vs 14.1) and from 4 rows (out_proj 17.7 vs 16.7).
PREFER_MAX_N = 512  # `linear` takes the kernel for N up to this at any M <= MAX_ROWS
# And for any N at one row, with WIDE_TILES: narrow tiles of long K steps (two 2026-11-30 sweeps, L2 flushed,
# us per call: in_proj_qkvz + in_proj_ba 17.7 vs cuBLAS 19.3, out_proj / o_proj 8.7 vs 9.9, qkv_proj 14.1
# vs 14.6, the router 3.4 vs 3.6 with the default tiles): 3,088 programs for in_proj_qkvz, each with 4 rows'
# 2 KB steps in flight, and few registers.
WIDE_MAX_ROWS = 1
# `fp8.triton.fp8_block_linear` takes it at up to FP8_PREFER_MAX_ROWS rows: x quantised inline up to
# FP8_PREFER_MAX_N outputs, and by the quantiser first above (FP8Q_TILES; H200 at 78dc92c, L2 flushed, us per
# call with the quantiser: in_proj_qkvz 12.4 vs 14.3 for the quantiser + GEMM and 16.4 inline, qkv_proj 10.6
# vs 12.6 and 13.9; out_proj 7.3 vs 9.0 inline at its best tiles, but 7.7 inline with a split K).
FP8_PREFER_MAX_ROWS, FP8_PREFER_MAX_N = 1, 4096
PROGRAMS_PER_SM = 4  # K is split until the grid has about this many programs per SM
_INTERPRETER_SMS = 4  # CPU tensors (Triton's interpreter): a few programs, so small tests still split K
_SUM_BLOCK = 256  # outputs per program of the split sum

_FP8_MAX = tl.constexpr(FP8_MAX)  # globals a kernel reads must be constexprs
_AMAX_EPS = tl.constexpr(AMAX_EPS)
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LinearTiles:
    """Weight rows per program, bytes of each row per loop step, K splits (0: from the shape, see
    PROGRAMS_PER_SM), warps per program, and the bytes of a K group (not FP8, whose groups are the scale
    blocks): 16, one vector load, keeps each group's sum inside one thread."""

    block_n: int = 8
    k_bytes: int = 1024
    split_k: int = 0
    num_warps: int = 4
    group_bytes: int = 16


# FP8: 32 rows of 256 channels per step (the same 8 KB), so each x row's inline quantisation, repeated by
# every program, serves 32 weight rows instead of 8 (sm_90 PTX of the loop at M = 4: 21 instructions per
# weight byte and thread against 28 with the bf16 tiles).
FP8_TILES = LinearTiles(block_n=32, k_bytes=256)
WIDE_TILES = LinearTiles(block_n=4, k_bytes=2048)  # bf16 at up to WIDE_MAX_ROWS rows
# FP8 with x quantised before the kernel: nothing is repeated per program; 16 rows of 512 channels per step
# (the best of the H200 sweep for in_proj_qkvz and qkv_proj at one row).
FP8Q_TILES = LinearTiles(block_n=16, k_bytes=512)


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]; e4m3 with USE_FP8
    scale_ptr,  # [ceil(N/bn), ceil(K/bk)] fp32, read with USE_FP8
    xs_ptr,  # [M, ceil(K/bk)] fp32 scales of x, read with X_QUANT (x is then e4m3)
    bias_ptr,  # [N], read with HAS_BIAS
    out_ptr,  # [M, N] in x's dtype
    part_ptr,  # [splits, M, N] fp32 partial sums, with USE_SPLIT
    counter_ptr,  # [cdiv(N, BLOCK_N)] int32 zeros, with USE_SPLIT and SUM_LAST (left zero)
    n_size,
    k_size,
    k_split,  # channels per K split, a multiple of KG * GROUP
    block_rows,  # bn: weight rows per scale row
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_xsm,
    stride_xsk,
    stride_b,
    stride_ps,
    stride_pm,
    stride_pn,
    stride_om,
    stride_on,
    ROWS: tl.constexpr,  # M
    BLOCK_M: tl.constexpr,  # next_power_of_2(M)
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,  # channels per K group (the FP8 scale block)
    BLOCK_C: tl.constexpr,  # next_power_of_2(GROUP)
    KG: tl.constexpr,  # K groups per step
    HAS_BIAS: tl.constexpr,
    USE_FP8: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    X_QUANT: tl.constexpr = False,  # with USE_FP8: x already quantised (e4m3, scales at xs_ptr)
    SUM_LAST: tl.constexpr = True,  # with USE_SPLIT: the last split of each N tile sums the partials
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, KG)
    offs_c = tl.arange(0, BLOCK_C)
    offs_k = offs_g[:, None] * GROUP + offs_c[None, :]  # [KG, BC] channels of one step
    n_mask = offs_n < n_size
    k_begin = pid_k * k_split
    k_end = tl.minimum(k_size, k_begin + k_split)
    x_ptrs = x_ptr + (k_begin + offs_k) * stride_xk  # [KG, BC] of row 0
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn  # [BN, KG, BC]
    w_ptrs += (k_begin + offs_k)[None, :, :] * stride_wk
    s_ptrs = scale_ptr + (offs_n // block_rows)[:, None] * stride_sn  # [BN, KG]
    s_ptrs += (k_begin // GROUP + offs_g)[None, :] * stride_sk
    xs_ptrs = xs_ptr + (k_begin // GROUP + offs_g) * stride_xsk  # [KG] of row 0
    # [BN, KG, BM]: the sums over KG (across warps) wait until after the loop, and the rows sit where the
    # weight tile has its channels, so a row's [BN, KG] sums join the accumulator without a layout change.
    acc = tl.zeros([BLOCK_N, KG, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, KG * GROUP):
        k_mask = (offs_c[None, :] < GROUP) & (offs_k < k_end - k0)  # [KG, BC]
        w = tl.load(w_ptrs, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0).to(tl.float32)
        w_scale = tl.zeros([BLOCK_N, KG], dtype=tl.float32)
        g_mask = offs_g * GROUP < k_end - k0  # [KG]
        if USE_FP8:
            w_scale = tl.load(s_ptrs, mask=n_mask[:, None] & g_mask[None, :], other=0.0)
        for m in tl.static_range(ROWS):
            xm = tl.load(x_ptrs + m * stride_xm, mask=k_mask, other=0.0).to(tl.float32)  # [KG, BC]
            if X_QUANT:  # xm holds the e4m3 values; their scales come from the quantiser
                x_scale = tl.load(xs_ptrs + m * stride_xsm, mask=g_mask, other=0.0)  # [KG]
                sums = tl.sum(w * xm[None, :, :], 2) * w_scale * x_scale[None, :]
            elif USE_FP8:  # one group per row, masked channels 0: as the reference quantiser
                q, x_scale = quantize_rows(xm, _FP8_MAX, _AMAX_EPS)
                sums = tl.sum(w * q[None, :, :], 2) * w_scale * x_scale[None, :]  # [BN, KG]
            else:
                sums = tl.sum(w * xm[None, :, :], 2)
            acc = tl.where(offs_m[None, None, :] == m, acc + sums[:, :, None], acc)
        x_ptrs += KG * GROUP * stride_xk
        w_ptrs += KG * GROUP * stride_wk
        s_ptrs += KG * stride_sk
        xs_ptrs += KG * stride_xsk
    acc = tl.sum(acc, 1)  # [BN, BM]
    mask = n_mask[:, None] & (offs_m < ROWS)[None, :]
    out_ptrs = out_ptr + offs_n[:, None] * stride_on + offs_m[None, :] * stride_om
    last = True
    if USE_SPLIT:
        part_ptrs = part_ptr + offs_n[:, None] * stride_pn + offs_m[None, :] * stride_pm
        tl.store(part_ptrs + pid_k * stride_ps, acc, mask=mask)
        last = False
        if SUM_LAST:
            tl.debug_barrier()  # every thread's partial sums stored before the increment releases them
            splits = tl.num_programs(1)
            last = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == splits - 1
            if last:
                tl.store(counter_ptr + pid_n, 0)
                tl.debug_barrier()  # the acquire before every thread's loads of the other splits' sums
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for split in range(splits):  # in split order: the same sum every run
                    acc += tl.load(part_ptrs + split * stride_ps, mask=mask, other=0.0)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n * stride_b, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [splits, M, N] fp32, contiguous
    bias_ptr,  # [N], read with HAS_BIAS
    out_ptr,  # [M, N]
    n_size,
    splits,
    stride_ps,
    stride_pm,
    stride_b,
    stride_om,
    stride_on,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    row, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_size
    part_ptrs = part_ptr + row * stride_pm + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):  # in split order: the same sum every run
        acc += tl.load(part_ptrs + s * stride_ps, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


_MAX_COUNTERS = 1 << 16  # N tiles a split launch may have and still sum in its last program


@functools.cache
def _tile_counters(device: torch.device) -> torch.Tensor:
    """[_MAX_COUNTERS] int32 zeros, one per N tile; every split launch leaves them zero (the last split of a
    tile resets its counter), so launches on the device's stream share them one after another."""
    return torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The shared tile counters of split-K launches that sum in their last split (this kernel's, the block-FP8
    GEMM's), or None where the launch must not use them: more tiles than counters, or a first use inside a
    CUDA graph capture (they are made by an eager call, such as a capture's warm-up, outside the graph's
    memory pool)."""
    if tiles > _MAX_COUNTERS:
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _tile_counters(device) if _tile_counters.cache_info().currsize else None
    return _tile_counters(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _k_blocks(k: int, elem_bytes: int, tiles: LinearTiles, group: int | None) -> dict:
    """GROUP (channels per K group: the FP8 scale block, else `tiles.group_bytes` of a power of two of
    channels), its padded width BLOCK_C and KG groups per step, from K and the bytes of each row per step."""
    elems = max(1, tiles.k_bytes // elem_bytes)
    if group is None:
        group = min(max(1, tiles.group_bytes // elem_bytes), triton.next_power_of_2(k), elems)
        group = 1 << (group.bit_length() - 1)
    per_step = max(1, elems // group)
    kg = min(1 << (per_step.bit_length() - 1), triton.next_power_of_2(triton.cdiv(k, group)))
    return dict(GROUP=group, BLOCK_C=triton.next_power_of_2(group), KG=kg)


def plan(m: int, n: int, k: int, elem_bytes: int, group: int | None, tiles: LinearTiles, sms: int) -> dict:
    """The launch for x [M, K] and weight [N, K]: the K blocks (`_k_blocks`), `k_split` channels per split
    and the number of `splits`."""
    blocks = _k_blocks(k, elem_bytes, tiles, group)
    step = blocks["KG"] * blocks["GROUP"]
    steps = triton.cdiv(k, step)
    wanted = tiles.split_k or triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(n, tiles.block_n))
    per_split = triton.cdiv(steps, max(1, min(wanted, steps)))
    return dict(blocks=blocks, k_split=per_split * step, splits=triton.cdiv(steps, per_split))


def run_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    tiles: LinearTiles,
    prequantize: bool = False,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x's dtype on the kernel at any M (`linear` and
    `fp8_linear` check `fits` first; benchmarks time it above MAX_ROWS); `scale` and `block` with e4m3
    weights, else None. `prequantize` (FP8 only): quantise x once with the quantiser kernel instead of in
    every program; `xq` (FP8 only): x quantised already, read as it is."""
    m, k = x.shape
    n = weight.shape[0]
    out_dtype = x.dtype
    use_fp8 = scale is not None
    bn, bk = block if use_fp8 else (1, None)
    given = use_fp8 and xq is not None and xq.group == bk and xq.q.numel() == x.numel()
    x_quant = use_fp8 and (prequantize or given)
    xs = x
    if given:
        x, xs = xq.q.reshape(m, k), xq.scale.reshape(m, -1)  # [M, K] e4m3, [M, ceil(K/bk)] fp32
    elif x_quant:
        x, xs = quantize_fp8_per_token_group(x, bk)  # [M, K] e4m3, [M, ceil(K/bk)] fp32
    p = plan(m, n, k, weight.element_size(), bk, tiles, _sm_count(x.device))
    splits = p["splits"]
    n_tiles = triton.cdiv(n, tiles.block_n)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out[None]
    counters = tile_counters(x.device, n_tiles) if splits > 1 else None
    sn, sk = scale.stride() if use_fp8 else (0, 0)
    xsm, xsk = xs.stride() if x_quant else (0, 0)
    stride_b = bias.stride(0) if bias is not None else 0
    _linear_kernel[(n_tiles, splits)](
        x, weight, scale if use_fp8 else x, xs, bias if bias is not None else out, out, part,
        counters if counters is not None else out, n, k, p["k_split"], bn,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), sn, sk, xsm, xsk, stride_b,
        part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
        ROWS=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, **p["blocks"],
        HAS_BIAS=bias is not None, USE_FP8=use_fp8, USE_SPLIT=splits > 1, X_QUANT=x_quant,
        SUM_LAST=counters is not None, num_warps=tiles.num_warps, **pdl_launch(),
    )  # fmt: skip
    if splits > 1 and counters is None:
        _sum_splits_kernel[(m, triton.cdiv(n, _SUM_BLOCK))](
            part, bias if bias is not None else part, out, n, splits, part.stride(0), part.stride(1),
            stride_b, out.stride(0), out.stride(1), BLOCK=_SUM_BLOCK, HAS_BIAS=bias is not None, num_warps=4,
            **pdl_launch(),
        )  # fmt: skip
    return out


def fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether x [..., K] and weight [N, K] take the kernel: 1..max_rows rows, K and N not empty, a float x
    and a weight contiguous along K."""
    m = math.prod(x.shape[:-1])
    return (
        0 < m <= max_rows
        and x.dtype in _X_DTYPES
        and weight.dim() == 2
        and weight.shape[1] == x.shape[-1] > 0
        and weight.shape[0] > 0
        and weight.stride(1) == 1
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: LinearTiles | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: up to MAX_ROWS rows and PREFER_MAX_N outputs, or one row (WIDE_MAX_ROWS)
    and any outputs, on `_linear_kernel`; the rest (or other dtypes) on cuBLAS.

    Args:
        x: [..., K] fp16, bf16 or fp32; weight: [N, K] and bias: optional [N], of x's dtype.
        tiles: tile sizes; the defaults suit the real shapes on an H200.
    Returns:
        [..., N] in x's dtype.
    """
    same = weight.dtype == x.dtype and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1))
    wide = weight.shape[0] > PREFER_MAX_N
    if not (same and fits(x, weight, WIDE_MAX_ROWS if wide else MAX_ROWS)):
        if same and fits(x, weight, math.inf):  # only more rows than the kernel is for: cuBLAS by design
            dispatch.choose("linear", "torch")
        else:
            reason = dispatch.first_failed(
                (same, "weight or bias dtype differs from x's, or bias is not [N]"),
                (math.prod(x.shape[:-1]) > 0, dispatch.EMPTY),
                (x.dtype in _X_DTYPES, "x's dtype is not fp16, bf16 or fp32"),
                (fits(x, weight, math.inf), "weight is not [N, K] contiguous along K, or N or K is 0"),
            )
            dispatch.fallback("linear", reason, expected=reason == dispatch.EMPTY, x=x, weight=weight)
        return F.linear(x, weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    one_row = fits(x, weight, WIDE_MAX_ROWS)
    out = run_kernel(
        x.reshape(-1, k), weight, None, bias, None, tiles or (WIDE_TILES if one_row else LinearTiles())
    )
    return out.view(*x.shape[:-1], n)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    *,
    tiles: LinearTiles | None = None,
    prequantize: bool = False,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """The W8A8 block-FP8 linear (`fp8.reference.fp8_block_linear`) for x that `fits` (up to FP8_MAX_ROWS
    rows), x quantised per token and bk channels inside the kernel, or once before it with `prequantize`
    (the quantiser kernel, then `FP8Q_TILES` by default: the same products and sums), or read from `xq`
    where the op that produced x quantised it (`FP8Q_TILES` too).

    Args:
        x: [..., K] fp16, bf16 or fp32.
        weight: [N, K] float8_e4m3fn, contiguous along K.
        weight_scale_inv: [ceil(N/bn), ceil(K/bk)] fp32, one multiplier per weight block (edge blocks
            partial).
        bias: optional [N], any float dtype.
        block: (bn, bk), weight rows and channels per scale; any sizes.
        tiles: tile sizes; the defaults suit the real shapes on an H200.
        prequantize: quantise x in its own launch first.
        xq: x quantised per token and bk channels (`Fp8Activation`); ignored if its group is not bk.
    Returns:
        [..., N] in x's dtype.
    """
    if not fits(x, weight, FP8_MAX_ROWS):
        raise ValueError(f"fp8_linear takes 1..{FP8_MAX_ROWS} rows of fp16/bf16/fp32 x; check `fits` first")
    k, n = x.shape[-1], weight.shape[0]
    xq = xq if xq is not None and xq.group == block[1] else None
    tiles = tiles or (FP8Q_TILES if prequantize or xq is not None else FP8_TILES)
    out = run_kernel(x.reshape(-1, k), weight, weight_scale_inv, bias, block, tiles, prequantize, xq)
    return out.view(*x.shape[:-1], n)
