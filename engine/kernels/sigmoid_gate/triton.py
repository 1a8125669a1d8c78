"""Triton output gate `x * sigmoid(gate)`, reading a strided gate in place.

One program per (token, block of BH heads) of [BH, BD] channels; the sigmoid is taken in fp32 and rounded to
the dtype, then the product is rounded once, as the reference's two bf16 ops do.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import pdl_launch, pdl_wait

# Elements of one program's [BH, BD] tile.
TILE = 2048


@triton.jit
def _sigmoid_gate_kernel(
    x,  # [T, H, D], last dim contiguous
    gate,  # [T, H, D], last dim contiguous
    out,  # [T, H, D], contiguous
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    H,
    D,
    BH: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)  # [BH]
    o_d = tl.arange(0, BD)  # [BD]
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + i_t * stride_xt + o_h[:, None] * stride_xh + o_d[None, :], mask=m, other=0.0)
    b_g = tl.load(gate + i_t * stride_gt + o_h[:, None] * stride_gh + o_d[None, :], mask=m, other=0.0)
    dt = b_g.dtype
    sig = (1.0 / (1.0 + tl.exp(-b_g.to(tl.float32)))).to(dt)
    y = b_x.to(tl.float32) * sig.to(tl.float32)
    tl.store(out + (i_t * H + o_h)[:, None] * D + o_d[None, :], y.to(out.dtype.element_ty), mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # x, gate [T, H, D] -> x * sigmoid(gate) [T, H, D] contiguous.
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    bd = triton.next_power_of_2(d)
    bh = max(1, min(triton.next_power_of_2(h), TILE // bd))
    _sigmoid_gate_kernel[(t, triton.cdiv(h, bh))](
        x,
        gate,
        out,
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        gate.stride(1),
        h,
        d,
        BH=bh,
        BD=bd,
        num_warps=4,
        **pdl_launch(),
    )
    return out
