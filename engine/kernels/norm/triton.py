"""Triton RMSNorm, gated RMSNorm and residual add + RMSNorm over the last dim, with the references' rounding.

Each program normalises BR rows of BD (>= D) channels in registers: fp32 sum of squares, one rsqrt, the
scale, and one cast. Inputs are viewed as [A, B, D] with any row strides, so the strided q/k views and the
DeltaNet gate slices are read in place; outputs are contiguous, as the references' are. With a residual, the
program first adds it (rounded to x's dtype, as `x + residual` is), stores that sum, and normalises it.
"""

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.norm import reference
from engine.kernels.pdl import pdl_launch, pdl_wait

# Rows of more channels than this would not fit one program's registers; they take the reference.
MAX_DIM = 16384
_WIDE = f"rows of more than {MAX_DIM} channels do not fit one program"
# Elements of one program's [BR, BD] tile.
TILE = 4096


@triton.jit
def _rms_norm_kernel(
    x,  # [A, B, D], last dim contiguous
    weight,  # [D]
    gate,  # [A, B, D], last dim contiguous (only read if IS_GATED)
    residual,  # [A, B, D], last dim contiguous (only read if HAS_RESIDUAL)
    out,  # [A * B, D], contiguous
    residual_out,  # [A * B, D], contiguous: x + residual (only written if HAS_RESIDUAL)
    stride_xa,
    stride_xb,
    stride_ga,
    stride_gb,
    stride_ra,
    stride_rb,
    B,
    R,
    D,
    eps,
    BR: tl.constexpr,
    BD: tl.constexpr,
    IS_GATED: tl.constexpr,
    IS_ZERO_CENTERED: tl.constexpr,
    IS_ROUNDED_PRODUCT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
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
        b_x = (b_x.to(tl.float32) + b_res.to(tl.float32)).to(x.dtype.element_ty)  # the rounded sum
        tl.store(residual_out + p_out, b_x.to(residual_out.dtype.element_ty), mask=m)
    xf = b_x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [BR]
    xf = xf * rstd[:, None]
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
    tl.store(out + p_out, y.to(out.dtype.element_ty), mask=m)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [A, B, D] with a contiguous last dim, a view where the strides allow."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(0)
    return t.reshape(-1, *t.shape[-2:])


def _launch(x, weight, eps, zero_centered, gate=None, rounded=False, residual=None):
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if x.numel() == 0:
        return out, residual_out
    x3 = _as_rows(x)
    g3 = _as_rows(gate) if gate is not None else x3
    r3 = _as_rows(residual) if residual is not None else x3
    bd = triton.next_power_of_2(d)
    rows = x3.shape[0] * x3.shape[1]
    br = max(1, min(TILE // bd, triton.next_power_of_2(rows)))
    _rms_norm_kernel[(triton.cdiv(rows, br),)](
        x3,
        weight,
        g3,
        r3,
        out,
        residual_out,
        x3.stride(0),
        x3.stride(1),
        g3.stride(0),
        g3.stride(1),
        r3.stride(0),
        r3.stride(1),
        x3.shape[1],
        rows,
        d,
        eps,
        BR=br,
        BD=bd,
        IS_GATED=gate is not None,
        IS_ZERO_CENTERED=zero_centered,
        IS_ROUNDED_PRODUCT=rounded,
        HAS_RESIDUAL=residual is not None,
        num_warps=4 if br * bd <= 4096 else 8,
        **pdl_launch(),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    # x [..., D], weight [D]; fp32 math, one cast of the product to x's dtype.
    if x.shape[-1] > MAX_DIM:
        dispatch.fallback("rms_norm", _WIDE, x=x)
        return reference.rms_norm(x, weight, eps, zero_centered)
    return _launch(x, weight, eps, zero_centered)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual [..., D] of one dtype, weight [D] -> (rms_norm(x + residual), x + residual).
    if x.shape[-1] > MAX_DIM or residual.shape != x.shape or residual.dtype != x.dtype:  # not a model case
        reason = _WIDE if x.shape[-1] > MAX_DIM else "residual's shape or dtype differs from x's"
        dispatch.fallback("add_rms_norm", reason, x=x, residual=residual)
        return reference.add_rms_norm(x, residual, weight, eps)
    return _launch(x, weight, eps, zero_centered=True, residual=residual)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x, gate [..., D], weight [D]. The reference's `weight * normed.to(x.dtype)` is rounded to x's dtype
    # only when the weight has that dtype too (torch promotes a mixed product to fp32).
    if x.shape[-1] > MAX_DIM or gate.shape != x.shape:  # broadcast gates: not a model case
        reason = _WIDE if x.shape[-1] > MAX_DIM else "gate's shape differs from x's (broadcast)"
        dispatch.fallback("gated_rms_norm", reason, x=x, gate=gate)
        return reference.gated_rms_norm(x, gate, weight, eps)
    rounded = weight.dtype == x.dtype and x.dtype != torch.float32
    return _launch(x, weight, eps, zero_centered=False, gate=gate, rounded=rounded)[0]
