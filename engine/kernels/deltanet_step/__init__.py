"""One Gated DeltaNet layer's short step (decode, MTP verify), from the input projections to the gated norm:
causal conv + SiLU, gates, l2 norm, gated delta rule and gated RMSNorm, fused."""

import torch

from engine.kernels import dispatch
from engine.kernels.deltanet_step import reference
from engine.kernels.layout import SeqLayout

dispatch.register(
    "deltanet_step", torch=reference.deltanet_step, triton="engine.kernels.deltanet_step.triton:deltanet_step"
)


def deltanet_step(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    layout: SeqLayout,
) -> torch.Tensor:
    """`causal_conv1d` -> `deltanet_gate` -> `gated_delta_rule` -> `gated_rms_norm`, for layouts whose every
    sequence is short (at most SHORT_QUERY new tokens), with the same results and state updates.

    Args:
        qkv: [T, C] pre-conv projections [q (Hk heads) | k (Hk heads) | v (Hv heads)], C = 2 Hk dk + Hv dv.
        z: [T, Hv * dv] output gate.
        a, b: [T, Hv] decay and write-strength projections (column slices of `in_proj_ba`'s output).
        conv_weight: [C, K] depthwise filter.
        conv_state: [S, C, K-1] last K-1 inputs per slot; read when a sequence has context, then updated.
        a_log, dt_bias: [Hv] log decay rate and decay time-step bias.
        recurrent_state: [S, Hv, dk, dv] delta-rule state per slot, updated in place: fp32, or a 16-bit
            dtype the recurrence rounds to after every token.
        norm_weight: [dv] gated RMSNorm weight; eps its epsilon.
        layout: where each sequence's tokens, slot and per-token state slots (`state_out`) are.
    Returns:
        [T, Hv * dv] in qkv's dtype.
    """
    hv, dk, dv = recurrent_state.shape[1:]
    hk, rest = divmod(qkv.shape[1] - hv * dv, 2 * dk)
    if rest or hk <= 0 or hv % hk or z.shape[1] != hv * dv:
        raise ValueError(
            f"qkv width {qkv.shape[1]} and z width {z.shape[1]} do not fit a state of {hv} value heads of "
            f"{dk} x {dv} (qkv holds 2 * Hk * dk + Hv * dv channels, Hv a multiple of Hk)"
        )
    if layout.long_seqs:
        raise ValueError(
            "deltanet_step is for short steps only; run longer sequences through the unfused ops"
        )
    return dispatch.pick("deltanet_step", qkv)(
        qkv, z, a, b, conv_weight, conv_state, a_log, dt_bias, recurrent_state, norm_weight, eps, layout
    )
