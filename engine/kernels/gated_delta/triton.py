"""Triton gated delta rule: a fused token-by-token recurrence for short sequences (decode, MTP verify, short
prefills), the reference's chunked (WY) form for longer ones.

One program per (sequence, value head, dv tile) keeps its fp32 state tile [dk, BV] in registers for all of
the sequence's new tokens, so each state element is read once and written once per step (or once per token
when the layout keeps per-token states for the verify step).
"""

import torch
import triton
import triton.language as tl

from engine.kernels.gated_delta import reference
from engine.kernels.layout import SeqLayout

# Sequences adding at most this many tokens run in the recurrent kernel. Longer ones fall back to the
# reference's chunked path, one sequence at a time: a chunked Triton kernel is future work.
MAX_RECURRENT = 64

# Bits of the flags column of the per-sequence table.
_HAS_CONTEXT, _KEEPS_STATES = 1, 2


@triton.jit
def _recurrent_kernel(
    q,  # [T, Hk, dk]
    k,  # [T, Hk, dk]
    v,  # [T, Hv, dv]
    g,  # [T, Hv] fp32 log decay
    beta,  # [T, Hv]
    state,  # [S, Hv, dk, dv] fp32
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
):
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
    b_s = tl.load(p_s + slot * stride_ss, mask=m_read, other=0.0).to(tl.float32)

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

        b_s = b_s * tl.exp(b_g)
        b_delta = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))  # [BV]
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(out + (tok * HV + i_h) * DV + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
        if USE_STATE_OUT:
            out_slot = tl.load(token_slots + tok).to(tl.int64)
            m_out = (o_k[:, None] < tl.where(out_slot >= 0, DK, 0)) & m_v[None, :]
            tl.store(p_s + tl.maximum(out_slot, 0) * stride_ss, b_s, mask=m_out)

    # A sequence keeping per-token states (flag bit 2) leaves its home slot alone unless state_out names it.
    m_home = (o_k[:, None] < tl.where((flags & 2) == 0, DK, 0)) & m_v[None, :]
    tl.store(p_s + slot * stride_ss, b_s, mask=m_home)


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


def _launch_config(num_heads: int, dv: int) -> tuple[int, int]:
    """(BV, num_warps) for `num_heads` (sequence, value head) pairs.

    Measured on an H200 at dk = dv = 128 (state traffic, bf16 inputs): one warp per [128, 32] tile is the best
    or within 3% of it from 8 decodes up (about 3.4 TB/s at 256 decodes) and for 64-token prefills; with fewer
    programs than about two per SM, 4 warps per tile halve the time (one decode: 8 us against 16 us).
    """
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
    """Drop-in for `reference.gated_delta_rule`: the same arguments, result and in-place state update.

    Args:
        q, k: [T, Hk, dk] raw queries and keys; l2-normalised (and q scaled by dk^-0.5) inside.
        v: [T, Hv, dv] values; value head j uses key head j // (Hv // Hk).
        g: [T, Hv] log decay (<= 0), fp32.
        beta: [T, Hv] write strength in (0, 1).
        state: [S, Hv, dk, dv] fp32 recurrent state per slot, updated in place.
        layout: where each sequence's tokens and slot are.
    Returns:
        [T, Hv, dv] in v's dtype.
    """
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    long_seqs = ()
    if layout.num_seqs and max(layout.query_lens) > MAX_RECURRENT:
        long_seqs = tuple(i for i, n in enumerate(layout.query_lens) if n > MAX_RECURRENT)
        if any(layout.keeps_states(i) for i in long_seqs):
            raise ValueError("per-position states are only kept for short (verify) steps")
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)

    seqs = layout._cached("gated_delta.recurrent_seqs", q.device, lambda: _seq_table(layout))
    if seqs.shape[0]:
        use_state_out = layout.state_out is not None and any(layout.state_out)
        token_slots = (
            layout._cached("gated_delta.token_slots", q.device, lambda: _token_slots(layout))
            if use_state_out
            else seqs
        )
        bk = triton.next_power_of_2(dk)
        bv, num_warps = _launch_config(seqs.shape[0] * hv, dv)
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
        )

    for i in long_seqs:
        start, n = layout.cu_seqlens[i], layout.query_lens[i]
        sl = slice(start, start + n)
        one = SeqLayout((n,), (layout.context_lens[i],), (layout.slots[i],))
        out[sl] = reference.gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], state, one)
    return out
