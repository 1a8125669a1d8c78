"""Triton RMSNorm, gated RMSNorm and residual add + RMSNorm over the last dim, with the references' rounding.

Each program normalises BR rows of BD (>= D) channels in registers: fp32 sum of squares, one rsqrt, the
scale, and one cast. Inputs are viewed as [A, B, D] with any row strides, so the strided q/k views and the
DeltaNet gate slices are read in place; outputs are contiguous, as the references' are. With a residual, the
program first adds it (rounded to x's dtype, as `x + residual` is), stores that sum, and normalises it.

The `_fp8` variants also quantise the normed rows for the FP8 GEMMs that read them (W8A8: e4m3 plus one fp32
scale per (row, group channels), as `fp8.quant.quantize_fp8_per_token_group` does to the rounded output, bit
for bit), so no quantiser launch runs between a norm and its FP8 projections or experts. The row is in
registers already: its [BR, BD] tile is viewed as [BR * BD / GW, GW] groups (GW = min(group, BD), both powers
of two) and each group's amax, scale and e4m3 values come from `fp8.quant.quantize_rows`.
"""

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8.quant import quantize_rows
from engine.kernels.fp8.reference import AMAX_EPS, FP8_MAX, Fp8Activation
from engine.kernels.norm import reference
from engine.kernels.pdl import pdl_launch, pdl_wait

# Rows of more channels than this would not fit one program's registers; they take the reference.
MAX_DIM = 16384
WIDE = f"rows of more than {MAX_DIM} channels do not fit one program"
# Elements of one program's [BR, BD] tile.
TILE = 4096

_FP8_MAX = tl.constexpr(FP8_MAX)  # globals a kernel reads must be constexprs
_AMAX_EPS = tl.constexpr(AMAX_EPS)


@triton.jit
def _rms_norm_kernel(
    x,  # [A, B, D], last dim contiguous
    weight,  # [D]
    gate,  # [A, B, D], last dim contiguous (only read if IS_GATED)
    residual,  # [A, B, D], last dim contiguous (only read if HAS_RESIDUAL)
    out,  # [A * B, D], contiguous
    residual_out,  # [A * B, D], contiguous: x + residual (only written if HAS_RESIDUAL)
    q_out,  # [A * B, D] e4m3, contiguous (only written if QUANT)
    s_out,  # [A * B, NG] fp32 scales, contiguous (only written if QUANT)
    stride_xa,
    stride_xb,
    stride_ga,
    stride_gb,
    stride_ra,
    stride_rb,
    B,
    R,
    D,
    NG,  # scale groups per row, ceil(D / group)
    eps,
    BR: tl.constexpr,
    BD: tl.constexpr,
    IS_GATED: tl.constexpr,
    IS_ZERO_CENTERED: tl.constexpr,
    IS_ROUNDED_PRODUCT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr = False,  # also write the output quantised to e4m3 per GW channels
    GW: tl.constexpr = 128,  # with QUANT: channels per group in the tile, min(group, BD)
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] flat row index
    o_d = tl.arange(0, BD)  # [BD]
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    row_a, row_b = (o_r // B).to(tl.int64), (o_r % B).to(tl.int64)
    p_out = o_r.to(tl.int64)[:, None] * D + o_d[None, :]  # [BR, BD] contiguous output rows
    b_x = tl.load(x + (row_a * stride_xa + row_b * stride_xb)[:, None] + o_d[None, :], mask=m, other=0.0)
    if HAS_RESIDUAL:
        p_res = residual + (row_a * stride_ra + row_b * stride_rb)[:, None] + o_d[None, :]
        b_res = tl.load(p_res, mask=m, other=0.0)
        b_x = add_residual(b_x, b_res, residual_out, p_out, m)
    xf = rms_scaled(b_x, D, eps)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.0)
    if IS_GATED:
        # weight * normed in the input dtype (as the reference), then * silu(gate) in fp32.
        y = xf.to(x.dtype.element_ty).to(tl.float32) * b_w.to(tl.float32)[None, :]
        if IS_ROUNDED_PRODUCT:
            y = y.to(x.dtype.element_ty).to(tl.float32)
        p_g = gate + (row_a * stride_ga + row_b * stride_gb)[:, None] + o_d[None, :]
        b_g = tl.load(p_g, mask=m, other=0.0).to(tl.float32)
        y = y * (b_g / (1.0 + tl.exp(-b_g)))
    else:
        wf = b_w.to(tl.float32)
        if IS_ZERO_CENTERED:
            wf = 1.0 + wf
        y = xf * wf[None, :]
    y = y.to(out.dtype.element_ty)
    tl.store(out + p_out, y, mask=m)
    if QUANT:
        store_fp8_rows(y, o_r.to(tl.int64), m, m_r, p_out, q_out, s_out, NG, BR, BD, GW)


