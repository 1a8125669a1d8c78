"""Triton: an MoE block's combine fused into the residual add + RMSNorm that reads its output (the next
layer's input norm, the MTP head's norm), optionally quantising the normed rows for FP8 consumers.

Each program is a norm program (`norm.triton`'s tiles: BR rows of BD >= H channels in registers, the same
warps, so each row's sum of squares reduces in the same order) whose x is summed in registers instead of
read: each token's (token, slot) rows of part [P, T*S, H] in slot order, each slot's K splits in turn, in
fp32, plus shared_gate * shared_out, rounded once to the model dtype, exactly as `moe.combine`'s kernel
does. Then `add_rms_norm`'s arithmetic: that sum plus the residual, rounded and stored, normed with
`1 + weight`; with QUANT the rounded output quantised per (row, group) as `add_rms_norm_fp8` does. So the
outputs equal `combine` followed by `add_rms_norm` (or `add_rms_norm_fp8`) bit for bit: under the
interpreter, and on sm_90, where the sum of squares' operand gets the add + norm kernel's layout (the gpu
test checks it). One launch per MoE layer is saved: the combine's, with its kernel boundary.

A file of its own beside the norm kernel rather than a mode of it or of the combine: the norm kernel already
takes gated and strided [A, B, D] inputs, and this one reads a different input (parts and slots), so a third
mode would make both harder to read; it shares the norm's tiles (`norm.triton.tiles`) and FP8 group rows.
"""

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe.combine import sum_slots
from engine.kernels.moe.pending import PendingCombine
from engine.kernels.norm import in_turn, in_turn_fp8
from engine.kernels.norm.triton import (
    MAX_DIM,
    WIDE,
    add_residual,
    quantizable,
    rms_scaled,
    store_fp8_rows,
    tiles,
)
from engine.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _combine_add_rms_norm_kernel(
    part,  # [PARTS, T*S, H]: each (token, slot) row's weighted expert output, per K split
    extra,  # [T, H] with HAS_EXTRA: a shared expert's output computed elsewhere
    gate,  # [T] with HAS_EXTRA: its weight, any float dtype and stride
    residual,  # [T, H], last dim contiguous
    weight,  # [H] zero-centred norm weight
    out,  # [T, H] contiguous: the normed rows
    residual_out,  # [T, H] contiguous: combine + residual
    q_out,  # [T, H] e4m3, contiguous (only written if QUANT)
    s_out,  # [T, NG] fp32 scales, contiguous (only written if QUANT)
    stride_ps,
    stride_pp,
    stride_ph,
    stride_et,
    stride_eh,
    stride_g,
    stride_rt,
    T,
    D,
    NG,  # scale groups per row, ceil(D / group)
    eps,
    NUM_SLOTS: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
    QUANT: tl.constexpr = False,  # also write the output quantised to e4m3 per GW channels
    GW: tl.constexpr = 128,  # with QUANT: channels per group in the tile, min(group, BD)
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] token
    o_d = tl.arange(0, BD)  # [BD]
    m_r = o_r < T
    m = m_r[:, None] & (o_d < D)[None, :]
    token = o_r.to(tl.int64)
    p_out = token[:, None] * D + o_d[None, :]  # [BR, BD] contiguous output rows
    # The combine: slot order, each slot's K splits in turn, the shared expert run outside last.
    acc = sum_slots(
        part, extra, gate, token[:, None], o_d[None, :], m, m_r[:, None],
        stride_ps, stride_pp, stride_ph, stride_et, stride_eh, stride_g, NUM_SLOTS, PARTS, HAS_EXTRA,
    )  # fmt: skip
    b_x = acc.to(out.dtype.element_ty)  # the combine's output, rounded once
    # `add_rms_norm`: the rounded sum with the residual, stored, then normed.
    b_res = tl.load(residual + token[:, None] * stride_rt + o_d[None, :], mask=m, other=0.0)
    b_x = add_residual(b_x, b_res, residual_out, p_out, m)
    xf = rms_scaled(b_x, D, eps)
    wf = 1.0 + tl.load(weight + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    y = (xf * wf[None, :]).to(out.dtype.element_ty)
    tl.store(out + p_out, y, mask=m)
    if QUANT:
        store_fp8_rows(y, token, m, m_r, p_out, q_out, s_out, NG, BR, BD, GW)


def _launch(pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float, group=None):
    """(normed, total, xq): `xq` an `Fp8Activation` of normed with `group`, else None."""
    (t, d), part, dtype = pending.shape, pending.part, pending.dtype
    out = torch.empty(t, d, dtype=dtype, device=part.device)
    total = torch.empty(t, d, dtype=dtype, device=part.device)
    xq = None
    if group is not None:
        ng = triton.cdiv(d, group)
        q = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=part.device)
        xq = Fp8Activation(q, torch.empty(t, ng, dtype=torch.float32, device=part.device), group)
    if t == 0:
        return out, total, xq
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    has_extra = pending.shared_out is not None
    extra, gate = (pending.shared_out, pending.shared_gate) if has_extra else (out, out[:, 0])  # any do
    br, bd, warps = tiles(t, d)
    _combine_add_rms_norm_kernel[(triton.cdiv(t, br),)](
        part, extra, gate, residual, weight, out, total,
        xq.q if xq is not None else out, xq.scale if xq is not None else out,
        part.stride(0), part.stride(1), part.stride(2), extra.stride(0), extra.stride(1), gate.stride(0),
        residual.stride(0), t, d, xq.scale.shape[-1] if xq is not None else 1, eps,
        NUM_SLOTS=pending.slots, PARTS=part.shape[0], HAS_EXTRA=has_extra, BR=br, BD=bd,
        QUANT=xq is not None, GW=min(group, bd) if group is not None else 128, num_warps=warps,
        **pdl_launch(),
    )  # fmt: skip
    return out, total, xq


def _unfit(op: str, pending: PendingCombine, residual: torch.Tensor, group: int | None = None) -> bool:
    """Whether `op` takes the composition instead (recorded and logged once): inputs no model makes."""
    wide = pending.shape[1] > MAX_DIM
    same = residual.shape == pending.shape and residual.dtype == pending.dtype
    groups = group is None or quantizable(group)
    if wide or not same or not groups:
        reason = dispatch.first_failed(
            (not wide, WIDE),
            (same, "residual's shape or dtype differs from the combine's output"),
            (groups, "the FP8 group is not a power of two"),
        )
        dispatch.fallback(op, reason, part=pending.part, residual=residual)
        return True
    return False


def combine_add_rms_norm(
    pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # `add_rms_norm(pending.tensor(), residual, weight, eps)` in one kernel.
    if _unfit("combine_add_rms_norm", pending, residual):
        return in_turn(pending, residual, weight, eps)
    return _launch(pending, residual, weight, eps)[:2]


def combine_add_rms_norm_fp8(
    pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
    # `add_rms_norm_fp8(pending.tensor(), residual, weight, eps, group)` in one kernel.
    if _unfit("combine_add_rms_norm_fp8", pending, residual, group):
        return in_turn_fp8(pending, residual, weight, eps, group)
    return _launch(pending, residual, weight, eps, group)
