"""Triton DeltaNet gates: beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias), one launch.

Each program takes BT tokens of all BH (>= Hv) heads. The math is fp32 throughout; beta is rounded once to
b's dtype (as `torch.sigmoid(b)` is), g stays fp32. softplus follows torch's (x above 20 passes through),
with log1p(exp(-|x|)) taken in a form that keeps its small values.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import pdl_launch, pdl_wait

# Elements of one program's [BT, BH] tile.
TILE = 1024


@triton.jit
def _deltanet_gate_kernel(
    a,  # [T, HV], last dim contiguous
    b,  # [T, HV], last dim contiguous
    a_log,  # [HV]
    dt_bias,  # [HV]
    g,  # [T, HV] fp32, contiguous
    beta,  # [T, HV], contiguous
    stride_at,
    stride_bt,
    T,
    HV,
    BT: tl.constexpr,
    BH: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # [BT]
    o_h = tl.arange(0, BH)  # [BH]
    m_h = o_h < HV
    m = (o_t < T)[:, None] & m_h[None, :]
    b_a = tl.load(a + o_t[:, None] * stride_at + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    b_b = tl.load(b + o_t[:, None] * stride_bt + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    b_alog = tl.load(a_log + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)

    x = b_a + b_dt[None, :]
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p(u) = log(1 + u) * u / ((1 + u) - 1), exact when tiny.
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    tiny = w == 1.0
    log1p = tl.where(tiny, u, tl.log(w) * (u / tl.where(tiny, 1.0, w - 1.0)))
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)
    b_g = -tl.exp(b_alog)[None, :] * softplus
    b_beta = 1.0 / (1.0 + tl.exp(-b_b))
    p_out = o_t[:, None] * HV + o_h[None, :]
    tl.store(g + p_out, b_g, mask=m)
    tl.store(beta + p_out, b_beta.to(beta.dtype.element_ty), mask=m)


def deltanet_gate(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # a, b [T, Hv] (column slices of one projection), a_log, dt_bias [Hv] -> g [T, Hv] fp32, beta [T, Hv].
    t, hv = a.shape
    g = torch.empty((t, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, hv), dtype=b.dtype, device=b.device)
    if t == 0:
        return g, beta
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    bh = triton.next_power_of_2(hv)
    bt = max(1, min(TILE // bh, triton.next_power_of_2(t)))
    _deltanet_gate_kernel[(triton.cdiv(t, bt),)](
        a,
        b,
        a_log,
        dt_bias,
        g,
        beta,
        a.stride(0),
        b.stride(0),
        t,
        hv,
        BT=bt,
        BH=bh,
        num_warps=4,
        **pdl_launch(),
    )
    return g, beta
