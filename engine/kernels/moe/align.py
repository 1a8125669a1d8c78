"""Triton `align_block_size`: (token, slot) pairs grouped by expert and padded to BLOCK_M, in 1-2 launches.

The pairs are cut into C contiguous chunks, one program each.
  1. count: each program writes its chunk's per-expert counts, row c of counts [C, E].
  2. align: each program sums the count rows into per-expert totals, pads them to blocks (tl.cumsum gives
     every expert's first row) and adds the rows of the chunks before its own, which is where its chunk's
     pairs of each expert start. It then places its pairs (rank within a sub-block of BLOCK_P pairs from a
     [BLOCK_P, BLOCK_P] comparison, a per-expert cursor in global memory between sub-blocks) and writes its
     share of the block table.
So each expert's pairs come out in ascending order, as a stable sort gives (reference.align_block_size), and
nothing is atomic. With one chunk (decode) a single program does both steps. The per-expert scratch rows live
in global memory: a program reads back what it wrote after a barrier, which CUDA guarantees within a block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.moe import reference
from engine.kernels.pdl import pdl_launch, pdl_wait

BLOCK_P = 64  # pairs per sub-block: a [64, 64] comparison gives each pair its rank among its expert's
MAX_CHUNKS = 128  # programs; each reads all C count rows, so C stays moderate
SINGLE_MAX_PAIRS = 4 * BLOCK_P  # up to here one program counts and places every pair (one launch)


@triton.jit
def _chunk_experts(ids_ptr, p, valid, stride_it, stride_is, NUM_SLOTS: tl.constexpr):
    """Expert ids [BLOCK_P] int32 of pairs p (token * NUM_SLOTS + slot); -1 where not valid."""
    token = (p // NUM_SLOTS).to(tl.int64)
    e = tl.load(ids_ptr + token * stride_it + (p % NUM_SLOTS) * stride_is, mask=valid, other=-1)
    return e.to(tl.int32)


@triton.jit
def _count_chunk(
    ids_ptr, counts_row_ptr, start, end, num_experts, stride_it, stride_is,
    NUM_SLOTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """counts_row[e] = how many pairs in [start, end) go to expert e."""
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(counts_row_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=offs_e < num_experts)
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK_P)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + offs
        valid = p < end
        e = _chunk_experts(ids_ptr, p, valid, stride_it, stride_is, NUM_SLOTS)
        same = tl.sum((e[:, None] == e[None, :]).to(tl.int32), 1)  # [BP] pairs here with my expert
        old = tl.load(counts_row_ptr + e, mask=valid, other=0)
        tl.debug_barrier()  # every read before any write: pairs of one expert share the address
        tl.store(counts_row_ptr + e, old + same, mask=valid)  # equal values where addresses repeat
        tl.debug_barrier()


@triton.jit
def _count_kernel(
    ids_ptr,  # [T, NUM_SLOTS] any int dtype
    counts_ptr,  # [C, E] int32 out
    num_pairs,
    chunk,  # pairs per program, a multiple of BLOCK_P
    num_experts,
    stride_it,
    stride_is,
    stride_cc,
    NUM_SLOTS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    start = pid * chunk
    end = tl.minimum(start + chunk, num_pairs)
    _count_chunk(
        ids_ptr, counts_ptr + pid * stride_cc, start, end, num_experts, stride_it, stride_is,
        NUM_SLOTS, BLOCK_P, BLOCK_E,
    )  # fmt: skip


@triton.jit
def _align_kernel(
    ids_ptr,  # [T, NUM_SLOTS] any int dtype
    counts_ptr,  # [C, E] int32: chunk counts (written here first when IS_SINGLE)
    cursor_ptr,  # [C, E] int32 scratch: where each chunk's next pair of each expert goes
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32 out
    block_experts_ptr,  # [num_blocks] int32 out; -1 for unused blocks
    block_rows_ptr,  # [num_blocks] int32 out
    num_pairs,
    chunk,
    num_chunks,
    num_experts,
    num_blocks,
    stride_it,
    stride_is,
    stride_cc,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
    IS_SINGLE: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    start = pid * chunk
    end = tl.minimum(start + chunk, num_pairs)
    if IS_SINGLE:
        _count_chunk(
            ids_ptr, counts_ptr, start, end, num_experts, stride_it, stride_is, NUM_SLOTS, BLOCK_P, BLOCK_E
        )  # fmt: skip
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    # Per-expert totals over all chunks, and over the chunks before this one.
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = (c < num_chunks)[:, None] & e_mask[None, :]
        counts = tl.load(counts_ptr + c[:, None] * stride_cc + offs_e[None, :], mask=mask, other=0)
        total += tl.sum(counts, 0)
        before += tl.sum(tl.where(c[:, None] < pid, counts, 0), 0)
    blocks = (total + BLOCK_M - 1) // BLOCK_M
    row_end = tl.cumsum(blocks, 0) * BLOCK_M  # [BE] one past each expert's last padded row
    row_start = row_end - blocks * BLOCK_M

    # Place this chunk's pairs: cursor[e] is where its next pair of expert e goes.
    cursor_row = cursor_ptr + pid * stride_cc
    tl.store(cursor_row + offs_e, row_start + before, mask=e_mask)
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK_P)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + offs
        valid = p < end
        e = _chunk_experts(ids_ptr, p, valid, stride_it, stride_is, NUM_SLOTS)
        same = e[:, None] == e[None, :]  # [BP, BP]
        rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), 1)  # earlier pairs, my expert
        count = tl.sum(same.to(tl.int32), 1)
        base = tl.load(cursor_row + e, mask=valid, other=0)
        tl.debug_barrier()
        tl.store(sorted_pairs_ptr + base + rank, p, mask=valid)
        tl.store(cursor_row + e, base + count, mask=valid)
        tl.debug_barrier()

    # Block table, blocks strided over the programs: the expert whose padded rows hold the block's first row.
    for b0 in range(pid * BLOCK_B, num_blocks, num_chunks * BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        first = b[:, None] * BLOCK_M  # [BB, 1]
        owns = (row_start[None, :] <= first) & (first < row_end[None, :]) & e_mask[None, :]  # [BB, BE]
        expert = tl.sum(tl.where(owns, offs_e[None, :] + 1, 0), 1) - 1  # -1: past the last used block
        rows = tl.sum(tl.where(owns, row_start[None, :] + total[None, :] - first, 0), 1)
        b_mask = b < num_blocks
        tl.store(block_experts_ptr + b, expert, mask=b_mask)
        tl.store(block_rows_ptr + b, tl.minimum(rows, BLOCK_M), mask=b_mask)


def num_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks `align_block_size` may use, from shapes alone (each expert with pairs pads < one block)."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.align_block_size` (same outputs, same pair order) in one launch for up to
    SINGLE_MAX_PAIRS pairs and two above; ids [T, S] of any int dtype and strides."""
    t, slots = ids.shape
    n = t * slots
    if n == 0 or num_experts > 8192:  # a [BLOCK_C, E] tile per program: keep E moderate
        reason = dispatch.EMPTY if n == 0 else "more than 8192 experts"
        dispatch.fallback("moe_align_block_size", reason, expected=n == 0, ids=ids)
        return reference.align_block_size(ids, num_experts, block_m)
    device = ids.device
    num_blocks = num_blocks_for(n, num_experts, block_m)
    chunks = 1 if n <= SINGLE_MAX_PAIRS else min(MAX_CHUNKS, triton.cdiv(n, BLOCK_P))
    chunk = triton.cdiv(triton.cdiv(n, chunks), BLOCK_P) * BLOCK_P
    chunks = triton.cdiv(n, chunk)
    scratch = torch.empty(2, chunks, num_experts, dtype=torch.int32, device=device)  # counts, cursors
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    table = torch.empty(2, num_blocks, dtype=torch.int32, device=device)  # block experts, block rows
    block_e = triton.next_power_of_2(num_experts)
    common = dict(NUM_SLOTS=slots, BLOCK_P=BLOCK_P, BLOCK_E=block_e)
    strides = (ids.stride(0), ids.stride(1), scratch.stride(1))
    if chunks > 1:
        _count_kernel[(chunks,)](
            ids, scratch[0], n, chunk, num_experts, *strides, **common, num_warps=4, **pdl_launch()
        )
    _align_kernel[(chunks,)](
        ids, scratch[0], scratch[1], sorted_pairs, table[0], table[1],
        n, chunk, chunks, num_experts, num_blocks, *strides,
        BLOCK_M=block_m, BLOCK_C=max(1, min(16, 4096 // block_e)), BLOCK_B=max(1, min(32, 4096 // block_e)),
        IS_SINGLE=chunks == 1, **common, num_warps=4, **pdl_launch(),
    )  # fmt: skip
    return sorted_pairs, table[0], table[1]
