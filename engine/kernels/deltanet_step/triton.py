"""Triton fused DeltaNet step: conv + SiLU, gates, l2 norm, gated delta rule and gated RMSNorm in one launch,
for short sequences (decode, MTP verify), with the unfused kernels' roundings.

One program per (sequence, value head, dv tile): V_SPLITS tiles of BV = next_pow2(dv) / V_SPLITS state
columns. The delta rule keeps the columns of the state apart: column v of S evolves with q, k, beta, g and
v[v] only (S <- g S + beta k (v - S^T k)^T, o = S^T q, column by column), so a tile needs its v channels and
the head's whole q and k. A program computes, for all of the sequence's (at most SHORT_QUERY) new tokens at
once, the conv of its key head's q and k channels (every tile of every value head of the key head computes
them again: dk values a token) and of its own v channels from the slot's cached inputs and the new rows, beta
and the log decay, and the l2 norms; then, token by token, the delta rule on its fp32 state tile [dk, BV],
held in registers across the tokens. The states after each token go to its destination: its `state_out`
slot, or the home slot after the last token.

The gated RMSNorm needs the whole dv row of each token's output. Unsplit (V_SPLITS = 1) the program holds it
and norms it token by token. Split, each program stores its tile of the un-normalised row, rounded to the
output's dtype as the unfused delta rule stores it, into `out` itself; then, once a barrier has passed in all
its threads, adds one to its (sequence, value head) row counter (acq_rel). The program that finds
V_SPLITS - 1 there is the last of the head's tiles: every other one stored its tiles before its increment
(release), and this program's increment reads theirs (acquire), so it sees every tile; it resets the counter
for the next launch, reads the sequence's rows back, norms them whole and overwrites them. No program waits
on another, and no other program touches those rows after its increment. Triton issues a scalar atomic from
one thread (sm_90 PTX: `atom.global.gpu.acq_rel`) and broadcasts its result through shared memory between
two CTA barriers: the barrier before it orders every thread's stores before the release (which is
cumulative), the one after it orders the acquire before every thread's loads. The q/k counter below works the
same way, ordering reads before writes.

At dk = dv = 128, unsplit: 8 warps, 64 state registers a thread; for sm_90 ptxas a decode (BT = 1) takes 178
registers without spills, a verify step (BT = 2..8) the 255 cap with 30-90 bytes of spills (16 warps: 128
registers, no spills up to BT = 2, 170-240 bytes at BT = 4, 8). Split programs keep the 8 warps
(`_num_warps`). Batch 1 of Qwen3.5-35B-A3B has 32 (sequence, value head) programs for 132 SMs:
the split gives it 4 times as many (see `_v_splits`).

Conv states. A program reads and writes its own v channels' and no other program touches them. The q and k
channels of a key head are read by the RATIO * V_SPLITS programs of its value heads' tiles and must be written
by one, after all of them have read: programs of a launch run in no order, so a program that wrote the home
slot as soon as it had read it could overwrite the inputs under another that has not started yet (a decode
reads and writes the same slot, a verify step usually ends there). So each program, once its conv is computed
and a barrier has passed in all its threads, adds one to its key head's counter (acq_rel); the program that
finds RATIO * V_SPLITS - 1 there is the last reader (every other one read before its increment), resets the
counter for the next launch (the layers of a step share it) and writes the q/k states.
"""

import functools

import torch
import triton
import triton.language as tl

from engine.env import engine_env
from engine.kernels.layout import SHORT_QUERY, SeqLayout
from engine.kernels.pdl import pdl_launch, pdl_wait

# The dv split (`_v_splits`): split while the grid has fewer than this many programs per SM, into at most
# this many tiles. ENCLAVE_DELTANET_V_SPLITS=1|2|4|8 overrides the choice (benchmarks, bisecting).
_PROGRAMS_PER_SM = 1
_MAX_V_SPLITS = 4
# SMs counted on a CPU: few, so that the interpreter tests' few heads take the split.
_CPU_SMS = 4


