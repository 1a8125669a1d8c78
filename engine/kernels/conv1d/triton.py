"""Triton causal depthwise conv1d with per-slot rolling state, over a flat variable-length batch.

One program per (tile of up to BT new tokens of one sequence, channel block of BC). For each of the K taps
it loads the [BT, BC] inputs that tap sees: rows of x, or, before the sequence's first new token, the
slot's cached inputs (zeros when the sequence has no context). Only the first tile of a sequence reads
the slot, so only it writes the slot's new state (programs cannot order against one another); a verify
sequence (per-token states) always fits one tile.

A batch of short sequences beside long ones (decodes in a step that also prefills, as a server runs them)
takes two launches: the short ones with tiles of their own length and wide channel blocks, the long ones with
MAX_TILE-token tiles. One launch with MAX_TILE-token tiles for all would give each decoding sequence a tile of
one useful row in 32 over 8 times as many channel blocks: 474 us per layer on an H200 for 512 decodes beside
a 1,024-token prompt, against 15 us for the 512 decodes alone.
"""

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.conv1d import reference
from engine.kernels.layout import SeqLayout
from engine.kernels.pdl import pdl_launch, pdl_wait

# Tokens per tile for sequences longer than one tile; at least K - 1, so that only a sequence's first tile
# reaches back into the slot's cached inputs.
MAX_TILE = 32

# Bits of the flags column of the per-sequence table.
_HAS_CONTEXT, _KEEPS_STATES = 1, 2


@triton.jit
def _conv_kernel(
    x,  # [T, C]
    weight,  # [C, K]
    state,  # [S, C, K-1]
    out,  # [T, C], contiguous
    seqs,  # [N, 4] int32: start, length, slot, flags
    tiles,  # [P, 2] int32: sequence, first token of the tile within the sequence
    token_slots,  # [T] int32 slot for the state after each token, -1 for none (only read if USE_STATE_OUT)
    stride_xt,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    C,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BKM1: tl.constexpr,
    USE_SILU: tl.constexpr,
    USE_STATE_OUT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_p, i_c = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(tiles + i_p * 2 + 0)
    t0 = tl.load(tiles + i_p * 2 + 1)
    start = tl.load(seqs + i_n * 4 + 0).to(tl.int64)
    length = tl.load(seqs + i_n * 4 + 1)
    slot = tl.load(seqs + i_n * 4 + 2).to(tl.int64)
    flags = tl.load(seqs + i_n * 4 + 3)
    # Integer bounds, not scalar booleans (those do not mix with tensors in the interpreter):
    n_cached = (flags & 1) * (K - 1)  # cached inputs to read: none without context (the slot may be garbage)
    n_keep = ((flags >> 1) & 1) * length  # tokens whose state is written to their own slot
    n_final = (1 - ((flags >> 1) & 1)) * (t0 == 0).to(tl.int32) * (K - 1)  # final-state elements written here

    o_t = t0 + tl.arange(0, BT)  # [BT] positions within the sequence's new tokens
    o_c = i_c * BC + tl.arange(0, BC)  # [BC]
    m_t = o_t < length
    m_c = o_c < C
    x_seq = x + start * stride_xt
    s_slot = state + slot * stride_ss

    # Tap k of token p sees input p - (K-1) + k: a new token if >= 0, else cached input K-1 + that.
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(K):
        src = o_t - (K - 1) + k  # [BT]
        m_x = (m_t & (src >= 0))[:, None] & m_c[None, :]
        b_x = tl.load(x_seq + src[:, None] * stride_xt + o_c[None, :], mask=m_x, other=0.0)
        b_w = tl.load(weight + o_c * stride_wc + k * stride_wk, mask=m_c, other=0.0).to(tl.float32)
        acc += b_x.to(tl.float32) * b_w[None, :]
    if t0 < n_cached:  # only a sequence's first tile reaches back into the cached inputs
        for k in tl.static_range(K - 1):
            src_c = o_t - (K - 1) + k  # [BT]
            m_cp = (m_t & (src_c < 0))[:, None] & m_c[None, :]
            p_cp = s_slot + o_c[None, :] * stride_sc + (K - 1 + src_c)[:, None] * stride_sk
            b_cp = tl.load(p_cp, mask=m_cp, other=0.0)
            b_cw = tl.load(weight + o_c * stride_wc + k * stride_wk, mask=m_c, other=0.0).to(tl.float32)
            acc += b_cp.to(tl.float32) * b_cw[None, :]
    if USE_SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    p_out = out + (start + o_t)[:, None] * C + o_c[None, :]
    tl.store(p_out, acc.to(out.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])

    o_j = tl.arange(0, BKM1)  # [BKM1]
    m_j = o_j < K - 1
    if n_final > 0:
        # The state after the sequence: its last K-1 inputs, element j being input length - (K-1) + j.
        src_f = length - (K - 1) + o_j  # [BKM1]
        m_fx = m_c[:, None] & (m_j & (src_f >= 0))[None, :]  # [BC, BKM1]
        m_fp = m_c[:, None] & (m_j & (src_f < 0) & (src_f >= -n_cached))[None, :]
        b_fx = tl.load(x_seq + src_f[None, :] * stride_xt + o_c[:, None], mask=m_fx, other=0.0)
        p_fp = s_slot + o_c[:, None] * stride_sc + (K - 1 + src_f)[None, :] * stride_sk
        b_fp = tl.load(p_fp, mask=m_fp, other=0.0)
        b_last = tl.where((src_f >= 0)[None, :], b_fx.to(tl.float32).to(state.dtype.element_ty), b_fp)
        # Every read of the slot's old inputs, by any thread of this program, before it is overwritten.
        tl.debug_barrier()
        p_new = s_slot + o_c[:, None] * stride_sc + o_j[None, :] * stride_sk
        tl.store(p_new, b_last, mask=m_c[:, None] & m_j[None, :])
    if USE_STATE_OUT:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if n_keep > 0:
            # The state after token p, element j, is input p + 1 + j - (K-1).
            src_k = o_t[:, None, None] + 1 + o_j[None, None, :] - (K - 1)  # [BT, 1, BKM1]
            m_k = m_t[:, None, None] & m_c[None, :, None] & m_j[None, None, :]  # [BT, BC, BKM1]
            p_kx = x_seq + src_k * stride_xt + o_c[None, :, None]
            b_kx = tl.load(p_kx, mask=m_k & (src_k >= 0), other=0.0)
            p_kp = s_slot + o_c[None, :, None] * stride_sc + (K - 1 + src_k) * stride_sk
            b_kp = tl.load(p_kp, mask=m_k & (src_k < 0) & (src_k >= -n_cached), other=0.0)
            b_keep = tl.where(src_k >= 0, b_kx.to(tl.float32).to(state.dtype.element_ty), b_kp)
            dest = tl.load(token_slots + start + o_t, mask=m_t, other=-1).to(tl.int64)  # [BT]
            tl.debug_barrier()  # the home slot is usually among the destinations
            p_dest = state + dest[:, None, None] * stride_ss + o_c[None, :, None] * stride_sc
            p_dest += o_j[None, None, :] * stride_sk
            tl.store(p_dest, b_keep, mask=m_k & (dest >= 0)[:, None, None])


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, layout: SeqLayout, activation: bool = True
) -> torch.Tensor:
    # x [T, C]; weight [C, K]; state [S, C, K-1] holds each slot's last K-1 inputs, updated in place.
    t, c = x.shape
    k = weight.shape[1]
    for i in layout.long_seqs:
        if layout.keeps_states(i):
            raise ValueError("per-position states are only kept for short (verify) steps")
    if k - 1 > MAX_TILE:  # no such model; not tiled
        dispatch.fallback("causal_conv1d", f"kernel width over {MAX_TILE + 1} (not tiled)", weight=weight)
        return reference.causal_conv1d(x, weight, state, layout, activation)
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    use_state_out = layout.state_out is not None and any(layout.state_out)
    long = [n for n in layout.query_lens if n > MAX_TILE]
    short = [n for n in layout.query_lens if n <= MAX_TILE]
    # One tile per sequence for the short ones (decode, verify, short prefill); MAX_TILE tokens per tile else.
    groups = []
    if short:
        groups.append((triton.next_power_of_2(max(short)), "short" if long else "all"))
    if long:
        groups.append((MAX_TILE, "long" if short else "all"))
    for bt, which in groups:
        _launch(x, weight, state, out, layout, bt, which, activation, use_state_out)
    return out


