"""What every Triton experts path shares: `expert_rows`, the weights of a pair's expert (routed, or the shared
expert as id E), and `combine`, their last launch, which sums each token's slots.

The grouped GEMMs (`moe.triton`, `moe.fp8`) and the few-token GEMVs (`moe.gemv`) write one weighted output
row per (token, slot) pair, and split K parts in fp32; `combine` adds each token's rows in slot order and
fp32 (plus, for an FP8 shared expert run outside, shared_gate * shared_out) and rounds once. The sum order is
fixed, so results are equal run to run. Here rather than in one of those modules, so that none of them
imports another for it. Inside `pending.deferred()` (`moe.experts(..., defer=True)`) `combine` launches
nothing and returns its inputs, for the residual add + norm after the MoE block to sum them in its own kernel
(`norm.combine_add_rms_norm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.moe.pending import PendingCombine, deferring
from engine.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def block_and_tile(n_tiles):
    """(row block, N tile) of this program in a grouped GEMM's 1-D grid of num_blocks * n_tiles programs, the
    N tile fastest: the programs of one row block run together, so its activation rows come from DRAM once
    and from L2 for the other N tiles, and consecutive row blocks (one expert's) share its weights in L2.
    (With the row block fastest, each N tile's pass re-read every activation row from DRAM: at 8,192 tokens
    the bf16 gate/up GEMM moved 2 GB, 8 times its activations, and ran at 371 TFLOP/s on an H200.)"""
    pid = tl.program_id(0)
    return pid // n_tiles, pid % n_tiles


@triton.jit
def expert_rows(w_ptr, ws_ptr, expert, num_experts, stride_we, stride_wn, stride_sn, inter, shared_inter):
    """(base pointer, row stride, intermediate size) of routed expert `expert`, or of the shared expert
    (`ws_ptr`) when expert == num_experts. Scalar selects keep one code path; the K strides are equal."""
    is_shared = expert == num_experts
    base = tl.where(is_shared, ws_ptr, w_ptr + expert.to(tl.int64) * stride_we)
    return base, tl.where(is_shared, stride_sn, stride_wn), tl.where(is_shared, shared_inter, inter)


@triton.jit
def sum_slots(
    part_ptr, extra_ptr, gate_ptr, token, offs, mask, gate_mask,
    stride_ps, stride_pp, stride_ph, stride_et, stride_eh, stride_g,
    NUM_SLOTS: tl.constexpr, PARTS: tl.constexpr, HAS_EXTRA: tl.constexpr,
):  # fmt: skip
    """The combine's sum in fp32, unrounded: each token's (token, slot) rows of part [P, T*S, H] in slot
    order, each slot's K splits in turn, then + gate * extra. `token` and `offs` broadcast against each other
    (a scalar token and [BLOCK_H] channels here; [BR, 1] tokens and [1, BD] channels in the fused combine +
    norm), as do `mask` and the gate's `gate_mask`: the same order of adds in both kernels."""
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for s in tl.static_range(NUM_SLOTS):  # slot order, shared expert last: deterministic
        p_slot = part_ptr + (token * NUM_SLOTS + s) * stride_pp + offs * stride_ph
        for k in tl.static_range(PARTS):
            acc += tl.load(p_slot + k * stride_ps, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        extra = tl.load(extra_ptr + token * stride_et + offs * stride_eh, mask=mask, other=0.0)
        weight = tl.load(gate_ptr + token * stride_g, mask=gate_mask, other=0.0)
        acc += weight.to(tl.float32) * extra.to(tl.float32)
    return acc


@triton.jit
def _combine_kernel(
    part_ptr,  # [PARTS, T*S, H]
    extra_ptr,  # [T, H] with HAS_EXTRA: a shared expert's output computed elsewhere
    gate_ptr,  # [T] its weight, any float dtype and stride
    out_ptr,  # [T, H] out
    hidden,
    stride_ps,
    stride_pp,
    stride_ph,
    stride_et,
    stride_eh,
    stride_g,
    stride_ot,
    stride_oh,
    NUM_SLOTS: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `pdl_launch()`: wait first
):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = sum_slots(
        part_ptr, extra_ptr, gate_ptr, token, offs, mask, True,
        stride_ps, stride_pp, stride_ph, stride_et, stride_eh, stride_g, NUM_SLOTS, PARTS, HAS_EXTRA,
    )  # fmt: skip
    tl.store(out_ptr + token * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(
    part: torch.Tensor,
    t: int,
    slots: int,
    dtype: torch.dtype,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor | PendingCombine:
    """out [T, H] in `dtype` = each token's sum over its slots and the K splits of part [P, T*S, H], in
    slot order and fp32 (+ shared_gate [T] * shared_out [T, H]): the last launch of every experts path.
    Inside `pending.deferred()`, these inputs as a `PendingCombine` instead, with nothing launched."""
    pending = PendingCombine(part, t, slots, dtype, shared_out, shared_gate)
    return pending if deferring() else launch(pending)


def launch(pending: PendingCombine) -> torch.Tensor:
    """The combine kernel over `pending`'s inputs: [T, H] in its dtype (`moe_combine`'s Triton side)."""
    part, t, slots = pending.part, pending.tokens, pending.slots
    parts, _, hidden = part.shape
    out = torch.empty(t, hidden, dtype=pending.dtype, device=part.device)
    has_extra = pending.shared_out is not None
    shared = (pending.shared_out, pending.shared_gate)
    extra, gate = shared if has_extra else (out, out[:, 0])  # any pointers do
    block_h = min(512, triton.next_power_of_2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, block_h))](
        part, extra, gate, out, hidden, part.stride(0), part.stride(1), part.stride(2),
        extra.stride(0), extra.stride(1), gate.stride(0), out.stride(0), out.stride(1),
        NUM_SLOTS=slots, PARTS=parts, HAS_EXTRA=has_extra, BLOCK_H=block_h, num_warps=4, **pdl_launch(),
    )  # fmt: skip
    return out
