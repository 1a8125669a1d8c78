"""Triton gated delta rule: a fused token-by-token recurrence for short sequences (decode, MTP verify, short
prefills), a chunked (WY) form for longer ones.

Recurrent: one program per (sequence, value head, dv tile) keeps its state tile [dk, BV] in registers for
all of the sequence's new tokens (fp32, or bf16 states as stored, converted at each use), so each state
element is read once and written once per step (or once per token when the layout keeps per-token states
for the verify step).

Chunked, as `reference.chunked` (the split of flash-linear-attention's chunk_gated_delta_rule), three passes:
1. `_chunk_wy_kernel`, every (chunk of 64 tokens, value head) in parallel: the cumulative decay, (I + A)^-1
   and the WY factors of its chunk.
2. `_chunk_state_kernel`, one program per (sequence, value head, dv tile): walks the chunks in order with
   its fp32 state tile [dk, BV], saving the state each chunk starts from and the values the chunk writes.
3. `_chunk_out_kernel`, every (dv tile, chunk, value head) in parallel: the outputs from those.
Only pass 2 is sequential, and it does two tensor-core products per chunk.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.gated_delta import reference
from engine.kernels.layout import SeqLayout
from engine.kernels.pdl import pdl_launch, pdl_wait

# Sequences adding at most this many tokens run in the recurrent kernel, longer ones in the chunked kernels.
MAX_RECURRENT = 64
# Tokens per chunk of the chunked form (the reference's CHUNK).
BT = 64
# Size of the diagonal blocks of a chunk's triangular system that are inverted by substitution; the series
# across blocks in _chunk_wy_kernel is exact for at most BT / BC = 4 blocks.
BC = 16

# Bits of the flags column of the per-sequence table.
_HAS_CONTEXT, _KEEPS_STATES = 1, 2


@triton.jit
def _recurrent_kernel(
    q,  # [T, Hk, dk]
    k,  # [T, Hk, dk]
    v,  # [T, Hv, dv]
    g,  # [T, Hv] fp32 log decay
    beta,  # [T, Hv]
    state,  # [S, Hv, dk, dv] fp32, or bf16 (`state_dtype`; rounded after every token)
    out,  # [T, Hv, dv], contiguous
    seqs,  # [N, 4] int32: start, length, slot, flags
    token_slots,  # [T] int32 slot for the state after each token, -1 for none (only read if USE_STATE_OUT)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    HV,
    RATIO,
    DK,
    DV,
    scale,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_STATE_OUT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // RATIO  # value head j reads key head j // (Hv // Hk)
    start = tl.load(seqs + i_n * 4 + 0).to(tl.int64)
    length = tl.load(seqs + i_n * 4 + 1)
    slot = tl.load(seqs + i_n * 4 + 2).to(tl.int64)
    flags = tl.load(seqs + i_n * 4 + 3)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    p_s = state + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv  # [BK, BV]

    # Scalar conditions enter the masks as a row bound (0 rows masks everything), because Triton's
    # interpreter rejects `tensor & scalar` masks.
    # A sequence without context (flag bit 1 clear) starts from zeros: its slot may hold garbage.
    m_read = (o_k[:, None] < tl.where((flags & 1) != 0, DK, 0)) & m_v[None, :]
    b_s = tl.load(p_s + slot * stride_ss, mask=m_read, other=0.0)  # as stored: fp32, or 16-bit (see below)

    for t in range(0, length):
        tok = start + t
        b_q = tl.load(q + tok * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + tok * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + tok * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + tok * stride_gt + i_h * stride_gh).to(tl.float32)
        b_beta = tl.load(beta + tok * stride_bt + i_h * stride_bh).to(tl.float32)
        # Same eps as reference.l2norm.
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)

        if state.dtype.element_ty == tl.float32:
            b_s = b_s * tl.exp(b_g)
            b_delta = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))  # [BV]
            b_s = b_s + b_k[:, None] * b_delta[None, :]
        else:
            # 16-bit states: the tile stays in its storage dtype between uses, converted at each (fewer
            # registers live: sm_90 241 against 254 and a spill at (64, 2)), the decay applied to the reduced
            # row (exp(g) sum(s k) = sum(exp(g) s k)), the update rounded as stored, as the reference does.
            decay = tl.exp(b_g)
            b_delta = b_beta * (b_v - decay * tl.sum(b_s.to(tl.float32) * b_k[:, None], axis=0))  # [BV]
            b_s = (b_s.to(tl.float32) * decay + b_k[:, None] * b_delta[None, :]).to(state.dtype.element_ty)
        b_o = tl.sum(b_s.to(tl.float32) * b_q[:, None], axis=0)  # [BV]
        tl.store(out + (tok * HV + i_h) * DV + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
        if USE_STATE_OUT:
            out_slot = tl.load(token_slots + tok).to(tl.int64)
            m_out = (o_k[:, None] < tl.where(out_slot >= 0, DK, 0)) & m_v[None, :]
            tl.store(p_s + tl.maximum(out_slot, 0) * stride_ss, b_s, mask=m_out)

    # A sequence keeping per-token states (flag bit 2) leaves its home slot alone unless state_out names it.
    m_home = (o_k[:, None] < tl.where((flags & 2) == 0, DK, 0)) & m_v[None, :]
    tl.store(p_s + slot * stride_ss, b_s, mask=m_home)


@triton.jit
def _chunk_wy_kernel(
    k,  # [T, Hk, dk]
    v,  # [T, Hv, dv]
    g,  # [T, Hv] fp32 log decay
    beta,  # [T, Hv]
    chunks,  # [NC, 2] int32: first token, tokens in the chunk (1..BT)
    kd,  # [NC, Hv, BT, dk] out: (I + A)^-1 (beta exp(c) k)
    kend,  # [NC, Hv, BT, dk] out: k exp(c_last - c), the keys decayed to the chunk's end
    w,  # [NC, Hv, BT, dv] out: (I + A)^-1 (beta v)
    cum,  # [NC, Hv, BT] fp32 out: cumulative log decay c (padding rows repeat the last token's)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    HV,
    RATIO,
    DK,
    DV,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_c, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_hk = i_h // RATIO
    dt = w.dtype.element_ty  # the scratch's dtype: the inputs' 16-bit type, or fp32
    start = tl.load(chunks + i_c * 2 + 0).to(tl.int64)
    n = tl.load(chunks + i_c * 2 + 1)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t = o_t < n
    m_k = o_k < DK
    m_v = o_v < DV
    tok = start + o_t

    # Padding rows load k = v = beta = g = 0, as the reference pads: they change nothing.
    p_k = k + tok[:, None] * stride_kt + i_hk * stride_kh + o_k[None, :]
    b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(dt)  # [BT, BK] raw keys
    b_kf = b_k.to(tl.float32)
    r_k = tl.rsqrt(tl.sum(b_kf * b_kf, axis=1) + 1e-6)  # [BT] 1 / |k|, same eps as reference.l2norm
    b_g = tl.load(g + tok * stride_gt + i_h * stride_gh, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * stride_bt + i_h * stride_bh, mask=m_t, other=0.0).to(tl.float32)
    b_c = tl.cumsum(b_g, axis=0)  # [BT]
    b_last = tl.sum(b_g)
    base = i_c * HV + i_h
    tl.store(cum + base * BT + o_t, b_c)
    p_kend = kend + (base * BT + o_t[:, None]) * DK + o_k[None, :]
    tl.store(p_kend, (b_kf * (r_k * tl.exp(b_last - b_c))[:, None]).to(dt), mask=m_k[None, :])
    b_ke = (b_kf * (r_k * b_beta * tl.exp(b_c))[:, None]).to(dt)  # [BT, BK]

    # A_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i, normalising after the product of the raw keys (the
    # exponent is zeroed elsewhere: it may overflow).
    m_strict = o_t[:, None] > o_t[None, :]
    decay = tl.exp(tl.where(m_strict, b_c[:, None] - b_c[None, :], 0.0))
    b_a = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_a = tl.where(m_strict, b_a * decay * (r_k * b_beta)[:, None] * r_k[None, :], 0.0)  # [BT, BT]

    # (I + A)^-1 in two steps. First the inverse D = I + Y of its BC x BC diagonal blocks, by substitution
    # a column at a time from the right (reductions along rows are the cheap ones): (I + Y)(I + A) = I gives
    # Y_:j = -A_:j - sum_{m>j} Y_:m A_mj. Column j of every block at once: their rows are disjoint.
    m_block = (o_t[:, None] // BC) == (o_t[None, :] // BC)
    b_d = -tl.where(m_block, b_a, 0.0)
    for j in range(BC - 2, -1, -1):
        m_col = (o_t % BC) == j
        b_col = tl.sum(tl.where(m_col[None, :], b_d, 0.0), axis=1)  # [BT] -A_:j, zero at rows m <= j
        b_col = b_col + tl.sum(b_d * b_col[None, :], axis=1)  # columns m <= j meet the zeros
        b_d = tl.where(m_col[None, :] & m_block, b_col[:, None], b_d)
    b_d = b_d + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)  # [BT, BT] block-diagonal D
    # Then with E = D L (L: A below the diagonal blocks), I + A = D^-1 (I + E) and E^(BT / BC) = 0, so
    # (I + A)^-1 = (I - E + E^2 - E^3) D = (I - E)(I + E^2) D for BT / BC = 4 blocks (or fewer).
    tl.static_assert(BT <= 4 * BC)
    b_e = tl.dot(b_d, tl.where(m_block, 0.0, b_a), input_precision=DOT_PRECISION)
    b_x = b_d + tl.dot(tl.dot(b_e, b_e, input_precision=DOT_PRECISION), b_d, input_precision=DOT_PRECISION)
    b_inv = (b_x - tl.dot(b_e, b_x, input_precision=DOT_PRECISION)).to(dt)  # [BT, BT] (I + A)^-1

    b_kd = tl.dot(b_inv, b_ke, input_precision=DOT_PRECISION)  # [BT, BK]
    tl.store(kd + (base * BT + o_t[:, None]) * DK + o_k[None, :], b_kd.to(dt), mask=m_k[None, :])
    p_v = v + tok[:, None] * stride_vt + i_h * stride_vh + o_v[None, :]
    b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BT, BV]
    b_w = tl.dot(b_inv, (b_v * b_beta[:, None]).to(dt), input_precision=DOT_PRECISION)  # [BT, BV]
    tl.store(w + (base * BT + o_t[:, None]) * DV + o_v[None, :], b_w.to(dt), mask=m_v[None, :])


@triton.jit
def _chunk_state_kernel(
    kd,  # [NC, Hv, BT, dk] from _chunk_wy_kernel
    kend,  # [NC, Hv, BT, dk] from _chunk_wy_kernel
    w,  # [NC, Hv, BT, dv] from _chunk_wy_kernel; overwritten with u = w - kd S, the values each chunk writes
    cum,  # [NC, Hv, BT] fp32 from _chunk_wy_kernel
    h,  # [NC, Hv, dk, dv] out: the state each chunk starts from
    state,  # [S, Hv, dk, dv] fp32, or bf16 (`state_dtype`; rounded once, at the end)
    seqs,  # [N, 5] int32: start, length, slot, flags, index of the first chunk
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    HV,
    DK,
    DV,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # The only sequential part: per chunk one [BT, dk] x [dk, BV] and one [dk, BT] x [BT, BV] product.
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    dt = w.dtype.element_ty
    length = tl.load(seqs + i_n * 5 + 1)
    slot = tl.load(seqs + i_n * 5 + 2).to(tl.int64)
    flags = tl.load(seqs + i_n * 5 + 3)
    chunk0 = tl.load(seqs + i_n * 5 + 4).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = state + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv  # [BK, BV]

    # As in the recurrent kernel: no context (flag bit 1 clear) starts from zeros, the slot may hold garbage.
    m_read = (o_k[:, None] < tl.where((flags & 1) != 0, DK, 0)) & m_v[None, :]
    b_s = tl.load(p_s + slot * stride_ss, mask=m_read, other=0.0).to(tl.float32)  # [BK, BV]

    for i in range(0, tl.cdiv(length, BT)):
        base = (chunk0 + i) * HV + i_h
        tl.store(h + base * DK * DV + o_k[:, None] * DV + o_v[None, :], b_s.to(dt), mask=m_kv)
        p_kd = (base * BT + o_t[:, None]) * DK + o_k[None, :]
        b_kd = tl.load(kd + p_kd, mask=m_k[None, :], other=0.0)  # [BT, BK]
        b_ke = tl.load(kend + p_kd, mask=m_k[None, :], other=0.0)  # [BT, BK]
        p_w = w + (base * BT + o_t[:, None]) * DV + o_v[None, :]
        b_w = tl.load(p_w, mask=m_v[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        b_last = tl.load(cum + base * BT + BT - 1)

        b_u = (b_w - tl.dot(b_kd, b_s.to(dt), input_precision=DOT_PRECISION)).to(dt)  # [BT, BV]
        tl.store(p_w, b_u, mask=m_v[None, :])
        b_s = tl.dot(tl.trans(b_ke), b_u, b_s * tl.exp(b_last), input_precision=DOT_PRECISION)

    tl.store(p_s + slot * stride_ss, b_s, mask=m_kv)


@triton.jit
def _chunk_out_kernel(
    q,  # [T, Hk, dk]
    k,  # [T, Hk, dk]
    u,  # [NC, Hv, BT, dv] from _chunk_state_kernel
    cum,  # [NC, Hv, BT] fp32 from _chunk_wy_kernel
    h,  # [NC, Hv, dk, dv] from _chunk_state_kernel
    out,  # [T, Hv, dv], contiguous
    chunks,  # [NC, 2] int32: first token, tokens in the chunk
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    HV,
    RATIO,
    DK,
    DV,
    scale,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # o = (q exp(c)) S0 + (causal q k^T exp(c_i - c_j)) u, every (dv tile, chunk, value head) in parallel.
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    i_hk = i_h // RATIO
    dt = h.dtype.element_ty
    start = tl.load(chunks + i_c * 2 + 0).to(tl.int64)
    n = tl.load(chunks + i_c * 2 + 1)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < n
    m_k = o_k < DK
    m_v = o_v < DV
    tok = start + o_t
    m_tk = m_t[:, None] & m_k[None, :]
    # Raw queries and keys into the products, their norms applied to the products' rows and columns.
    b_q = tl.load(q + tok[:, None] * stride_qt + i_hk * stride_qh + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + tok[:, None] * stride_kt + i_hk * stride_kh + o_k[None, :], mask=m_tk, other=0.0)
    b_q = b_q.to(dt)
    b_k = b_k.to(dt)
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    r_q = tl.rsqrt(tl.sum(b_qf * b_qf, axis=1) + 1e-6) * scale  # [BT]
    r_k = tl.rsqrt(tl.sum(b_kf * b_kf, axis=1) + 1e-6)  # [BT]

    base = i_c * HV + i_h
    b_c = tl.load(cum + base * BT + o_t)  # [BT]
    m_causal = o_t[:, None] >= o_t[None, :]
    decay = tl.exp(tl.where(m_causal, b_c[:, None] - b_c[None, :], 0.0))
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_qk = tl.where(m_causal, b_qk * decay * r_q[:, None] * r_k[None, :], 0.0).to(dt)  # [BT, BT]

    m_kv = m_k[:, None] & m_v[None, :]
    b_h = tl.load(h + base * DK * DV + o_k[:, None] * DV + o_v[None, :], mask=m_kv, other=0.0)  # [BK, BV]
    b_u = tl.load(u + (base * BT + o_t[:, None]) * DV + o_v[None, :], mask=m_v[None, :], other=0.0)
    b_o = tl.dot(b_q, b_h, input_precision=DOT_PRECISION) * (r_q * tl.exp(b_c))[:, None]
    b_o = tl.dot(b_qk, b_u, b_o, input_precision=DOT_PRECISION)  # [BT, BV]
    p_o = out + (tok[:, None] * HV + i_h) * DV + o_v[None, :]
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


def _seq_table(layout: SeqLayout) -> torch.Tensor:
    """[N, 4] int32 (start, length, slot, flags) of the sequences the recurrent kernel runs."""
    rows = [
        (
            layout.cu_seqlens[i],
            n,
            layout.slots[i],
            (_HAS_CONTEXT if c > 0 else 0) | (_KEEPS_STATES if layout.keeps_states(i) else 0),
        )
        for i, (n, c) in enumerate(zip(layout.query_lens, layout.context_lens, strict=True))
        if n <= MAX_RECURRENT
    ]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)


def _token_slots(layout: SeqLayout) -> torch.Tensor:
    """[T] int32: the slot `state_out` names for the state after each token, -1 where it names none."""
    slots = [-1] * layout.num_tokens
    for i, targets in enumerate(layout.state_out):
        start = layout.cu_seqlens[i]
        slots[start : start + len(targets)] = targets
    return torch.tensor(slots, dtype=torch.int32)


def _chunk_tables(layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked kernels' tables: [N, 5] int32 (start, length, slot, flags, first chunk) of the long
    sequences, and [NC, 2] int32 (first token, tokens) of their chunks, numbered in sequence order."""
    seqs, chunks = [], []
    for i, (n, c) in enumerate(zip(layout.query_lens, layout.context_lens, strict=True)):
        if n <= MAX_RECURRENT:
            continue
        start = layout.cu_seqlens[i]
        seqs.append((start, n, layout.slots[i], _HAS_CONTEXT if c > 0 else 0, len(chunks)))
        chunks += [(start + j, min(BT, n - j)) for j in range(0, n, BT)]
    return (
        torch.tensor(seqs, dtype=torch.int32).reshape(-1, 5),
        torch.tensor(chunks, dtype=torch.int32).reshape(-1, 2),
    )


