"""Triton output gate `x * sigmoid(gate)`, reading a strided gate in place.

One program per (token, block of BH heads) of [BH, BD] channels; the sigmoid is taken in fp32 and rounded to
the dtype, then the product is rounded once, as the reference's two bf16 ops do. With QUANT (an FP8 o_proj
reads the output) the same program also quantises each GROUP channels of its heads (GROUP dividing D) as
`quantize_fp8_per_token_group` does on the rounded output, so o_proj runs no quantiser of its own.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.fp8.quant import quantize_rows
from engine.kernels.fp8.reference import AMAX_EPS, FP8_MAX, Fp8Activation
from engine.kernels.pdl import pdl_launch, pdl_wait
from engine.kernels.sigmoid_gate import quantises

_FP8_MAX = tl.constexpr(FP8_MAX)  # globals a kernel reads must be constexprs
_AMAX_EPS = tl.constexpr(AMAX_EPS)

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
    q_ptr=None,  # with QUANT: [T, H * D] e4m3, contiguous
    s_ptr=None,  # with QUANT: [T, H * D // GROUP] fp32, contiguous
    QUANT: tl.constexpr = False,
    GROUP: tl.constexpr = 128,  # channels per scale; divides D and BD
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
    if QUANT:
        # The rounded output as [BH * BD / GROUP, GROUP]: a row per scale group (masked channels 0)
        rounded = y.to(out.dtype.element_ty).to(tl.float32)
        groups = tl.reshape(tl.where(m, rounded, 0.0), [BH * (BD // GROUP), GROUP])
        q, scale = quantize_rows(groups, _FP8_MAX, _AMAX_EPS)
        q = tl.reshape(q, [BH, BD])
        tl.store(q_ptr + (i_t * H + o_h)[:, None] * D + o_d[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        g = tl.arange(0, BH * (BD // GROUP))  # group g: head i_h * BH + g // (BD / GROUP), its (g % ...)th
        head = i_h * BH + g // (BD // GROUP)
        within = g % (BD // GROUP)
        per_row = H * (D // GROUP)
        ok = (head < H) & (within < D // GROUP)
        tl.store(s_ptr + i_t * per_row + head * (D // GROUP) + within, scale, mask=ok)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # x, gate [T, H, D] -> x * sigmoid(gate) [T, H, D] contiguous.
    return _gate(x, gate, None)[0]


def sigmoid_gate_fp8(x: torch.Tensor, gate: torch.Tensor, group: int) -> tuple[torch.Tensor, Fp8Activation]:
    # ... and the output [T, H * D] quantised per token and `group` channels (a power of two dividing D).
    out, q, scale = _gate(x, gate, group)
    return out, Fp8Activation(q, scale, group)


def _gate(x: torch.Tensor, gate: torch.Tensor, group: int | None):
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    quant = {}
    q = scale = None
    if group is not None:
        if not quantises(d, group):
            raise ValueError(f"the scale group ({group}) must be a power of two dividing the head size ({d})")
        q = torch.empty((t, h * d), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty((t, h * d // group), dtype=torch.float32, device=x.device)
        quant = dict(q_ptr=q, s_ptr=scale, QUANT=True, GROUP=group)
    if x.numel() == 0:
        return out, q, scale
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
        **quant,
    )
    return out, q, scale
