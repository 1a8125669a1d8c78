"""Packed GQA prefill attention (Triton): one program per (kv head, tile of new tokens of one long sequence)
holds every query head of its kv head, so each key/value tile is read once for all of them.

Row r of a tile is token j0 + r // GROUP, query head kv_head * GROUP + r % GROUP (token-major, as the short
path packs decode rows): at Qwen3.5's 16:2 heads a 128-row tile is 16 tokens x 8 heads. Against the rows
kernel (`triton._prefill_attention_kernel`: one program per query head and 64 tokens) it moves half the
key/value bytes per FLOP from L2 into shared memory (an eighth of what one head's 16 tokens would), and its
128 rows give each of two Hopper warpgroups 64 rows and every key column (wgmma 64 x 64 and 64 x 256, where
the rows kernel's 8 warps split its 64 rows' key columns: 64 x 32 and 64 x 128, and reduce across them).

The causal mask runs only on the tile's last key blocks: a tile spans TOKENS consecutive positions, so keys
0 .. ctx + j0 are visible to every row and go without it. Blocks wholly before the tile need no bounds mask
either (they end before the sequence does). When a cache block holds a whole number of key tiles
(KV_BLOCK % BLOCK_N == 0) a key tile is one contiguous run of a single block: one table read per tile
instead of one per key; when a key tile holds whole cache blocks (the engine's 16 positions) a key's place
in its block is loop-invariant.

Launched without PDL, as the rows kernel: a chunk's attention runs for milliseconds, the launch gap PDL
hides is microseconds.

FP8 cache (`USE_KV_SCALE`): as the rows kernel, keys converted to q's dtype as stored with their scales on
the score columns, values dequantised before the PV product. With e4m3 products (`FP8_DOT`,
ENCLAVE_FP8_ATTENTION=1) the queries are quantised per row once per tile and the keys and values enter the
dots as stored: QK^T times the query and key scales, and P times the values' scales quantised per row before
the PV dot, as the rows kernel does. Hopper's e4m3 wgmma takes both operands K-major, and the cache stores V
D-major (positions apart), which the PV product would transpose tile by tile: measured on an H100 at 108-116
TFLOP/s, 2.3x slower than bf16 products over the same cache (docs/PERFORMANCE.md, sixth session). So from
a long context the launcher hands it the step's values transposed once per step (`V_TRANSPOSED`: [D,
positions] per block and kv head, `triton._fp8_gathered`), read as [D, BLOCK_N] tiles whose transpose is
K-major.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention.e4m3 import pv_e4m3_in_units, quantize_rows

# sm_90 at D 256, bf16/fp16 (ptxas, tests/engine/kernels/test_compile_sm90.py): 128 rows x 64 keys, 8 warps,
# 2 stages. Unmeasured on the H200: benchmarks/attention_prefill.py --sweep picks among the alternatives.
# fp32 rows (1 KB, dots on the FMA units) spill registers above 16 x 16, as in the rows kernel.
DEFAULT_TILES = {2: (128, 64, 8, 2), 4: (16, 16, 4, 1)}  # element size -> (rows, keys, warps, stages)
# The tilings (rows, keys, warps, stages) `benchmarks/attention_prefill.py --sweep` times; each compiles for
# sm_90 within its shared memory (the compile test builds them all). ptxas at D 256, bf16, 16-position cache
# blocks: 128 x 64 x 2 stages 192 KB, 255 registers, no spills (1 stage: 128 KB, 250); 128 x 32 128 KB,
# 222-230; 64 x 32 x 4 warps 96 KB and 250-254 registers, so two programs share an SM (65,536 registers
# exactly) and one's softmax can hide under the other's wgmma, at twice the key/value bytes per FLOP.
# (64 x 64 x 4 warps spills 112 bytes: left out.)
SWEEP_TILES = [
    (128, 64, 8, 2),
    (128, 64, 8, 1),
    (128, 32, 8, 2),
    (128, 32, 8, 3),
    (128, 16, 8, 4),
    (64, 32, 4, 2),
    (64, 32, 4, 3),
]


@triton.jit
def _packed_block(
    q,  # [BLOCK_M, BLOCK_D] queries of the tile (FP8_DOT: e4m3, times q_scale)
    q_scale,  # [BLOCK_M] fp32 (FP8_DOT only)
    acc,  # [BLOCK_M, BLOCK_D] fp32 unnormalised output (FP8_DOT: in units of `unit`)
    m_i,  # [BLOCK_M] fp32 running max (base 2)
    l_i,  # [BLOCK_M] fp32 running sum
    unit,  # [BLOCK_M] fp32 (FP8_DOT only): acc * unit is the unnormalised output
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
    stride_vr,  # V_TRANSPOSED: the stride between value dims (positions are contiguous)
    scale_log2,
    KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DIAGONAL: tl.constexpr,  # keys past some query row or past the sequence: mask them
    WHOLE_PAGES: tl.constexpr,  # KV_BLOCK % BLOCK_N == 0: the key tile lies in one cache block
    DOT_PRECISION: tl.constexpr,
    USE_KV_SCALE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    FP8_DOT: tl.constexpr,  # e4m3 QK and PV products (needs USE_KV_SCALE)
    EXACT_E4M3: tl.constexpr,
    V_TRANSPOSED: tl.constexpr,  # values stored [D, KV_BLOCK] per block and head (K-major for the PV dot)
):
    n = tl.arange(0, BLOCK_N)
    pos = start + n  # [BLOCK_N] key positions
    d = tl.arange(0, BLOCK_D)
    kv_ok = pos < kv_len
    if WHOLE_PAGES:
        block = tl.load(table_ptr + start // KV_BLOCK).to(tl.int64)  # start < kv_len: a real entry
        offset = start % KV_BLOCK + n
        k_offs = block * stride_kb + offset[:, None] * stride_kr + d[None, :]
        if V_TRANSPOSED:  # [BLOCK_D, BLOCK_N]: one contiguous run of positions per value dim
            v_offs = block * stride_vb + d[:, None] * stride_vr + offset[None, :]
        else:
            v_offs = block * stride_vb + offset[:, None] * stride_vr + d[None, :]
        flat = block * KV_BLOCK + offset  # [BLOCK_N] cache row of each key
    else:
        # start is a multiple of BLOCK_N; when that is a multiple of KV_BLOCK too, a key's place in its cache
        # block is the same in every tile (loop-invariant) and its table entry is start's plus n // KV_BLOCK.
        if BLOCK_N % KV_BLOCK == 0:
            entry = start // KV_BLOCK + n // KV_BLOCK
            offset = n % KV_BLOCK
        else:
            entry = pos // KV_BLOCK
            offset = pos % KV_BLOCK
        if IS_DIAGONAL:
            block = tl.load(table_ptr + entry, mask=kv_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table_ptr + entry).to(tl.int64)
        k_offs = block[:, None] * stride_kb + offset[:, None] * stride_kr + d[None, :]
        if V_TRANSPOSED:
            v_offs = block[None, :] * stride_vb + d[:, None] * stride_vr + offset[None, :]
        else:
            v_offs = block[:, None] * stride_vb + offset[:, None] * stride_vr + d[None, :]
        flat = block * KV_BLOCK + offset
    if IS_DIAGONAL or BLOCK_D != HEAD_DIM:
        # Rows past the sequence's end may hold NaN: masked loads give 0 there (0 * NaN would be NaN).
        kv_mask = kv_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D] as stored
        if V_TRANSPOSED:
            v = tl.trans(tl.load(v_ptr + v_offs, mask=(d < HEAD_DIM)[:, None] & kv_ok[None, :], other=0.0))
        else:
            v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptr + k_offs)
        v = tl.load(v_ptr + v_offs)
        if V_TRANSPOSED:
            v = tl.trans(v)  # [BLOCK_N, BLOCK_D], positions contiguous
    if FP8_DOT:  # e4m3 as stored, the queries' row scales on the scores
        s = tl.dot(q, tl.trans(k)) * q_scale[:, None]  # [BLOCK_M, BLOCK_N], natural units
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], natural units
    if USE_KV_SCALE:
        row = flat * NUM_KV_HEADS  # [BLOCK_N] scale index (the head is in ks_ptr)
        s = s * tl.load(ks_ptr + row, mask=kv_ok, other=0.0)[None, :]
        vs = tl.load(vs_ptr + row, mask=kv_ok, other=0.0)  # [BLOCK_N]
        if not FP8_DOT:
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
    if IS_DIAGONAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, float("-inf"))
    # Every row sees the first key of the first block it reads, so m stays finite. The softmax scale goes
    # into the exponent's one multiply-add (scale_log2 > 0 commutes with the max).
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_DOT:
        acc, unit = pv_e4m3_in_units(acc, unit, alpha, p, vs, v, EXACT_E4M3)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i, unit


@triton.jit
def _prefill_packed_kernel(
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
    BLOCK_M: tl.constexpr,  # rows: TOKENS x GROUP, padded to a power of two
    BLOCK_N: tl.constexpr,
    TOKENS: tl.constexpr,  # new tokens per tile, BLOCK_M // GROUP
    DOT_PRECISION: tl.constexpr,
    USE_KV_SCALE: tl.constexpr = False,  # an FP8 cache with per-(position, kv head) scales
    NUM_KV_HEADS: tl.constexpr = 1,
    FP8_DOT: tl.constexpr = False,  # e4m3 QK and PV products: q and P quantised per row
    EXACT_E4M3: tl.constexpr = False,  # round to e4m3 in fp32 before casts (the interpreter)
    V_TRANSPOSED: tl.constexpr = False,  # v_cache_ptr [num_blocks, Hkv, D, block_size] (stride_vr: D's)
):
    # The kv heads vary fastest over the grid: the programs of one tile read its block table together.
    h = tl.program_id(0)
    tile = tl.program_id(1)
    b = tl.load(tiles_ptr + tile * 2)
    j0 = tl.load(tiles_ptr + tile * 2 + 1)
    q_start = tl.load(seq_info_ptr + b * 3)
    n_new = tl.load(seq_info_ptr + b * 3 + 1)
    ctx = tl.load(seq_info_ptr + b * 3 + 2)
    kv_len = ctx + n_new

    rows = tl.arange(0, BLOCK_M)
    tok = j0 + rows // GROUP  # new token of each row; token j sits at position ctx + j
    head = h * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < n_new)
    q_pos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]; padding rows 0
    if FP8_DOT:
        q, q_scale = quantize_rows(q, EXACT_E4M3)
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
    unit = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    # Keys 0 .. ctx + j0 are visible to every row of the tile: whole blocks of them go without any mask.
    full_end = (ctx + j0 + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i, unit = _packed_block(
            q, q_scale, acc, m_i, l_i, unit, q_pos, start, kv_len, table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
            stride_kb, stride_kr, stride_vb, stride_vr, scale_log2,
            KV_BLOCK, HEAD_DIM, BLOCK_D, BLOCK_N, False, KV_BLOCK % BLOCK_N == 0, DOT_PRECISION,
            USE_KV_SCALE, NUM_KV_HEADS, FP8_DOT, EXACT_E4M3, V_TRANSPOSED,
        )  # fmt: skip
    # The rest, up to the tile's last position (padding rows past the sequence's end mask keys >= kv_len).
    diag_end = tl.minimum(kv_len, ctx + j0 + TOKENS)
    for start in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i, unit = _packed_block(
            q, q_scale, acc, m_i, l_i, unit, q_pos, start, kv_len, table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
            stride_kb, stride_kr, stride_vb, stride_vr, scale_log2,
            KV_BLOCK, HEAD_DIM, BLOCK_D, BLOCK_N, True, KV_BLOCK % BLOCK_N == 0, DOT_PRECISION,
            USE_KV_SCALE, NUM_KV_HEADS, FP8_DOT, EXACT_E4M3, V_TRANSPOSED,
        )  # fmt: skip

    if FP8_DOT:
        acc = acc * unit[:, None]
    o = acc / l_i[:, None]
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def tiling(
    dtype: torch.dtype, group: int, block_m: int | None = None, block_n: int | None = None
) -> tuple[int, int, int, int]:
    """(rows, keys, warps, stages) of a tile: the dtype's defaults where not given; rows at least one token's
    worth of query heads (a power of two) and 16 (tl.dot's least); 8 warps from 128 x 64 tiles."""
    rows, keys, warps, stages = DEFAULT_TILES[4 if dtype == torch.float32 else 2]
    if block_m or block_n:
        rows, keys = block_m or rows, block_n or keys
        warps = 8 if rows * keys >= 128 * 64 else 4
    return max(rows, 16, triton.next_power_of_2(group)), keys, warps, stages


def prefill_packed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    tables: torch.Tensor,
    info: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    fp8_dot: bool = False,
    exact_e4m3: bool = False,
    v_transposed: bool = False,
) -> None:
    """Launch the packed kernel over `tiles` ([num_tiles, 2] int32: long sequence, first new token, tokens
    block_m // group apart), writing `out` [T, Hq, D]; `tables`/`info` as `triton._seq_index` builds them.
    `fp8_dot` (an FP8 cache only): e4m3 QK and PV products; `exact_e4m3`: round to e4m3 in fp32 first (the
    interpreter's cast is faulty); `v_transposed`: `v_cache` is [num_blocks, Hkv, D, block_size] (each
    block's values with positions contiguous, as Hopper's e4m3 PV product wants them)."""
    if fp8_dot and scales is None:
        raise ValueError("e4m3 products need an FP8 cache (its scales)")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    if v_transposed:  # (block, value dim, head): the kernel's (block, row, head) strides, rows being dims
        if v_cache.shape != (k_cache.shape[0], hkv, d, k_cache.shape[1]) or v_cache.stride(-1) != 1:
            shape = tuple(v_cache.shape)
            raise ValueError(f"transposed values must be [blocks, Hkv, D, block_size], got {shape}")
        v_strides = (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1))
    else:
        v_strides = v_cache.stride()[:3]
    strides = (
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_strides,
        *out.stride()[:2],
        tables.stride(0),
    )
    k_scale, v_scale = scales or (k_cache, v_cache)  # unread without scales
    _prefill_packed_kernel[(hkv, tiles.shape[0])](
        q, k_cache, v_cache, k_scale, v_scale, out, tables, info, tiles, scale * 1.4426950408889634, *strides,
        GROUP=group,
        KV_BLOCK=k_cache.shape[1],
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        TOKENS=block_m // group,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_KV_SCALE=scales is not None,
        NUM_KV_HEADS=hkv,
        FP8_DOT=fp8_dot,
        EXACT_E4M3=fp8_dot and exact_e4m3,
        V_TRANSPOSED=v_transposed,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
