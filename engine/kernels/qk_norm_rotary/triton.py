"""Triton q/k RMSNorm + partial rotary: one launch for the query and key heads of a batch.

Programs (token, block of BH heads) cover the query heads' blocks first, then the key heads'. Each loads its
heads' [BH, BD] channels and, for the first rd of them, their rotate-half partners (channel j +- rd/2),
normalises both with the row's fp32 rstd and their own weights, rounds them to the input dtype (where the
reference's norm ends), and rotates them with the rotary reference's rounding: cos/sin cast to the dtype,
each product rounded, then their sum.

`qk_norm_rotary_store` writes the keys straight into a paged cache in the model's dtype, at each token's
flat cache row, and has more programs after the keys' that copy the values there: the two index writes the
attention op would otherwise launch before attending (non-PDL torch kernels, 20 per decode step of
Qwen3.5-35B-A3B) are gone.
"""

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.pdl import pdl_launch, pdl_wait
from engine.kernels.qk_norm_rotary import in_turn, reference

# Heads of more channels than this take the reference (no such model).
MAX_DIM = 4096
# Elements of one program's [BH, BD] tile: at head dim 256, 4 heads, so a decode step still spreads over
# several programs per token.
TILE = 1024


@triton.jit
def _norm_rotary_heads(
    x,  # [T, H, D], last dim contiguous
    weight,  # [D]
    cos,  # [T, RD]
    sin,  # [T, RD]
    out,  # [rows, H, D], contiguous
    i_t,
    o_row,  # the output row of token i_t: i_t, or its cache row
    i_b,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    H,
    D,
    RD,
    eps,
    BH: tl.constexpr,
    BD: tl.constexpr,
):
    o_h = i_b * BH + tl.arange(0, BH)  # [BH]
    o_d = tl.arange(0, BD)  # [BD]
    half = RD // 2
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    m_rot = o_d < RD
    # rotate_half(x)[j] = -x[j + rd/2] for j < rd/2, x[j - rd/2] for rd/2 <= j < rd.
    partner = tl.where(o_d < half, o_d + half, o_d - half)
    sign = tl.where(o_d < half, -1.0, 1.0)

    p_x = x + i_t * stride_xt + o_h[:, None] * stride_xh  # [BH, 1]
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0)  # [BH, BD]
    b_y = tl.load(p_x + partner[None, :], mask=m & m_rot[None, :], other=0.0)
    dt = b_x.dtype
    xf = b_x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]  # [BH, 1]
    w_x = 1.0 + tl.load(weight + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    w_y = 1.0 + tl.load(weight + partner, mask=m_rot, other=0.0).to(tl.float32)
    n_x = (xf * rstd * w_x[None, :]).to(dt)
    n_y = (b_y.to(tl.float32) * rstd * w_y[None, :]).to(dt)

    b_cos = tl.load(cos + i_t * stride_ct + o_d * stride_cd, mask=m_rot, other=0.0).to(dt).to(tl.float32)
    b_sin = tl.load(sin + i_t * stride_st + o_d * stride_sd, mask=m_rot, other=0.0).to(dt).to(tl.float32)
    a = (n_x.to(tl.float32) * b_cos[None, :]).to(dt)
    b = (n_y.to(tl.float32) * (sign * b_sin)[None, :]).to(dt)
    rotated = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
    b_out = tl.where(m_rot[None, :], rotated, n_x)
    p_out = out + (o_row * H + o_h)[:, None] * D + o_d[None, :]
    tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m)