@dataclass(frozen=True)
class ChunkLaunch:
    """Launch choices of the chunked kernels: dv tile, warps and pipeline stages of the state walk, dv tile
    and warps of the output pass (benchmarks/kernels_gated_delta.py --sweep times alternatives)."""

    state_bv: int = 64
    state_warps: int = 4
    state_stages: int = 2
    out_bv: int = 64
    out_warps: int = 4
    wy_warps: int = 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's, so the interpreter takes the launch choices the GPU would
    return torch.cuda.get_device_properties(device).multi_processor_count


def _chunk_launch(num_heads: int, dv: int, device: torch.device) -> ChunkLaunch:
    """The state walk has one program per (sequence, value head, dv tile) and nothing else to hide its
    latency: the widest tile (64, 32, 16) that still gives every SM a program. Not yet measured: the
    benchmark's --sweep times the alternatives."""
    sms = _num_sms(device)
    bv = next((bv for bv in (64, 32) if num_heads * triton.cdiv(dv, bv) >= sms), 16)
    return ChunkLaunch(state_bv=bv)


def _dot_width(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs every dimension >= 16


def _chunked(q, k, v, g, beta, state, layout: SeqLayout, out, launch: ChunkLaunch | None = None) -> None:
    """The sequences longer than MAX_RECURRENT, all at once: WY factors per chunk, the state walk, then the
    outputs per chunk.

    The scratch (factors, per-chunk states, written values) is in the inputs' 16-bit dtype as the products
    that read it take 16-bit operands with fp32 accumulation (fp32 inputs keep it all in fp32); the state
    carried along the sequence and the log decays stay fp32.
    """
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    dev = q.device
    seqs = layout.cached("gated_delta.chunked_seqs", dev, lambda lay: _chunk_tables(lay)[0])
    chunks = layout.cached("gated_delta.chunks", dev, lambda lay: _chunk_tables(lay)[1])
    nc = chunks.shape[0]
    launch = launch or _chunk_launch(seqs.shape[0] * hv, dv, dev)
    dt = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.float32
    # fp32 inputs: 3xTF32 products on the tensor cores, as close to fp32 as these sums need (2^-22 relative
    # per product); ieee FMA products spill and take a minute to compile.
    precision = "tf32x3" if dt == torch.float32 else "tf32"
    kd = torch.empty(nc, hv, BT, dk, dtype=dt, device=dev)
    kend = torch.empty(nc, hv, BT, dk, dtype=dt, device=dev)
    w = torch.empty(nc, hv, BT, dv, dtype=dt, device=dev)
    cum = torch.empty(nc, hv, BT, dtype=torch.float32, device=dev)
    h = torch.empty(nc, hv, dk, dv, dtype=dt, device=dev)
    bk = _dot_width(dk)
    _chunk_wy_kernel[(nc, hv)](
        k,
        v,
        g,
        beta,
        chunks,
        kd,
        kend,
        w,
        cum,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        hv,
        hv // hk,
        dk,
        dv,
        BT=BT,
        BK=bk,
        BV=_dot_width(dv),
        BC=BC,
        DOT_PRECISION=precision,
        num_warps=launch.wy_warps,
    )
    bv = launch.state_bv
    _chunk_state_kernel[(triton.cdiv(dv, bv), seqs.shape[0] * hv)](
        kd,
        kend,
        w,
        cum,
        h,
        state,
        seqs,
        *state.stride(),
        hv,
        dk,
        dv,
        BT=BT,
        BK=bk,
        BV=bv,
        DOT_PRECISION=precision,
        num_warps=launch.state_warps,
        num_stages=launch.state_stages,
    )
    bv = launch.out_bv
    _chunk_out_kernel[(triton.cdiv(dv, bv), nc, hv)](
        q,
        k,
        w,
        cum,
        h,
        out,
        chunks,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        hv,
        hv // hk,
        dk,
        dv,
        dk**-0.5,
        BT=BT,
        BK=bk,
        BV=bv,
        DOT_PRECISION=precision,
        num_warps=launch.out_warps,
    )


def _launch_config(num_heads: int, dv: int, state_bytes: int = 4) -> tuple[int, int]:
    """(BV, num_warps) for `num_heads` (sequence, value head) pairs and states of `state_bytes` an element.

    Measured on an H200 at dk = dv = 128 (fp32 states, bf16 inputs): one warp per [128, 32] tile is the best
    or within 3% of it from 8 decodes up (about 3.4 TB/s at 256 decodes) and for 64-token prefills; with fewer
    programs than about two per SM, 4 warps per tile halve the time (one decode: 8 us against 16 us).
    bf16 states (`state_dtype="bfloat16"`), measured on an H100 only (`benchmarks/recurrent_tiles.py`): two
    warps per [128, 64] tile, 308 against 321 us at 256 decodes and 82 against 83 us at 64. That was before
    the kernel kept bf16 tiles as stored (sm_90: 241 registers and no spills at (64, 2), from 254 and 48
    bytes of stack; 128 at (32, 2) and (64, 4)); not measured since.
    """
    if state_bytes < 4 and num_heads * triton.cdiv(dv, 32) >= 264:
        return min(triton.next_power_of_2(dv), 64), 2
    bv = min(triton.next_power_of_2(dv), 32)
    return bv, 4 if num_heads * triton.cdiv(dv, bv) < 264 else 1


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: SeqLayout,
) -> torch.Tensor:
    """Drop-in for `reference.gated_delta_rule` (arguments: `engine.kernels.gated_delta_rule`): the same
    result and in-place state update."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    long_seqs = ()
    if layout.num_seqs and max(layout.query_lens) > MAX_RECURRENT:
        long_seqs = tuple(i for i, n in enumerate(layout.query_lens) if n > MAX_RECURRENT)
        if any(layout.keeps_states(i) for i in long_seqs):
            raise ValueError("per-position states are only kept for short (verify) steps")
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)

    seqs = layout.cached("gated_delta.recurrent_seqs", q.device, _seq_table)
    if seqs.shape[0]:
        use_state_out = layout.state_out is not None and any(layout.state_out)
        token_slots = (
            layout.cached("gated_delta.token_slots", q.device, _token_slots) if use_state_out else seqs
        )
        bk = triton.next_power_of_2(dk)
        bv, num_warps = _launch_config(seqs.shape[0] * hv, dv, state.element_size())
        grid = (seqs.shape[0] * hv, triton.cdiv(dv, bv))
        _recurrent_kernel[grid](
            q,
            k,
            v,
            g,
            beta,
            state,
            out,
            seqs,
            token_slots,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            g.stride(0),
            g.stride(1),
            beta.stride(0),
            beta.stride(1),
            *state.stride(),
            hv,
            hv // hk,
            dk,
            dv,
            dk**-0.5,
            BK=bk,
            BV=bv,
            USE_STATE_OUT=use_state_out,
            num_warps=num_warps,
            **pdl_launch(),
        )

    if long_seqs:
        if dispatch.prefill_kernels_enabled("gated_delta_rule", q=q):
            _chunked(q, k, v, g, beta, state, layout, out)
        else:
            _reference_long(q, k, v, g, beta, state, layout, long_seqs, out)
    return out


def _reference_long(q, k, v, g, beta, state, layout: SeqLayout, seqs: tuple[int, ...], out) -> None:
    """Long sequences one at a time through the reference's chunked (WY) form."""
    ratio = v.shape[1] // q.shape[1]
    for i in seqs:
        start, n = layout.cu_seqlens[i], layout.query_lens[i]
        sl = slice(start, start + n)
        qf = (reference.l2norm(q[sl].float()) * q.shape[-1] ** -0.5).repeat_interleave(ratio, dim=1)
        kf = reference.l2norm(k[sl].float()).repeat_interleave(ratio, dim=1)
        slot = layout.slots[i]
        s0 = state[slot].float() if layout.context_lens[i] > 0 else qf.new_zeros(state.shape[1:])
        o, s = reference.chunked(qf, kf, v[sl].float(), g[sl].float(), beta[sl].float(), s0)
        out[sl] = o.to(out.dtype)
        state[slot] = s.to(state.dtype)