@triton.jit
def _conv_silu(
    x_seq,  # row 0 of the sequence's new inputs
    c_slot,  # the slot's cached inputs [C, K-1]
    weight,  # [C, K]
    o_c,  # [BC] channels
    m_c,
    o_t,  # [BT] new tokens
    m_t,
    n_cached,  # cached inputs to read: 0 without context (the slot may hold garbage), else K-1
    stride_xt,
    stride_wc,
    stride_wk,
    stride_cc,
    stride_ck,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """[BT, BC] fp32 SiLU(causal conv), rounded to the inputs' dtype as the unfused conv stores it."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(K):
        src = o_t - (K - 1) + k  # [BT] tap k of token p sees input p - (K-1) + k, cached ones below 0
        m_x = (m_t & (src >= 0))[:, None] & m_c[None, :]
        b_x = tl.load(x_seq + src[:, None] * stride_xt + o_c[None, :], mask=m_x, other=0.0)
        m_p = (m_t & (src < 0) & (src >= -n_cached))[:, None] & m_c[None, :]
        p_p = c_slot + o_c[None, :] * stride_cc + (K - 1 + src)[:, None] * stride_ck
        b_p = tl.load(p_p, mask=m_p, other=0.0)
        b_w = tl.load(weight + o_c * stride_wc + k * stride_wk, mask=m_c, other=0.0).to(tl.float32)
        acc += (b_x.to(tl.float32) + b_p.to(tl.float32)) * b_w[None, :]
    acc = acc / (1.0 + tl.exp(-acc))
    return acc.to(x_seq.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_conv_states(
    x_seq,
    c_slot,
    conv_state,  # [S, C, K-1]
    dest,  # [BT] int64 slot for the state after each token, -1 for none
    o_c,  # [BC] channels
    m_c,
    o_t,  # [BT]
    m_t,
    n_cached,
    stride_xt,
    stride_cs,
    stride_cc,
    stride_ck,
    K: tl.constexpr,
    BKM1: tl.constexpr,
):
    """The conv states after the tokens that have a destination: element j of token p's is input
    p + 1 + j - (K-1)."""
    o_j = tl.arange(0, BKM1)
    src = o_t[:, None, None] + 1 + o_j[None, None, :] - (K - 1)  # [BT, 1, BKM1]
    m = (m_t & (dest >= 0))[:, None, None] & m_c[None, :, None] & (o_j < K - 1)[None, None, :]
    b_x = tl.load(x_seq + src * stride_xt + o_c[None, :, None], mask=m & (src >= 0), other=0.0)
    p_p = c_slot + o_c[None, :, None] * stride_cc + (K - 1 + src) * stride_ck
    b_p = tl.load(p_p, mask=m & (src < 0) & (src >= -n_cached), other=0.0)
    b_new = tl.where(src >= 0, b_x.to(tl.float32).to(conv_state.dtype.element_ty), b_p)  # [BT, BC, BKM1]
    tl.debug_barrier()  # every thread's reads of the slot's old inputs before any write (the home slot)
    p_d = conv_state + tl.maximum(dest, 0)[:, None, None] * stride_cs + o_c[None, :, None] * stride_cc
    tl.store(p_d + o_j[None, None, :] * stride_ck, b_new, mask=m)


@triton.jit
def _norm_rows(
    o_seq,  # the sequence's first output row, at its value head's columns: un-normalised, normalised in place
    z_seq,  # the same in z
    weight,  # [DV]
    o_t,  # [BT] new tokens
    m_t,
    stride_ot,
    stride_zt,
    DV,
    eps,
    BDV: tl.constexpr,
    IS_ROUNDED_PRODUCT: tl.constexpr,
):
    """The gated RMSNorm of a value head's [BT, DV] output rows, in place, as the unsplit loop rounds it."""
    dt = o_seq.dtype.element_ty
    o_d = tl.arange(0, BDV)
    m_d = o_d < DV
    m = m_t[:, None] & m_d[None, :]
    p_o = o_seq + o_t[:, None] * stride_ot + o_d[None, :]
    b_o = tl.load(p_o, mask=m, other=0.0).to(tl.float32)  # [BT, BDV]
    b_z = tl.load(z_seq + o_t[:, None] * stride_zt + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BDV]
    rms = tl.rsqrt(tl.sum(b_o * b_o, axis=1) / DV + eps)  # [BT]
    y = (b_o * rms[:, None]).to(dt).to(tl.float32) * b_w[None, :]
    if IS_ROUNDED_PRODUCT:
        y = y.to(dt).to(tl.float32)
    y = y * (b_z / (1.0 + tl.exp(-b_z)))
    tl.store(p_o, y.to(dt), mask=m)


# stride_ck is not specialised (to 1): the compiler then lays the [BT, .] conv tiles out by channel, not by
# tap, and holds fewer copies of the state in the verify loop (sm_90 ptxas: 36 against 448 bytes of spills at
# BT = 8).
@triton.jit(do_not_specialize=["stride_ck"])
def _deltanet_step_kernel(
    qkv,  # [T, C] pre-conv [q | k | v], C = 2 * KEY_DIM + HV * DV
    z,  # [T, HV * DV]
    a,  # [T, HV]
    b,  # [T, HV]
    conv_weight,  # [C, K]
    conv_state,  # [S, C, K-1]
    a_log,  # [HV]
    dt_bias,  # [HV]
    state,  # [S, HV, DK, DV] fp32, or bf16 (`state_dtype`; rounded after every token)
    norm_weight,  # [DV]
    out,  # [T, HV * DV], contiguous
    seqs,  # [N, 4] int32: start, length, slot, has context
    dests,  # [T] int32: slot for the states after each token, -1 for none
    counters,  # [N * HV // RATIO + N * HV] int32: (sequence, key head)'s, then (sequence, value head)'s
    stride_xt,
    stride_zt,
    stride_at,
    stride_bt,
    stride_wc,
    stride_wk,
    stride_cs,
    stride_cc,
    stride_ck,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    HV,
    RATIO,
    KEY_DIM,
    DK,
    DV,
    scale,
    eps,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,  # state columns of a program: BDV / V_SPLITS
    BDV: tl.constexpr,  # next_pow2(DV)
    BKM1: tl.constexpr,
    V_SPLITS: tl.constexpr,
    SHARED_QK: tl.constexpr,  # RATIO * V_SPLITS > 1: several programs read a key head's q/k conv inputs
    IS_ROUNDED_PRODUCT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1) if V_SPLITS > 1 else 0  # the dv tile
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // RATIO  # value head j reads key head j // (Hv // Hk)
    start = tl.load(seqs + i_n * 4 + 0).to(tl.int64)
    length = tl.load(seqs + i_n * 4 + 1)
    slot = tl.load(seqs + i_n * 4 + 2).to(tl.int64)
    has_context = tl.load(seqs + i_n * 4 + 3)
    dt = out.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)  # this program's state columns
    m_t = o_t < length
    m_k = o_k < DK
    m_v = o_v < DV
    tok = start + o_t  # [BT]

    # The state first, the longest load. Without context it starts from zeros (the slot may hold garbage);
    # scalar conditions enter masks as row bounds (the interpreter rejects `tensor & scalar`).
    p_s = state + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv  # [BK, BV]
    b_s = tl.load(p_s + slot * stride_ss, mask=(o_k[:, None] < has_context * DK) & m_v[None, :], other=0.0)
    b_s = b_s.to(tl.float32)

    # Gates, as deltanet_gate: beta rounded to b's dtype, the log decay in fp32 (softplus stable for
    # large and tiny arguments, passing through above 20 as torch's does).
    b_a = tl.load(a + tok * stride_at + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    b_b = tl.load(b + tok * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_x = b_a + tl.load(dt_bias + i_h).to(tl.float32)
    u = tl.exp(-tl.abs(b_x))
    w = 1.0 + u
    tiny = w == 1.0
    log1p = tl.where(tiny, u, tl.log(w) * (u / tl.where(tiny, 1.0, w - 1.0)))
    softplus = tl.where(b_x > 20.0, b_x, tl.maximum(b_x, 0.0) + log1p)
    b_g = -tl.exp(tl.load(a_log + i_h).to(tl.float32)) * softplus  # [BT]
    b_beta = (1.0 / (1.0 + tl.exp(-b_b))).to(b.dtype.element_ty).to(tl.float32)  # [BT]
    if V_SPLITS == 1:
        p_z = z + tok[:, None] * stride_zt + i_h * DV + o_v[None, :]
        b_z = tl.load(p_z, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        b_nw = tl.load(norm_weight + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    dest = tl.load(dests + tok, mask=m_t, other=-1).to(tl.int64)  # [BT]

    x_seq = qkv + start * stride_xt
    c_slot = conv_state + slot * stride_cs
    n_cached = has_context * (K - 1)
    c_q = i_hk * DK + o_k  # [BK] channels of the key head's q; its k ones are KEY_DIM further
    c_v = 2 * KEY_DIM + i_h * DV + o_v  # [BV]
    b_q = _conv_silu(  # [BT, BK]
        x_seq, c_slot, conv_weight, c_q, m_k, o_t, m_t, n_cached,
        stride_xt, stride_wc, stride_wk, stride_cc, stride_ck, K, BT, BK,
    )  # fmt: skip
    b_k = _conv_silu(  # [BT, BK]
        x_seq, c_slot, conv_weight, KEY_DIM + c_q, m_k, o_t, m_t, n_cached,
        stride_xt, stride_wc, stride_wk, stride_cc, stride_ck, K, BT, BK,
    )  # fmt: skip
    b_v = _conv_silu(  # [BT, BV]
        x_seq, c_slot, conv_weight, c_v, m_v, o_t, m_t, n_cached,
        stride_xt, stride_wc, stride_wk, stride_cc, stride_ck, K, BT, BV,
    )  # fmt: skip
    # l2 norm with reference.l2norm's eps; q also takes the 1/sqrt(dk) scale.
    b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6) * scale)[:, None]
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]

    _store_conv_states(
        x_seq, c_slot, conv_state, dest, c_v, m_v, o_t, m_t, n_cached,
        stride_xt, stride_cs, stride_cc, stride_ck, K, BKM1,
    )  # fmt: skip
    if SHARED_QK:
        # The key head's other programs may still have to read the q/k inputs: the last reader writes them.
        tl.debug_barrier()  # this program's reads are all done
        p_count = counters + i_n * (HV // RATIO) + i_hk
        last = tl.atomic_add(p_count, 1, sem="acq_rel") == RATIO * V_SPLITS - 1
    else:
        last = True
    if last:
        if SHARED_QK:
            tl.store(p_count, 0)
        _store_conv_states(
            x_seq, c_slot, conv_state, dest, c_q, m_k, o_t, m_t, n_cached,
            stride_xt, stride_cs, stride_cc, stride_ck, K, BKM1,
        )  # fmt: skip
        _store_conv_states(
            x_seq, c_slot, conv_state, dest, KEY_DIM + c_q, m_k, o_t, m_t, n_cached,
            stride_xt, stride_cs, stride_cc, stride_ck, K, BKM1,
        )  # fmt: skip

    # Token by token: the delta rule, then the gated RMSNorm of the token's output row, as rounded to the
    # inputs' dtype: norm, * weight (rounded when the weight has that dtype, as torch's product is),
    # * silu(z); unsplit here, the row whole in this program, split after the loop. Each token's row is
    # picked out of the [BT, ...] tiles.
    for t in range(0, length):
        sel = o_t == t
        q_t = tl.sum(tl.where(sel[:, None], b_q, 0.0), axis=0)  # [BK]
        k_t = tl.sum(tl.where(sel[:, None], b_k, 0.0), axis=0)  # [BK]
        v_t = tl.sum(tl.where(sel[:, None], b_v, 0.0), axis=0)  # [BV]
        if V_SPLITS == 1:
            z_t = tl.sum(tl.where(sel[:, None], b_z, 0.0), axis=0)  # [BV]
        b_s = b_s * tl.exp(tl.sum(tl.where(sel, b_g, 0.0)))
        delta = tl.sum(tl.where(sel, b_beta, 0.0)) * (v_t - tl.sum(b_s * k_t[:, None], axis=0))  # [BV]
        # The state as stored (a no-op for fp32 states): a verify step's later tokens see what a decode
        # step would read back, so speculation leaves greedy output unchanged.
        b_s = (b_s + k_t[:, None] * delta[None, :]).to(state.dtype.element_ty).to(tl.float32)
        d_t = tl.sum(tl.where(sel, dest, 0))
        m_w = (o_k[:, None] < tl.where(d_t >= 0, DK, 0)) & m_v[None, :]
        tl.store(p_s + tl.maximum(d_t, 0) * stride_ss, b_s, mask=m_w)

        b_o = tl.sum(b_s * q_t[:, None], axis=0).to(dt).to(tl.float32)  # [BV]
        if V_SPLITS == 1:
            y = (b_o * tl.rsqrt(tl.sum(b_o * b_o) / DV + eps)).to(dt).to(tl.float32) * b_nw
            if IS_ROUNDED_PRODUCT:
                y = y.to(dt).to(tl.float32)
            y = y * (z_t / (1.0 + tl.exp(-z_t)))
            tl.store(out + (start + t) * (HV * DV) + i_h * DV + o_v, y.to(dt), mask=m_v)
        else:  # the un-normalised tile, for the head's last program
            tl.store(out + (start + t) * (HV * DV) + i_h * DV + o_v, b_o.to(dt), mask=m_v)

    if V_SPLITS > 1:
        tl.debug_barrier()  # every thread's tiles stored before the increment releases them
        p_row = counters + tl.num_programs(0) // RATIO + i_nh  # after the N * HV // RATIO key heads'
        if tl.atomic_add(p_row, 1, sem="acq_rel") == V_SPLITS - 1:
            tl.store(p_row, 0)
            _norm_rows(
                out + start * (HV * DV) + i_h * DV, z + start * stride_zt + i_h * DV, norm_weight, o_t, m_t,
                HV * DV, stride_zt, DV, eps, BDV, IS_ROUNDED_PRODUCT,
            )  # fmt: skip


def _seq_table(layout: SeqLayout) -> torch.Tensor:
    """[N, 4] int32: start, length, slot, has context."""
    rows = [
        (layout.cu_seqlens[i], n, layout.slots[i], int(c > 0))
        for i, (n, c) in enumerate(zip(layout.query_lens, layout.context_lens, strict=True))
    ]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)


def _token_dests(layout: SeqLayout) -> torch.Tensor:
    """[T] int32: where the states after each token go: its `state_out` slot where the sequence keeps
    per-token states, else the home slot after the last token; -1 for none."""
    dests: list[int] = []
    for i, n in enumerate(layout.query_lens):
        dests += layout.state_out[i] if layout.keeps_states(i) else [-1] * (n - 1) + [layout.slots[i]]
    return torch.tensor(dests, dtype=torch.int32)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def deltanet_step(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    layout: SeqLayout,
    *,
    v_splits: int | None = None,
) -> torch.Tensor:
    """Drop-in for `reference.deltanet_step` (arguments: `engine.kernels.deltanet_step`); `v_splits` dv
    tiles per value head (a power of two), else `_v_splits`'s choice."""
    t, c = qkv.shape
    hv, dk, dv = recurrent_state.shape[1:]
    key_dim = (c - hv * dv) // 2
    hk = key_dim // dk
    if max(layout.query_lens, default=0) > SHORT_QUERY:
        raise ValueError(f"the fused DeltaNet step takes sequences of at most {SHORT_QUERY} new tokens")
    out = torch.empty((t, hv * dv), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return out
    qkv, z, a, b = (_last_dim_contiguous(x) for x in (qkv, z, a, b))
    dev = qkv.device
    seqs = layout.cached("deltanet_step.seqs", dev, _seq_table)
    dests = layout.cached("deltanet_step.dests", dev, _token_dests)
    bk, bdv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    if v_splits is None:
        sms = _num_sms(dev.index or 0) if dev.type == "cuda" else _CPU_SMS
        splits = _v_splits(layout.num_seqs * hv, bdv, sms)
    else:
        splits = _checked_splits(v_splits, bdv)
    shared = hv // hk * splits > 1
    if shared or splits > 1:
        # Zero at allocation; every launch leaves them zero (the last program of each resets its counter),
        # so a CUDA graph's replays and the layers of a step share them without a memset.
        counters = layout.cached(
            ("deltanet_step.counters", hk, hv),
            dev,
            lambda lay: torch.zeros(lay.num_seqs * (hk + hv), dtype=torch.int32),
        )
    else:
        counters = seqs  # never touched
    k = conv_weight.shape[1]
    bv = bdv // splits
    _deltanet_step_kernel[(layout.num_seqs * hv, splits)](
        qkv,
        z,
        a,
        b,
        conv_weight,
        conv_state,
        a_log,
        dt_bias,
        recurrent_state,
        norm_weight,
        out,
        seqs,
        dests,
        counters,
        qkv.stride(0),
        z.stride(0),
        a.stride(0),
        b.stride(0),
        *conv_weight.stride(),
        *conv_state.stride(),
        *recurrent_state.stride(),
        hv,
        hv // hk,
        key_dim,
        dk,
        dv,
        dk**-0.5,
        eps,
        K=k,
        BT=triton.next_power_of_2(max(layout.query_lens)),
        BK=bk,
        BV=bv,
        BDV=bdv,
        BKM1=triton.next_power_of_2(max(k - 1, 1)),
        V_SPLITS=splits,
        SHARED_QK=shared,
        # The reference's `weight * normed` is rounded to the dtype only when the weight has it too.
        IS_ROUNDED_PRODUCT=norm_weight.dtype == qkv.dtype and qkv.dtype != torch.float32,
        num_warps=_num_warps(bk, bdv),
        **pdl_launch(),
    )
    return out


def _num_warps(bk: int, bdv: int) -> int:
    """Warps of one program: 8 at dk = dv = 128, where an unsplit program holds its [dk, dv] fp32 state in
    registers, 64 elements a thread. Split programs keep them: their q/k conv tiles and rows do not shrink,
    and at 8 warps sm_90 ptxas fits 2, 4 and 8 tiles without spills (decode: 128, 94, 68 registers; verify
    up to BT = 8 too, but for 8 bytes at 2 tiles), where 4, 2 and 1 warp (64 state elements a thread
    again) take up to 255 registers and spill up to 470 bytes."""
    return max(1, min(8, bk * bdv // 2048))


def _v_splits(num_programs: int, bdv: int, sms: int) -> int:
    """dv tiles per value head. Unsplit, a program runs a long dependent chain (loads, conv, norms, then the
    rule token by token) on little data: 64 KB of state in, 64 KB out at dk = dv = 128, about 1-2 us of an
    H200's bandwidth against 9.7 us measured at batch 1, where 32 programs leave 100 of 132 SMs idle. So
    while the grid has fewer than _PROGRAMS_PER_SM programs per SM, double the tiles, up to _MAX_V_SPLITS:
    Qwen3.5-35B-A3B (Hv 32) on an H200 splits 4 ways at batch 1-2, 2 ways at 3-4, not from 5 sequences on.
    Measured (2026-11-30, one graphed DeltaNet layer without its MoE, us, splits 1 / 2 / 4): batch 1 46.3 /
    45.4 / 44.7; batch 4 51.2 / 51.3 / 55.0; batch 8 63.8 / 62.9 / 69.9. The cost of a split: each tile
    computes its key head's q/k conv and norms again, and the head's last program
    reads its rows back for the norm. ENCLAVE_DELTANET_V_SPLITS overrides (1, 2, 4, 8)."""
    forced = engine_env().deltanet_v_splits
    if forced is not None:
        return _checked_splits(forced, bdv)
    splits = 1
    while num_programs * splits < _PROGRAMS_PER_SM * sms and splits < min(_MAX_V_SPLITS, bdv):
        splits *= 2
    return splits


def _checked_splits(splits: int, bdv: int) -> int:
    if splits < 1 or splits & (splits - 1) or splits > bdv:
        raise ValueError(
            f"deltanet_step: {splits} dv tiles do not divide a {bdv}-wide state tile; "
            f"set ENCLAVE_DELTANET_V_SPLITS (or v_splits) to a power of two up to {bdv}"
        )
    return splits


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
