"""Paged causal GQA attention in Triton: short sequences (decode, MTP verify) and long ones (prefill chunks).

Short path: one program per (short sequence, kv head, split) stacks every query token of the sequence times
every query head of the kv head into one [BLOCK_M, D] tile (row r = token r // G, head r % G), so each key
block is read once for all of them. It walks the sequence's keys BLOCK_N at a time through the block table,
with an fp32 online softmax. With NUM_SPLITS > 1 (flash-decoding: long contexts, few sequences) each program
covers one slice of the keys and writes a partial output and its log-sum-exp; a second kernel merges them.

Long path (varlen causal prefill), by default `prefill.py`'s packed GQA kernel: one program per kv head and
tile of tokens, all its query heads in the tile (ENCLAVE_PREFILL_KERNEL=rows: this module's kernel, one
program per (query head, tile of BLOCK_M new tokens of one long sequence), 2x slower on the H200; it still
runs the FP8 products). A tile's queries sit at positions ctx + j and see keys 0 .. ctx + j. Keys before the
tile's first position are visible to every row and are read without the causal mask; the diagonal blocks
with it.

FP8 cache (`USE_KV_SCALE`): keys and values are e4m3 with an fp32 scale per (position, kv head) beside the
pool (`fp8_kv`). A key tile is converted to q's dtype as stored (exact: e4m3 fits in bf16/fp16) and its
scales multiply the score columns after the QK product; a value tile is dequantised (times its scales) before
the PV product. The new rows are quantised by `fp8_kv.write` before either path reads them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from engine.env import engine_env
from engine.kernels import dispatch
from engine.kernels.attention import fp8_kv, prefill, reference
from engine.kernels.attention.e4m3 import E4M3_MAX as _E4M3_MAX
from engine.kernels.attention.e4m3 import SCALE_TINY as _SCALE_TINY
from engine.kernels.attention.e4m3 import pv_e4m3 as _pv_e4m3
from engine.kernels.attention.e4m3 import quantize_rows as _quantize_rows
from engine.kernels.attention.e4m3 import round_to_e4m3 as _round_to_e4m3
from engine.kernels.layout import SeqLayout
from engine.kernels.pdl import pdl_launch, pdl_wait

# Split the keys when fewer programs than this many per multiprocessor would run otherwise...
_PROGRAMS_PER_SM = 4
# ...and only for contexts this long, with at least this many keys per split. H200, batch 1, 520 keys
# unsplit: 27.5 us per layer (two programs walking nine 64-key steps each, latency-bound).
_SPLIT_MIN_KV = 512
_MIN_KEYS_PER_SPLIT = 128
_MAX_SPLITS = 128
_LOG2E = 1.4426950408889634
FP8_NEEDS_SM89 = "an FP8 KV cache needs sm_89 or later (Triton's e4m3 conversion)"


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] fp32, contiguous (USE_KV_SCALE only)
    v_scale_ptr,
    out_ptr,  # [T, Hq, D], or [B, Hkv, NUM_SPLITS, BLOCK_M, D] fp32 partial outputs when USE_SPLIT
    lse_ptr,  # [B, Hkv, NUM_SPLITS, BLOCK_M] fp32 log2-sum-exp of each partial (USE_SPLIT only)
    block_tables_ptr,  # [B, max_blocks] int32, padded with 0
    seq_info_ptr,  # [B, 3] int32: first token, new tokens, context length
    scale_log2,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kr,
    stride_kh,
    stride_vb,
    stride_vr,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    KV_BLOCK: tl.constexpr,  # positions per cache block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_KV_SCALE: tl.constexpr = False,  # an FP8 cache with per-(position, kv head) scales
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(seq_info_ptr + b * 3)
    n_new = tl.load(seq_info_ptr + b * 3 + 1)
    ctx = tl.load(seq_info_ptr + b * 3 + 2)
    kv_len = ctx + n_new

    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP  # query token within the sequence; it sits at position ctx + tok
    head = h * GROUP + rows % GROUP
    row_ok = tok < n_new
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = ctx + tok

    if USE_SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = split * per_split
        kv_end = tl.minimum(kv_len, kv_start + per_split)
    else:
        kv_start = 0
        kv_end = kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + cols  # [BLOCK_N] key positions
        kv_ok = pos < kv_end
        block = tl.load(block_tables_ptr + b * stride_bt + pos // KV_BLOCK, mask=kv_ok, other=0).to(tl.int64)
        offset = pos % KV_BLOCK
        # Rows past the sequence's end may hold NaN: masked loads give 0 there (0 * NaN would be NaN).
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k_offs = block[:, None] * stride_kb + offset[:, None] * stride_kr + h * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v_offs = block[:, None] * stride_vb + offset[:, None] * stride_vr + h * stride_vh + d[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if USE_KV_SCALE:
            row = (block * KV_BLOCK + offset) * tl.num_programs(1) + h  # [BLOCK_N] scale index
            s = s * tl.load(k_scale_ptr + row, mask=kv_ok, other=0.0)[None, :]
            v = (v.to(tl.float32) * tl.load(v_scale_ptr + row, mask=kv_ok, other=0.0)[:, None]).to(q.dtype)
        seen = (pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet (possible inside a split) keeps m = -inf: subtract 0 instead.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if USE_SPLIT:
        part = (b * tl.num_programs(1) + h) * NUM_SPLITS + split  # [B, Hkv, NUM_SPLITS] flat
        o_offs = (part * BLOCK_M + rows).to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + o_offs, o, mask=d_ok[None, :])
        # An empty slice (or a row that saw no key in it) gets -inf and weight 0 in the merge.
        tl.store(lse_ptr + part * BLOCK_M + rows, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)))
    else:
        o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_fp8_row(x_ptr, cache_ptr, scale_ptr, at, d, HEAD_DIM: tl.constexpr):
    """Quantise one row [D] at x_ptr into the e4m3 cache's row `at` ([rows * Hkv, D] flat), its scale at
    scale_ptr + at, as `fp8_kv.quantize` does (div_rn: its IEEE division, not the fast approximation)."""
    d_ok = d < HEAD_DIM
    x = tl.load(x_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), _E4M3_MAX), _SCALE_TINY)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -_E4M3_MAX, _E4M3_MAX))
    tl.store(cache_ptr + at * HEAD_DIM + d, q.to(cache_ptr.dtype.element_ty), mask=d_ok)
    tl.store(scale_ptr + at, scale)


@triton.jit
def _write_fp8_kv_kernel(
    k_ptr,  # [T, Hkv, D] new keys, last dimension contiguous
    v_ptr,
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] e4m3, contiguous
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks * block_size, Hkv] fp32
    v_scale_ptr,
    rows_ptr,  # [T] int64 flat cache row of each new token
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    # One program per (new token, kv head): `fp8_kv.write` in one launch.
    t = tl.program_id(0)
    h = tl.program_id(1)
    at = tl.load(rows_ptr + t).to(tl.int64) * NUM_KV_HEADS + h  # flat (row, kv head) index
    d = tl.arange(0, BLOCK_D)
    t64 = t.to(tl.int64)
    _store_fp8_row(k_ptr + t64 * stride_kt + h * stride_kh, k_cache_ptr, k_scale_ptr, at, d, HEAD_DIM)
    _store_fp8_row(v_ptr + t64 * stride_vt + h * stride_vh, v_cache_ptr, v_scale_ptr, at, d, HEAD_DIM)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [B, Hkv, NUM_SPLITS, BLOCK_M, D] fp32 partial outputs
    lse_ptr,  # [B, Hkv, NUM_SPLITS, BLOCK_M] fp32
    out_ptr,  # [T, Hq, D]
    seq_info_ptr,  # [B, 3] int32
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    # One program per (sequence, kv head, tile row); rows past the sequence's new tokens store nothing.
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    q_start = tl.load(seq_info_ptr + b * 3)
    n_new = tl.load(seq_info_ptr + b * 3 + 1)
    tok = row // GROUP
    head = h * GROUP + row % GROUP

    base = (b * tl.num_programs(1) + h) * NUM_SPLITS
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + (base + splits) * BLOCK_M + row, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)  # finite: the first slice holds key 0, which every query sees
    weight = tl.exp2(lse - lse_max)  # [BLOCK_S], 0 for empty slices
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_ptr + (base + s) * BLOCK_M + row) - lse_max)
        acc += w * tl.load(part_ptr + ((base + s) * BLOCK_M + row).to(tl.int64) * HEAD_DIM + d, mask=d_ok)
    o = acc / tl.sum(weight, 0)
    o_offs = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh + d
    width = tl.where(tok < n_new, HEAD_DIM, 0)  # a vector mask: padding rows store nothing
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=d < width)


@triton.jit
def _prefill_block(
    q,  # [BLOCK_M, BLOCK_D] queries of the tile (FP8_DOT: e4m3, times q_scale)
    q_scale,  # [BLOCK_M] fp32 (FP8_DOT only)
    acc,  # [BLOCK_M, BLOCK_D] fp32 unnormalised output
    m_i,  # [BLOCK_M] fp32 running max (base 2)
    l_i,  # [BLOCK_M] fp32 running sum
    q_pos,  # [BLOCK_M] position of each query row
    start,  # first key position of this block
    kv_len,
    table_ptr,  # this sequence's row of the block tables
    k_ptr,  # k_cache_ptr + kv head * stride_kh
    v_ptr,
    ks_ptr,  # k_scale_ptr + kv head (USE_KV_SCALE only)
    vs_ptr,
    stride_kb,
    stride_kr,
    stride_vb,
    stride_vr,
    scale_log2,
    KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DIAGONAL: tl.constexpr,  # some key of the block lies past some query row: apply the causal mask
    DOT_PRECISION: tl.constexpr,
    USE_KV_SCALE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    FP8_DOT: tl.constexpr,  # e4m3 products (needs USE_KV_SCALE)
    EXACT_E4M3: tl.constexpr,
):
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    kv_ok = pos < kv_len
    d = tl.arange(0, BLOCK_D)
    block = tl.load(table_ptr + pos // KV_BLOCK, mask=kv_ok, other=0).to(tl.int64)
    offset = pos % KV_BLOCK
    # Rows past the sequence's end may hold NaN: masked loads give 0 there (0 * NaN would be NaN).
    kv_mask = kv_ok[:, None] & (d < HEAD_DIM)[None, :]
    k_offs = block[:, None] * stride_kb + offset[:, None] * stride_kr + d[None, :]
    v_offs = block[:, None] * stride_vb + offset[:, None] * stride_vr + d[None, :]
    if FP8_DOT:
        k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D] e4m3 as stored
        v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * (q_scale * scale_log2)[:, None]  # [BLOCK_M, BLOCK_N]
    else:
        k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if USE_KV_SCALE:
        row = (block * KV_BLOCK + offset) * NUM_KV_HEADS  # [BLOCK_N] scale index (the head is in ks_ptr)
        s = s * tl.load(ks_ptr + row, mask=kv_ok, other=0.0)[None, :]
        vs = tl.load(vs_ptr + row, mask=kv_ok, other=0.0)  # [BLOCK_N]
        if not FP8_DOT:
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
    if IS_DIAGONAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, float("-inf"))
    # Every row sees the first key of the first block it reads, so m stays finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_DOT:
        acc = _pv_e4m3(acc, alpha, p, vs, v, EXACT_E4M3)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] fp32, contiguous (USE_KV_SCALE only)
    v_scale_ptr,
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks] int32 of the long sequences, padded with 0
    seq_info_ptr,  # [B, 3] int32: first token, new tokens, context length
    tiles_ptr,  # [num_tiles, 2] int32: long sequence, first new token of the tile
    scale_log2,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kr,
    stride_kh,
    stride_vb,
    stride_vr,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    KV_BLOCK: tl.constexpr,  # positions per cache block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_KV_SCALE: tl.constexpr = False,  # an FP8 cache with per-(position, kv head) scales
    NUM_KV_HEADS: tl.constexpr = 1,
    FP8_DOT: tl.constexpr = False,  # e4m3 QK and PV products: q and P quantised per row
    EXACT_E4M3: tl.constexpr = False,  # round to e4m3 in fp32 before casts (the interpreter)
):
    # Heads vary fastest over the grid, so the query heads of one kv head read its key blocks close in time.
    head = tl.program_id(0)
    tile = tl.program_id(1)
    h = head // GROUP
    b = tl.load(tiles_ptr + tile * 2)
    j0 = tl.load(tiles_ptr + tile * 2 + 1)
    q_start = tl.load(seq_info_ptr + b * 3)
    n_new = tl.load(seq_info_ptr + b * 3 + 1)
    ctx = tl.load(seq_info_ptr + b * 3 + 2)
    kv_len = ctx + n_new

    tok = j0 + tl.arange(0, BLOCK_M)  # new tokens of the tile; token j sits at position ctx + j
    row_ok = tok < n_new
    q_pos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]; padding rows 0
    if FP8_DOT:
        q, q_scale = _quantize_rows(q, EXACT_E4M3)
    else:
        q_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)

    table_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_ptr = k_cache_ptr + h * stride_kh
    v_ptr = v_cache_ptr + h * stride_vh
    ks_ptr = k_scale_ptr + h
    vs_ptr = v_scale_ptr + h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys 0 .. ctx + j0 are visible to every row of the tile: whole blocks of them go without the mask.
    full_end = (ctx + j0 + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _prefill_block(
            q, q_scale, acc, m_i, l_i, q_pos, start, kv_len, table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
            stride_kb, stride_kr, stride_vb, stride_vr, scale_log2,
            KV_BLOCK, HEAD_DIM, BLOCK_D, BLOCK_N, False, DOT_PRECISION, USE_KV_SCALE, NUM_KV_HEADS,
            FP8_DOT, EXACT_E4M3,
        )  # fmt: skip
    # The rest, up to the tile's last position (padding rows past the sequence's end mask keys >= kv_len).
    diag_end = tl.minimum(kv_len, ctx + j0 + BLOCK_M)
    for start in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _prefill_block(
            q, q_scale, acc, m_i, l_i, q_pos, start, kv_len, table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
            stride_kb, stride_kr, stride_vb, stride_vr, scale_log2,
            KV_BLOCK, HEAD_DIM, BLOCK_D, BLOCK_N, True, DOT_PRECISION, USE_KV_SCALE, NUM_KV_HEADS,
            FP8_DOT, EXACT_E4M3,
        )  # fmt: skip

    o = acc / l_i[:, None]
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for `reference.attention`: write the new keys/values, then attend (see `paged_attention`)."""
    return paged_attention(q, k, v, k_cache, v_cache, layout, scale, k_scale=k_scale, v_scale=v_scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_products: bool | None = None,
    prefill_kernel: str | None = None,
) -> torch.Tensor:
    """`attention` with the tiling exposed: `num_splits` key slices per (short sequence, kv head) (None:
    chosen from the batch and context sizes; 1: no split), `block_n` keys per step (None: 64 on the short
    path, chosen by dtype on the long one), `block_m` new tokens per prefill tile of the rows kernel, rows
    (tokens x query heads of a kv head) of the packed one (None: chosen by dtype).

    Args:
        q: [T, Hq, D] queries; k, v: [T, Hkv, D] new keys/values (None: already in the cache).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] contiguous paged caches, written in place.
        k_scale, v_scale: [num_blocks, block_size, Hkv] contiguous fp32 scales of an FP8 cache, else None.
        fp8_products: with an FP8 cache, run the prefill kernel's QK and PV products in e4m3 (queries and
            softmax weights quantised per row); None: as ENCLAVE_FP8_ATTENTION says (default off).
        prefill_kernel: `rows` or `packed` (`prefill`) for the long sequences; None: as
            ENCLAVE_PREFILL_KERNEL says (default packed). Either runs the e4m3 products.
        layout: the batch's sequences and block tables.
        scale: softmax scale.
    Returns:
        [T, Hq, D] in q's dtype.
    """
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    scales = (k_scale, v_scale) if k_scale is not None and v_scale is not None else None
    if scales is not None and q.is_cuda and _capability(q.device.index or 0) < (8, 9):
        # Triton converts e4m3 (fp8e4nv) only on sm_89 and later.
        dispatch.fallback("attention", FP8_NEEDS_SM89, k_cache=k_cache)
        return reference.attention(q, k, v, k_cache, v_cache, layout, scale, k_scale, v_scale)
    if k is not None:  # else the caller stored them (`qk_norm_rotary_store`)
        written = layout.slot_mapping(q.device)  # [T] flat cache row of each new token
        if scales is None:
            fp8_kv.write(k, v, k_cache, v_cache, written, None, None)
        elif k.shape[0]:
            write_fp8(k, v, k_cache, v_cache, k_scale, v_scale, written)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if layout.short_seqs:
        _short(q, k_cache, v_cache, scales, layout, scale, out, num_splits, block_n)
    if layout.long_seqs:
        if dispatch.prefill_kernels_enabled("attention", q=q):
            if fp8_products is None:
                fp8_products = engine_env().fp8_attention
            fp8_dot = scales is not None and fp8_products
            kernel = prefill_kernel or engine_env().prefill_kernel
            if kernel not in ("rows", "packed"):
                raise ValueError(f"prefill_kernel must be 'rows' or 'packed', got {kernel!r}")
            if kernel == "packed":
                args = (q, k_cache, v_cache, scales, layout, scale, out, block_m, block_n)
                _long_packed(*args, fp8_dot=fp8_dot)
            else:
                _long(q, k_cache, v_cache, scales, layout, scale, out, block_m, block_n, fp8_dot)
        else:
            rows = [None if t is None else t.view(-1, hkv) for t in (k_scale, v_scale)]
            reference.long_sequences(
                q, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), layout, scale, out, tuple(rows)
            )
    return out


