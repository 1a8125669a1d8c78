"""Triton `silu(gate) * up` in one pass over the fused [gate | up] rows.

One program per (row, BLOCK columns). silu is taken in fp32 and rounded to the dtype, then the product is
rounded once, as the reference's two ops do.
"""

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.swiglu import reference

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    x,  # [M, 2I], last dim contiguous
    out,  # [M, I] contiguous
    inter,
    stride_xm,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x + row * stride_xm + offs, mask=mask, other=0.0)
    up = tl.load(x + row * stride_xm + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out + row * inter + offs, y.to(out.dtype.element_ty), mask=mask)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    # x [..., 2I] -> [..., I] contiguous.
    if x.shape[-1] % 2 or x.numel() == 0:
        empty = x.numel() == 0
        dispatch.fallback("swiglu", dispatch.EMPTY if empty else "odd last dim", expected=empty, x=x)
        return reference.swiglu(x)
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)  # a view for the projection's contiguous output
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    block = min(BLOCK, triton.next_power_of_2(inter))
    _swiglu_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), BLOCK=block, num_warps=4
    )
    return out