def _launch(x, weight, state, out, layout: SeqLayout, bt: int, which: str, activation, use_state_out) -> None:
    """One launch over the tiles of `which` sequences ("all", "short", "long"), BT = `bt`."""
    c, k = x.shape[1], weight.shape[1]
    bkm1 = triton.next_power_of_2(max(k - 1, 1))
    budget = 8192 if use_state_out else 4096  # elements of the largest [BT, BC(, BKM1)] tile
    bc = min(triton.next_power_of_2(c), 1024, max(16, budget // (bt * (bkm1 if use_state_out else 1))))
    seqs, tiles, token_slots = _metadata(layout, bt, which, x.device)
    grid = (tiles.shape[0], triton.cdiv(c, bc))
    _conv_kernel[grid](
        x,
        weight,
        state,
        out,
        seqs,
        tiles,
        token_slots,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        c,
        K=k,
        BT=bt,
        BC=bc,
        BKM1=bkm1,
        USE_SILU=activation,
        USE_STATE_OUT=use_state_out,
        num_warps=4,
        **pdl_launch(),
    )


def _metadata(
    layout: SeqLayout, bt: int, which: str, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence table [N, 4], tile table [P, 2] of `which` sequences ("all", or those of at most / more
    than MAX_TILE new tokens) and per-token state slots [T], cached in the layout."""

    def build_seqs(layout: SeqLayout) -> torch.Tensor:
        rows = []
        for i in range(layout.num_seqs):
            flags = (_HAS_CONTEXT if layout.context_lens[i] > 0 else 0) | (
                _KEEPS_STATES if layout.keeps_states(i) else 0
            )
            rows.append((layout.cu_seqlens[i], layout.query_lens[i], layout.slots[i], flags))
        return torch.tensor(rows, dtype=torch.int32)

    def build_tiles(layout: SeqLayout) -> torch.Tensor:
        wanted = {"all": lambda n: True, "short": lambda n: n <= MAX_TILE, "long": lambda n: n > MAX_TILE}
        keep = wanted[which]
        rows = [(i, s) for i, n in enumerate(layout.query_lens) if keep(n) for s in range(0, n, bt)]
        return torch.tensor(rows, dtype=torch.int32)

    def build_token_slots(layout: SeqLayout) -> torch.Tensor:
        slots = []
        for i, n in enumerate(layout.query_lens):
            slots += list(layout.state_out[i]) if layout.keeps_states(i) else [-1] * n
        return torch.tensor(slots, dtype=torch.int32)

    seqs = layout.cached("conv1d_seqs", device, build_seqs)
    tiles = layout.cached(("conv1d_tiles", bt, which), device, build_tiles)
    if layout.state_out is None:
        return seqs, tiles, seqs  # never read: USE_STATE_OUT is off
    return seqs, tiles, layout.cached("conv1d_token_slots", device, build_token_slots)