def write_fp8(k, v, k_cache, v_cache, k_scale, v_scale, written: torch.Tensor) -> None:
    """`fp8_kv.write` in one launch: new keys/values [T, Hkv, D] quantised into the e4m3 caches at flat rows
    `written` [T], their scales beside them."""
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    _write_fp8_kv_kernel[(k.shape[0], hkv)](
        k, v, k_cache, v_cache, k_scale, v_scale, written, *k.stride()[:2], *v.stride()[:2],
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 2,
        **pdl_launch(),
    )  # fmt: skip


def _short(q, k_cache, v_cache, scales, layout: SeqLayout, scale, out, num_splits, block_n) -> None:
    """Every short sequence in one launch (plus the merge launch when the keys are split)."""
    seqs = layout.short_seqs
    num_seqs, hq, d = len(seqs), q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    n_max = max(layout.query_lens[i] for i in seqs)
    kv_max = layout.kv_capacity or max(layout.context_lens[i] + layout.query_lens[i] for i in seqs)
    tables, info = _seq_index(layout, "short", q.device)
    block_d = triton.next_power_of_2(d)
    block_m = max(16, triton.next_power_of_2(n_max * group))  # tl.dot needs at least 16 rows
    block_n = block_n or 64
    if num_splits is None:
        num_splits = _num_splits(num_seqs * hkv, kv_max, q.device)
    # H200, D 256, CUDA-graphed: 64 keys, 4 warps, 3 stages gave 2.2-3.3 TB/s of KV read on decode (64 x 4k,
    # 256 x 1k, 1 x 128k) and verify (16 x 8k) batches; a 64-row tile gets more warps and fewer stages
    # (shared memory).
    wide = block_m * block_d >= 64 * 256
    args = dict(
        GROUP=group,
        KV_BLOCK=k_cache.shape[1],
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_KV_SCALE=scales is not None,
        num_warps=8 if wide else 4,
        num_stages=2 if wide else 3,
    )
    k_scale, v_scale = scales or (k_cache, v_cache)  # unread without scales
    if num_splits == 1:
        target, lse, target_strides = out, out, out.stride()[:2]
    else:
        target = torch.empty(num_seqs, hkv, num_splits, block_m, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, hkv, num_splits, block_m, dtype=torch.float32, device=q.device)
        target_strides = (0, 0)  # the partials are contiguous
    strides = (
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *target_strides,
        tables.stride(0),
    )
    grid = (num_seqs, hkv, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, target, lse, tables, info, scale * _LOG2E, *strides,
        **args, **pdl_launch(),
    )  # fmt: skip
    if num_splits == 1:
        return
    _merge_splits_kernel[(num_seqs, hkv, n_max * group)](
        target,
        lse,
        out,
        info,
        *out.stride()[:2],
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
        **pdl_launch(),
    )


