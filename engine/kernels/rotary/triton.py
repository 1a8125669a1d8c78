"""Triton partial rotary embedding (rotate-half over the first rotary_dim channels of every head), and the
cos/sin tables it reads.

One program per (token, block of BH heads) loads the heads' [BH, BD] channels and, for the first rd of
them, their rotate-half partner (channel j +- rd/2), then writes the whole head: rotated channels and the
pass-through rest. The arithmetic follows the reference's rounding: cos/sin cast to x's dtype, each product
rounded to x's dtype, then their sum.

The tables take one launch instead of the reference's seven: angle position * inv_freq[j mod rd/2] in fp32,
then cos and sin (libdevice's, with full range reduction, as torch's) times the scale.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import pdl_launch, pdl_wait

# Elements of one program's [BH, BD] tile.
TILE = 4096
# Elements of one program's [BT, BD] tile of the cos/sin tables.
TABLE_TILE = 2048


@triton.jit
def _cos_sin_kernel(
    positions,  # [T] integer
    inv_freq,  # [RD / 2] fp32
    cos,  # [T, RD] fp32, contiguous
    sin,  # [T, RD] fp32, contiguous
    T,
    RD,
    scale,
    BT: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT]
    o_d = tl.arange(0, BD)  # [BD]
    m_t, m_d = o_t < T, o_d < RD
    m = m_t[:, None] & m_d[None, :]
    b_pos = tl.load(positions + o_t, mask=m_t, other=0).to(tl.float32)
    b_freq = tl.load(inv_freq + o_d % (RD // 2), mask=m_d, other=0.0).to(tl.float32)  # cat(freqs, freqs)
    angle = b_pos[:, None] * b_freq[None, :]  # [BT, BD]
    p_out = o_t.to(tl.int64)[:, None] * RD + o_d[None, :]
    tl.store(cos + p_out, tl.cos(angle) * scale, mask=m)
    tl.store(sin + p_out, tl.sin(angle) * scale, mask=m)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions [T], inv_freq [rd/2] -> cos, sin [T, rd] fp32.
    t, rd = positions.shape[0], 2 * inv_freq.shape[0]
    cos = torch.empty((t, rd), dtype=torch.float32, device=positions.device)
    sin = torch.empty((t, rd), dtype=torch.float32, device=positions.device)
    if t == 0 or rd == 0:
        return cos, sin
    bd = triton.next_power_of_2(rd)
    bt = max(1, min(TABLE_TILE // bd, triton.next_power_of_2(t)))
    _cos_sin_kernel[(triton.cdiv(t, bt),)](
        positions, inv_freq, cos, sin, t, rd, float(scaling), BT=bt, BD=bd, num_warps=4, **pdl_launch()
    )
    return cos, sin


@triton.jit
def _rotary_kernel(
    x,  # [T, H, D], last dim contiguous
    cos,  # [T, RD]
    sin,  # [T, RD]
    out,  # [T, H, D], contiguous
    stride_xt,
    stride_xh,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    H,
    D,
    RD,
    BH: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)  # [BH]
    o_d = tl.arange(0, BD)  # [BD]
    half = RD // 2
    m_h = o_h < H
    m = m_h[:, None] & (o_d < D)[None, :]
    m_rot = o_d < RD
    # rotate_half(x)[j] = -x[j + rd/2] for j < rd/2, x[j - rd/2] for rd/2 <= j < rd.
    partner = tl.where(o_d < half, o_d + half, o_d - half)
    sign = tl.where(o_d < half, -1.0, 1.0)

    p_x = x + i_t * stride_xt + o_h[:, None] * stride_xh  # [BH, 1]
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0)  # [BH, BD]
    b_y = tl.load(p_x + partner[None, :], mask=m & m_rot[None, :], other=0.0)
    dt = b_x.dtype
    b_cos = tl.load(cos + i_t * stride_ct + o_d * stride_cd, mask=m_rot, other=0.0).to(dt).to(tl.float32)
    b_sin = tl.load(sin + i_t * stride_st + o_d * stride_sd, mask=m_rot, other=0.0).to(dt).to(tl.float32)
    a = (b_x.to(tl.float32) * b_cos[None, :]).to(dt)
    b = (b_y.to(tl.float32) * (sign * b_sin)[None, :]).to(dt)
    rotated = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
    b_out = tl.where(m_rot[None, :], rotated, b_x)
    p_out = out + (i_t * H + o_h)[:, None] * D + o_d[None, :]
    tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D], cos/sin [T, rd] with rd <= D; channels past rd pass through.
    t, h, d = x.shape
    rd = cos.shape[-1]
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    bd = triton.next_power_of_2(d)
    bh = max(1, min(triton.next_power_of_2(h), TILE // bd))
    _rotary_kernel[(t, triton.cdiv(h, bh))](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        h,
        d,
        rd,
        BH=bh,
        BD=bd,
        num_warps=4,
        enable_fp_fusion=False,  # no FMA: keep the reference's rounding of each product
        **pdl_launch(),
    )
    return out
