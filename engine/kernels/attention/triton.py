"""Paged causal GQA attention in Triton for the short sequences of a step (decode, MTP verify).

One program per (short sequence, kv head, split) stacks every query token of the sequence times every query
head of the kv head into one [BLOCK_M, D] tile (row r = token r // G, head r % G), so each key block is read
once for all of them. It walks the sequence's keys BLOCK_N at a time through the block table, with an fp32
online softmax. With NUM_SPLITS > 1 (flash-decoding: long contexts, few sequences) each program covers one
slice of the keys and writes a partial output and its log-sum-exp; a second kernel merges the slices.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.attention import reference
from engine.kernels.layout import SeqLayout

# Split the keys when fewer programs than this many per multiprocessor would run otherwise...
_PROGRAMS_PER_SM = 4
# ...and only for contexts this long, with at least this many keys per split.
_SPLIT_MIN_KV = 2048
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 128
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
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
):
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
):
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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
) -> torch.Tensor:
    """Drop-in for `reference.attention`: write the new keys/values, then attend (see `paged_attention`)."""
    return paged_attention(q, k, v, k_cache, v_cache, layout, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """`attention` with the tiling exposed: `num_splits` key slices per (sequence, kv head) (None: chosen
    from the batch and context sizes; 1: no split), `block_n` keys per step (None: 64).

    Args:
        q: [T, Hq, D] queries; k, v: [T, Hkv, D] new keys/values.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] contiguous paged caches, written in place.
        layout: the batch's sequences and block tables.
        scale: softmax scale.
    Returns:
        [T, Hq, D] in q's dtype.
    """
    if not layout.short_seqs:
        return reference.attention(q, k, v, k_cache, v_cache, layout, scale)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    written = layout.slot_mapping(q.device)  # [T] flat cache row of each new token
    k_cache.view(-1, hkv, d)[written] = k.to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[written] = v.to(v_cache.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _short(q, k_cache, v_cache, layout, scale, out, num_splits, block_n)
    if layout.long_seqs:
        # Prefill chunks (more than SHORT_QUERY new tokens) still take the reference's per-sequence SDPA
        # path, on a layout of just those sequences; it writes their rows again, which changes nothing.
        part, tokens = _long_part(layout, q.device)
        out[tokens] = reference.attention(q[tokens], k[tokens], v[tokens], k_cache, v_cache, part, scale)
    return out


def _short(q, k_cache, v_cache, layout: SeqLayout, scale, out, num_splits, block_n) -> None:
    """Every short sequence in one launch (plus the merge launch when the keys are split)."""
    seqs = layout.short_seqs
    num_seqs, hq, d = len(seqs), q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    n_max = max(layout.query_lens[i] for i in seqs)
    kv_max = max(layout.context_lens[i] + layout.query_lens[i] for i in seqs)
    tables, info = _short_index(layout, q.device)
    block_d = triton.next_power_of_2(d)
    block_m = max(16, triton.next_power_of_2(n_max * group))  # tl.dot needs at least 16 rows
    block_n = block_n or 64
    if num_splits is None:
        num_splits = _num_splits(num_seqs * hkv, kv_max, q.device)
    # H200, D 256, CUDA-graphed: 64 keys, 4 warps, 3 stages gave 2.2-3.3 TB/s of KV read on decode (64 x 4k,
    # 256 x 1k, 1 x 128k) and verify (16 x 8k) batches; a 64-row tile gets more warps and fewer stages
    # (shared memory).
    wide = block_m * block_d >= 64 * 256
    q = q if q.stride(-1) == 1 else q.contiguous()
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
        num_warps=8 if wide else 4,
        num_stages=2 if wide else 3,
    )
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
        q, k_cache, v_cache, target, lse, tables, info, scale * _LOG2E, *strides, **args
    )
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
    )


def _short_index(layout: SeqLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_blocks] int32 block tables (padded with 0) and [B, 3] int32 (first token, new tokens,
    context) of the short sequences, built once per layout and device."""
    seqs = layout.short_seqs
    if layout.block_tables is None:
        raise ValueError("this layout has no block tables, so it cannot address a paged KV cache")

    def tables():
        width = max(len(layout.block_tables[i]) for i in seqs)
        return torch.tensor(
            [list(layout.block_tables[i]) + [0] * (width - len(layout.block_tables[i])) for i in seqs],
            dtype=torch.int32,
        )

    def info():
        return torch.tensor(
            [[layout.cu_seqlens[i], layout.query_lens[i], layout.context_lens[i]] for i in seqs],
            dtype=torch.int32,
        )

    return (
        layout._cached("attention_triton_tables", device, tables),
        layout._cached("attention_triton_info", device, info),
    )


def _long_part(layout: SeqLayout, device) -> tuple[SeqLayout, torch.Tensor]:
    """A layout of the long sequences alone, and [T_long] the flat indices of their tokens."""
    key = ("attention_triton_long", torch.device(device))
    found = layout._tensors.get(key)
    if found is None:
        seqs = layout.long_seqs
        part = SeqLayout(
            query_lens=tuple(layout.query_lens[i] for i in seqs),
            context_lens=tuple(layout.context_lens[i] for i in seqs),
            slots=tuple(layout.slots[i] for i in seqs),
            block_tables=tuple(layout.block_tables[i] for i in seqs),
            block_size=layout.block_size,
        )
        tokens = [t for i in seqs for t in range(layout.cu_seqlens[i], layout.cu_seqlens[i + 1])]
        found = layout._tensors[key] = (part, torch.tensor(tokens, dtype=torch.long, device=device))
    return found


def _num_splits(num_programs: int, kv_max: int, device: torch.device) -> int:
    """Key slices per program: enough to fill the GPU when few (sequence, kv head) pairs have long keys."""
    if kv_max < _SPLIT_MIN_KV:
        return 1
    target = _PROGRAMS_PER_SM * (_multiprocessors(device.index or 0) if device.type == "cuda" else 132)
    if num_programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, num_programs), kv_max // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