def _long(q, k_cache, v_cache, scales, layout: SeqLayout, scale, out, block_m, block_n, fp8_dot) -> None:
    """Every long sequence (prefill chunk) in one launch over (query head, tile of new tokens)."""
    hq, d = q.shape[1], q.shape[2]
    block_d = triton.next_power_of_2(d)
    # sm_90 at D 256 (ptxas): 16-bit 64 x 64 tiles, 8 warps, 2 stages take 160 KB of shared memory
    # (Q + 2 x (K + V)) and 236 registers without spills; fp32 rows (1 KB, dots on the FMA units) spill
    # registers above 16 x 16.
    wide = q.element_size() * block_d >= 1024
    block_m = block_m or (16 if wide else 64)
    block_n = block_n or (16 if wide else 64)
    tables, info = _seq_index(layout, "long", q.device)
    tiles = _prefill_tiles(layout, block_m, q.device)
    strides = (
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *out.stride()[:2],
        tables.stride(0),
    )
    k_scale, v_scale = scales or (k_cache, v_cache)  # unread without scales
    _prefill_attention_kernel[(hq, tiles.shape[0])](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        out,
        tables,
        info,
        tiles,
        scale * _LOG2E,
        *strides,
        GROUP=hq // k_cache.shape[2],
        KV_BLOCK=k_cache.shape[1],
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_KV_SCALE=scales is not None,
        NUM_KV_HEADS=k_cache.shape[2],
        FP8_DOT=fp8_dot,
        EXACT_E4M3=fp8_dot and engine_env().triton_interpret,
        num_warps=8 if block_m * block_d >= 64 * 256 else 4,
        num_stages=2,
    )


