"""RMSNorm ops: zero-centred `x * (1 + w)` for layer, q/k and final norms (alone, or after a residual add, or
after a residual add of an MoE block's deferred combine); gated norm for DeltaNet outputs."""

import torch

from engine.kernels import dispatch
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe.pending import PendingCombine
from engine.kernels.norm import reference

dispatch.register("rms_norm", torch=reference.rms_norm, triton="engine.kernels.norm.triton:rms_norm")
dispatch.register(
    "add_rms_norm", torch=reference.add_rms_norm, triton="engine.kernels.norm.triton:add_rms_norm"
)
dispatch.register(
    "gated_rms_norm", torch=reference.gated_rms_norm, triton="engine.kernels.norm.triton:gated_rms_norm"
)
dispatch.register(
    "add_rms_norm_fp8",
    torch=reference.add_rms_norm_fp8,
    triton="engine.kernels.norm.triton:add_rms_norm_fp8",
)
dispatch.register(
    "gated_rms_norm_fp8",
    torch=reference.gated_rms_norm_fp8,
    triton="engine.kernels.norm.triton:gated_rms_norm_fp8",
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """RMS-normalise the last dim of `x` [..., D], scale by `1 + weight` (or `weight`); x's dtype out."""
    return dispatch.pick("rms_norm", x)(x, weight, eps, zero_centered)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`total = x + residual` (in x's dtype) and zero-centred `rms_norm(total)`, in one pass.

    Args:
        x, residual: [..., D] of one dtype; neither is written.
        weight: [D] zero-centred norm weight (the scale is `1 + weight`).
        eps: added to the mean square.
    Returns:
        (normed, total), both [..., D] in x's dtype.
    """
    return dispatch.pick("add_rms_norm", x)(x, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rmsnorm(x) * weight * silu(gate)` over the last dim; x, gate [..., D], weight [D]."""
    return dispatch.pick("gated_rms_norm", x)(x, gate, weight, eps)


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
    """`add_rms_norm`, with its normed output also quantised for the FP8 GEMMs that read it.

    Returns:
        (normed, total, xq): as `add_rms_norm`, and `xq` the normed rows as e4m3 [..., D] with one fp32 scale
        per row and `group` channels [..., ceil(D/group)], as `quantize_fp8_per_token_group(normed, group)`.
    """
    return dispatch.pick("add_rms_norm_fp8", x)(x, residual, weight, eps, group)


def gated_rms_norm_fp8(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, Fp8Activation]:
    """`gated_rms_norm`, with its output also quantised for the FP8 projection that reads it.

    Returns:
        (out, xq): `gated_rms_norm`'s output and `xq` as in `add_rms_norm_fp8`.
    """
    return dispatch.pick("gated_rms_norm_fp8", x)(x, gate, weight, eps, group)


def in_turn(
    pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`combine_add_rms_norm` as the two launches it fuses, each picked as usual: on CUDA the Triton
    combine, then the Triton residual add + norm (the path the fused kernel replaces)."""
    return add_rms_norm(pending.tensor(), residual, weight, eps)


def in_turn_fp8(
    pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
    """`combine_add_rms_norm_fp8` as the two launches it fuses (see `in_turn`)."""
    return add_rms_norm_fp8(pending.tensor(), residual, weight, eps, group)


dispatch.register(
    "combine_add_rms_norm",
    torch=in_turn,
    triton="engine.kernels.norm.combine_triton:combine_add_rms_norm",
)
dispatch.register(
    "combine_add_rms_norm_fp8",
    torch=in_turn_fp8,
    triton="engine.kernels.norm.combine_triton:combine_add_rms_norm_fp8",
)


def combine_add_rms_norm(
    pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(pending.tensor(), residual, weight, eps)` with the MoE combine summed inside the add +
    norm's kernel: one launch fewer per MoE layer, the same values (the combine's sum is rounded to the model
    dtype first, as the combine does).

    Args:
        pending: an experts path's [T, H] output before its combine (`moe.experts(..., defer=True)`).
        residual: [T, H] in pending's dtype; not written.
        weight: [H] zero-centred norm weight (the scale is `1 + weight`).
        eps: added to the mean square.
    Returns:
        (normed, total), both [T, H] in pending's dtype, as `add_rms_norm`.
    """
    return dispatch.pick("combine_add_rms_norm", residual)(pending, residual, weight, eps)


def combine_add_rms_norm_fp8(
    pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
    """`combine_add_rms_norm`, with its normed output also quantised for the FP8 GEMMs that read it.

    Returns:
        (normed, total, xq) as `add_rms_norm_fp8(pending.tensor(), residual, weight, eps, group)`.
    """
    return dispatch.pick("combine_add_rms_norm_fp8", residual)(pending, residual, weight, eps, group)