@triton.jit
def add_residual(b_x, b_res, residual_out, p_out, m):
    """x + residual in fp32, rounded to x's dtype: stored at p_out in residual_out and returned (the add of
    `add_rms_norm`, and of the fused combine + norm)."""
    b_x = (b_x.to(tl.float32) + b_res.to(tl.float32)).to(b_x.dtype)  # the rounded sum
    tl.store(residual_out + p_out, b_x.to(residual_out.dtype.element_ty), mask=m)
    return b_x


@triton.jit
def rms_scaled(b_x, D, eps):
    """A tile's rows [BR, BD] in fp32 over their root mean square (masked channels 0), before the weight."""
    xf = b_x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [BR]
    return xf * rstd[:, None]


@triton.jit
def store_fp8_rows(
    y, rows, m, m_r, p_out, q_out, s_out, NG, BR: tl.constexpr, BD: tl.constexpr, GW: tl.constexpr
):
    """Quantise a tile's rounded normed rows y [BR, BD] (as the quantiser would read them back; masked
    channels are 0) to e4m3 per GW channels: the values at p_out in q_out, the scales at [rows, NG] in s_out.
    The norm kernels' FP8 tail (this one's and the fused combine + norm's)."""
    groups = tl.reshape(tl.where(m, y.to(tl.float32), 0.0), (BR * (BD // GW), GW))
    b_q, scale = quantize_rows(groups, _FP8_MAX, _AMAX_EPS)
    tl.store(q_out + p_out, tl.reshape(b_q, (BR, BD)).to(tl.float8e4nv), mask=m)
    o_g = tl.arange(0, BD // GW)
    p_s = s_out + rows[:, None] * NG + o_g[None, :]
    tl.store(p_s, tl.reshape(scale, (BR, BD // GW)), mask=m_r[:, None] & (o_g < NG)[None, :])


def tiles(rows: int, d: int) -> tuple[int, int, int]:
    """(BR rows, BD channels, warps) of a norm program over `rows` rows of `d` channels. The fused combine
    + norm (`norm.combine_triton`) takes the same, so its sums of squares reduce as this kernel's do."""
    bd = triton.next_power_of_2(d)
    br = max(1, min(TILE // bd, triton.next_power_of_2(rows)))
    return br, bd, 4 if br * bd <= 4096 else 8


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [A, B, D] with a contiguous last dim, a view where the strides allow."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(0)
    return t.reshape(-1, *t.shape[-2:])


def _launch(x, weight, eps, zero_centered, gate=None, rounded=False, residual=None, group=None):
    """(out, residual_out, xq): `xq` an `Fp8Activation` of out with `group`, else None."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    xq = None
    if group is not None:
        ng = triton.cdiv(d, group)
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        xq = Fp8Activation(q, torch.empty(*x.shape[:-1], ng, dtype=torch.float32, device=x.device), group)
    if x.numel() == 0:
        return out, residual_out, xq
    x3 = _as_rows(x)
    g3 = _as_rows(gate) if gate is not None else x3
    r3 = _as_rows(residual) if residual is not None else x3
    rows = x3.shape[0] * x3.shape[1]
    br, bd, warps = tiles(rows, d)
    _rms_norm_kernel[(triton.cdiv(rows, br),)](
        x3,
        weight,
        g3,
        r3,
        out,
        residual_out,
        xq.q if xq is not None else out,
        xq.scale if xq is not None else out,
        x3.stride(0),
        x3.stride(1),
        g3.stride(0),
        g3.stride(1),
        r3.stride(0),
        r3.stride(1),
        x3.shape[1],
        rows,
        d,
        xq.scale.shape[-1] if xq is not None else 1,
        eps,
        BR=br,
        BD=bd,
        IS_GATED=gate is not None,
        IS_ZERO_CENTERED=zero_centered,
        IS_ROUNDED_PRODUCT=rounded,
        HAS_RESIDUAL=residual is not None,
        QUANT=xq is not None,
        GW=min(group, bd) if group is not None else 128,
        num_warps=warps,
        **pdl_launch(),
    )
    return out, residual_out, xq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    # x [..., D], weight [D]; fp32 math, one cast of the product to x's dtype.
    if x.shape[-1] > MAX_DIM:
        dispatch.fallback("rms_norm", WIDE, x=x)
        return reference.rms_norm(x, weight, eps, zero_centered)
    return _launch(x, weight, eps, zero_centered)[0]


def quantizable(group: int) -> bool:
    """Whether the kernel quantises in groups of `group` channels: the tile's groups are reshapes of
    [BR, BD], so a power of two (real checkpoints: 128)."""
    return group >= 1 and not group & (group - 1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual [..., D] of one dtype, weight [D] -> (rms_norm(x + residual), x + residual).
    if x.shape[-1] > MAX_DIM or residual.shape != x.shape or residual.dtype != x.dtype:  # not a model case
        reason = WIDE if x.shape[-1] > MAX_DIM else "residual's shape or dtype differs from x's"
        dispatch.fallback("add_rms_norm", reason, x=x, residual=residual)
        return reference.add_rms_norm(x, residual, weight, eps)
    return _launch(x, weight, eps, zero_centered=True, residual=residual)[:2]


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
    # `add_rms_norm`, and its normed output quantised per token and `group` channels, in one kernel.
    wide, same = x.shape[-1] > MAX_DIM, residual.shape == x.shape and residual.dtype == x.dtype
    if wide or not same or not quantizable(group):
        reason = dispatch.first_failed(
            (not wide, WIDE),
            (same, "residual's shape or dtype differs from x's"),
            (quantizable(group), "the FP8 group is not a power of two"),
        )
        dispatch.fallback("add_rms_norm_fp8", reason, x=x, residual=residual)
        return reference.add_rms_norm_fp8(x, residual, weight, eps, group)
    return _launch(x, weight, eps, zero_centered=True, residual=residual, group=group)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x, gate [..., D], weight [D]. The reference's `weight * normed.to(x.dtype)` is rounded to x's dtype
    # only when the weight has that dtype too (torch promotes a mixed product to fp32).
    if x.shape[-1] > MAX_DIM or gate.shape != x.shape:  # broadcast gates: not a model case
        reason = WIDE if x.shape[-1] > MAX_DIM else "gate's shape differs from x's (broadcast)"
        dispatch.fallback("gated_rms_norm", reason, x=x, gate=gate)
        return reference.gated_rms_norm(x, gate, weight, eps)
    rounded = weight.dtype == x.dtype and x.dtype != torch.float32
    return _launch(x, weight, eps, zero_centered=False, gate=gate, rounded=rounded)[0]


def gated_rms_norm_fp8(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, Fp8Activation]:
    # `gated_rms_norm`, and its output quantised per token and `group` channels, in one kernel.
    wide, same = x.shape[-1] > MAX_DIM, gate.shape == x.shape
    if wide or not same or not quantizable(group):
        reason = dispatch.first_failed(
            (not wide, WIDE),
            (same, "gate's shape differs from x's (broadcast)"),
            (quantizable(group), "the FP8 group is not a power of two"),
        )
        dispatch.fallback("gated_rms_norm_fp8", reason, x=x, gate=gate)
        return reference.gated_rms_norm_fp8(x, gate, weight, eps, group)
    rounded = weight.dtype == x.dtype and x.dtype != torch.float32
    out, _, xq = _launch(x, weight, eps, False, gate=gate, rounded=rounded, group=group)
    return out, xq