# Positions of context (summed over a step's prefill chunks) from which the packed kernel reads an FP8 cache
# through a copy of the step's blocks made once per step: dequantised (`_dequantised`) for products in q's
# dtype, rather than dequantising tiles inside its loop; for e4m3 products, gathered with each block's values
# transposed (`_fp8_gathered`), rather than transposing value tiles inside its loop. On an H100
# (docs/PERFORMANCE.md, sixth session) the in-loop path ran 8,192 queries after 524,288 FP8 keys at 262
# TFLOP/s against 446-470 for the same kernel over a bf16 cache (and at 116 with e4m3 products), while a copy
# costs a read of the e4m3 rows and a write of the copy, ~1 ms per 1M positions: negligible there, and
# launches not worth adding to the short-context chunks of serving steps.
COPY_ONCE_CONTEXT = 16384
# Blocks per slice of a copy: the dequantised copy's fp32 temporary is 2048 x 64 positions x 2 kv heads x 256
# x 4 bytes = 256 MiB; the transposed one's gathered e4m3 rows a quarter of that.
_COPY_SLICE = 2048


def _step_blocks(layout: SeqLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache blocks the long sequences read, sorted ([n] int64), and their block tables renumbered into
    a pool of those blocks in that order ([B, max_blocks] int32, padded with 0); built once per layout."""

    def blocks(layout: SeqLayout) -> list[int]:
        return sorted({b for i in layout.long_seqs for b in layout.block_tables[i]})

    def used(layout: SeqLayout) -> torch.Tensor:
        return torch.tensor(blocks(layout), dtype=torch.long)

    def renumbered(layout: SeqLayout) -> torch.Tensor:
        new = {b: j for j, b in enumerate(blocks(layout))}
        rows = [[new[b] for b in layout.block_tables[i]] for i in layout.long_seqs]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)

    return (
        layout.cached("attention_triton_step_blocks", device, used),
        layout.cached("attention_triton_step_tables", device, renumbered),
    )


def _dequantised(
    k_cache, v_cache, scales, layout: SeqLayout, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The long sequences' blocks of an FP8 cache as a bf16 (`dtype`) block pool of their own, dequantised
    as the reference reads them (`fp8_kv.dequantize`: e4m3 times its fp32 scale, rounded to `dtype`), and
    their block tables renumbered into it. In slices of blocks, to bound the fp32 temporary."""
    used, tables = _step_blocks(layout, k_cache.device)
    k_scale, v_scale = scales
    pools = []
    for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
        pool = torch.empty((used.shape[0], *cache.shape[1:]), dtype=dtype, device=cache.device)
        for lo in range(0, used.shape[0], _COPY_SLICE):
            part = used[lo : lo + _COPY_SLICE]
            pool[lo : lo + part.shape[0]] = fp8_kv.dequantize(cache[part], scale[part], dtype)
        pools.append(pool)
    return pools[0], pools[1], tables


def _fp8_gathered(
    k_cache, v_cache, scales, layout: SeqLayout
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The long sequences' blocks of an FP8 cache as a pool of their own, for e4m3 products: keys [n,
    block_size, Hkv, D] as stored, values transposed to [n, Hkv, D, block_size] (the bytes unchanged), their
    scales [n, block_size, Hkv], and the block tables renumbered into the pool."""
    used, tables = _step_blocks(layout, k_cache.device)
    k_scale, v_scale = scales
    n, size, hkv, d = used.shape[0], *v_cache.shape[1:]
    values = torch.empty((n, hkv, d, size), dtype=v_cache.dtype, device=v_cache.device)
    for lo in range(0, n, _COPY_SLICE):  # in slices, to bound the gathered temporary
        part = used[lo : lo + _COPY_SLICE]
        values[lo : lo + part.shape[0]] = v_cache[part].permute(0, 2, 3, 1)
    return k_cache[used], values, (k_scale[used], v_scale[used]), tables


def _long_packed(
    q, k_cache, v_cache, scales, layout: SeqLayout, scale, out, block_m, block_n, config=None, fp8_dot=False
) -> None:
    """Every long sequence in one launch of the packed kernel over (kv head, tile of new tokens); `config`
    (rows, keys, warps, stages) overrides the tiling (benchmarks/attention_prefill.py --sweep); `fp8_dot`:
    e4m3 products over an FP8 cache. Over an FP8 cache and a long context (COPY_ONCE_CONTEXT), the
    kernel reads a copy of the blocks the step reads: dequantised for products in q's dtype, with the values
    transposed for e4m3 products."""
    group = q.shape[1] // k_cache.shape[2]
    rows, keys, warps, stages = config or prefill.tiling(q.dtype, group, block_m, block_n)
    tables, info = _seq_index(layout, "long", q.device)
    context = sum(layout.context_lens[i] for i in layout.long_seqs)
    transposed = False
    if scales is not None and context >= COPY_ONCE_CONTEXT:
        if fp8_dot:
            k_cache, v_cache, scales, tables = _fp8_gathered(k_cache, v_cache, scales, layout)
            transposed = True
        else:
            k_cache, v_cache, tables = _dequantised(k_cache, v_cache, scales, layout, q.dtype)
            scales = None
    tiles = _prefill_tiles(layout, rows // group, q.device)
    dispatch.choose("attention", "triton-prefill-packed")
    tiling = (rows, keys, warps, stages)
    exact = engine_env().triton_interpret
    prefill.prefill_packed(
        q, k_cache, v_cache, scales, tables, info, tiles, scale, out, *tiling, fp8_dot, exact, transposed
    )


def _seq_index(layout: SeqLayout, which: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_blocks] int32 block tables (padded with 0) and [B, 3] int32 (first token, new tokens,
    context) of the layout's `which` ("short" or "long") sequences, built once per layout and device."""
    if layout.block_tables is None:
        raise ValueError("this layout has no block tables, so it cannot address a paged KV cache")

    def pick(layout: SeqLayout) -> tuple[int, ...]:
        return layout.short_seqs if which == "short" else layout.long_seqs

    def tables(layout: SeqLayout) -> torch.Tensor:
        rows = [layout.block_tables[i] for i in pick(layout)]
        width = max(len(r) for r in rows)
        if any(len(r) != width for r in rows):
            rows = [tuple(r) + (0,) * (width - len(r)) for r in rows]
        # numpy reads nested tuples about 3x faster than torch.tensor (64 x 64 blocks: 75 against 247 us),
        # and a graph replay rebuilds this every step.
        return torch.from_numpy(np.array(rows, dtype=np.int32).reshape(len(rows), width))

    def info(layout: SeqLayout) -> torch.Tensor:
        seqs = pick(layout)
        return torch.tensor(
            [[layout.cu_seqlens[i], layout.query_lens[i], layout.context_lens[i]] for i in seqs],
            dtype=torch.int32,
        )

    return (
        layout.cached(("attention_triton_tables", which), device, tables),
        layout.cached(("attention_triton_info", which), device, info),
    )


def _prefill_tiles(layout: SeqLayout, block_m: int, device) -> torch.Tensor:
    """[num_tiles, 2] int32 (index among the long sequences, first new token) of every prefill tile, those
    with the most keys first so the last wave of programs is the shortest."""

    def build(layout: SeqLayout) -> torch.Tensor:
        tiles = [
            (b, j0) for b, i in enumerate(layout.long_seqs) for j0 in range(0, layout.query_lens[i], block_m)
        ]
        tiles.sort(key=lambda t: -(layout.context_lens[layout.long_seqs[t[0]]] + t[1]))
        return torch.tensor(tiles, dtype=torch.int32).view(-1, 2)

    return layout.cached(("attention_triton_tiles", block_m), device, build)


def _num_splits(num_programs: int, kv_max: int, device: torch.device) -> int:
    """Key slices per program: enough to fill the GPU when few (sequence, kv head) pairs have long keys."""
    if kv_max < _SPLIT_MIN_KV:
        return 1
    target = _PROGRAMS_PER_SM * (_multiprocessors(device.index or 0) if device.type == "cuda" else 132)
    if num_programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, num_programs), kv_max // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
