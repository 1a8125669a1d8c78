"""Triton RMSNorm and gated RMSNorm over the last dim, with the references' rounding order.

Each program normalises BR rows of BD (>= D) channels in registers: fp32 sum of squares, one rsqrt, the
scale, and one cast. Inputs are viewed as [A, B, D] with any row strides, so the strided q/k views and the
DeltaNet gate slices are read in place; outputs are contiguous, as the references' are.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.norm import reference

# Rows of more channels than this would not fit one program's registers; they take the reference.
MAX_DIM = 16384
# Elements of one program's [BR, BD] tile.
TILE = 4096


@triton.jit
def _rms_norm_kernel(
    x,  # [A, B, D], last dim contiguous
    weight,  # [D]
    gate,  # [A, B, D], last dim contiguous (only read if IS_GATED)
    out,  # [A * B, D], contiguous
    stride_xa,
    stride_xb,
    stride_ga,
    stride_gb,
    B,
    R,
    D,
    eps,
    BR: tl.constexpr,
    BD: tl.constexpr,
    IS_GATED: tl.constexpr,
    IS_ZERO_CENTERED: tl.constexpr,
    IS_ROUNDED_PRODUCT: tl.constexpr,
):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] flat row index
    o_d = tl.arange(0, BD)  # [BD]
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    row_a, row_b = (o_r // B).to(tl.int64), (o_r % B).to(tl.int64)
    b_x = tl.load(x + (row_a * stride_xa + row_b * stride_xb)[:, None] + o_d[None, :], mask=m, other=0.0)
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
    tl.store(out + o_r.to(tl.int64)[:, None] * D + o_d[None, :], y.to(out.dtype.element_ty), mask=m)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [A, B, D] with a contiguous last dim, a view where the strides allow."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(0)
    return t.reshape(-1, *t.shape[-2:])


def _launch(x, weight, gate, eps, zero_centered, gated, rounded):
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3 = _as_rows(x)
    g3 = _as_rows(gate) if gated else x3
    bd = triton.next_power_of_2(d)
    br = max(1, min(TILE // bd, triton.next_power_of_2(x3.shape[0] * x3.shape[1])))
    rows = x3.shape[0] * x3.shape[1]
    _rms_norm_kernel[(triton.cdiv(rows, br),)](
        x3,
        weight,
        g3,
        out,
        x3.stride(0),
        x3.stride(1),
        g3.stride(0),
        g3.stride(1),
        x3.shape[1],
        rows,
        d,
        eps,
        BR=br,
        BD=bd,
        IS_GATED=gated,
        IS_ZERO_CENTERED=zero_centered,
        IS_ROUNDED_PRODUCT=rounded,
        num_warps=4 if br * bd <= 4096 else 8,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    # x [..., D], weight [D]; fp32 math, one cast of the product to x's dtype.
    if x.shape[-1] > MAX_DIM:
        return reference.rms_norm(x, weight, eps, zero_centered)
    return _launch(x, weight, None, eps, zero_centered, gated=False, rounded=False)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x, gate [..., D], weight [D]. The reference's `weight * normed.to(x.dtype)` is rounded to x's dtype
    # only when the weight has that dtype too (torch promotes a mixed product to fp32).
    if x.shape[-1] > MAX_DIM or gate.shape != x.shape:
        return reference.gated_rms_norm(x, gate, weight, eps)  # broadcast gates: not a model case
    rounded = weight.dtype == x.dtype and x.dtype != torch.float32
    return _launch(x, weight, gate, eps, zero_centered=False, gated=True, rounded=rounded)