@triton.jit
def _copy_heads(x, out, i_t, o_row, i_b, stride_xt, stride_xh, H, D, BH: tl.constexpr, BD: tl.constexpr):
    """Heads [BH, BD] of x's token i_t to row o_row of out [rows, H, D] (contiguous), unchanged."""
    o_h = i_b * BH + tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + i_t * stride_xt + o_h[:, None] * stride_xh + o_d[None, :], mask=m, other=0.0)
    tl.store(out + (o_row * H + o_h)[:, None] * D + o_d[None, :], b_x.to(out.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_rotary_kernel(
    q,  # [T, HQ, D], last dim contiguous
    k,  # [T, HKV, D], last dim contiguous
    q_weight,  # [D]
    k_weight,  # [D]
    cos,  # [T, RD] fp32
    sin,  # [T, RD] fp32
    q_out,  # [T, HQ, D], contiguous
    k_out,  # [T, HKV, D], contiguous; with STORE the key cache [rows, HKV, D]
    v,  # with STORE: [T, HKV, D] values, last dim contiguous
    v_out,  # with STORE: the value cache [rows, HKV, D]
    slots,  # with STORE: [T] int64 cache row of each token
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    HQ,
    HKV,
    D,
    RD,
    eps,
    BH: tl.constexpr,
    BD: tl.constexpr,
    STORE: tl.constexpr = False,  # keys to their cache rows, and the values copied there
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_t, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    q_blocks = tl.cdiv(HQ, BH)
    kv_blocks = tl.cdiv(HKV, BH)
    o_row = i_t
    if STORE:
        o_row = tl.load(slots + i_t)
    if i_b < q_blocks:
        _norm_rotary_heads(
            q,
            q_weight,
            cos,
            sin,
            q_out,
            i_t,
            i_t,
            i_b,
            stride_qt,
            stride_qh,
            stride_ct,
            stride_cd,
            stride_st,
            stride_sd,
            HQ,
            D,
            RD,
            eps,
            BH,
            BD,
        )
    elif i_b < q_blocks + kv_blocks:
        _norm_rotary_heads(
            k,
            k_weight,
            cos,
            sin,
            k_out,
            i_t,
            o_row,
            i_b - q_blocks,
            stride_kt,
            stride_kh,
            stride_ct,
            stride_cd,
            stride_st,
            stride_sd,
            HKV,
            D,
            RD,
            eps,
            BH,
            BD,
        )
    elif STORE:
        _copy_heads(v, v_out, i_t, o_row, i_b - q_blocks - kv_blocks, stride_vt, stride_vh, HKV, D, BH, BD)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # q [T, Hq, D], k [T, Hkv, D] (strided views), weights [D], cos/sin [T, rd] with rd <= D.
    t, d = q.shape[0], q.shape[2]
    if d > MAX_DIM:
        dispatch.fallback("qk_norm_rotary", f"head dim over {MAX_DIM}", q=q)
        return reference.qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, eps)
    k_out = torch.empty((t, k.shape[1], d), dtype=k.dtype, device=k.device)
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, k_out), k_out


def qk_norm_rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    # As qk_norm_rotary, with the keys and values [T, Hkv, D] written at flat rows `slots` [T] of the paged
    # caches [num_blocks, block_size, Hkv, D] (the model's dtype, contiguous); returns the queries.
    d = q.shape[2]
    hkv = k_cache.shape[2]
    if d > MAX_DIM or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        reason = f"head dim over {MAX_DIM}" if d > MAX_DIM else "strided caches"
        dispatch.fallback("qk_norm_rotary_store", reason, q=q, k_cache=k_cache)
        return in_turn(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots)
    v = v if v.stride(-1) == 1 else v.contiguous()
    rows = (k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d))
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, rows[0], (v, rows[1], slots))


def _launch(q, k, q_weight, k_weight, cos, sin, eps, k_out, store=None) -> torch.Tensor:
    """Run the kernel; returns the queries. `store`: (values, value cache rows, slots), k_out then the key
    cache rows."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    bd = triton.next_power_of_2(d)
    bh = max(1, min(triton.next_power_of_2(max(hq, hkv)), TILE // bd))
    kv_blocks = triton.cdiv(hkv, bh)
    v, v_out, slots = store if store is not None else (k, k_out, k)  # unread without STORE
    grid = (t, triton.cdiv(hq, bh) + kv_blocks * (2 if store is not None else 1))
    _qk_norm_rotary_kernel[grid](
        q,
        k,
        q_weight,
        k_weight,
        cos,
        sin,
        q_out,
        k_out,
        v,
        v_out,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        hq,
        hkv,
        d,
        cos.shape[-1],
        eps,
        BH=bh,
        BD=bd,
        STORE=store is not None,
        num_warps=4,
        enable_fp_fusion=False,  # no FMA: keep the references' rounding of each product
        **pdl_launch(),
    )
    return q_out
