"""The gated attention's q/k preparation: zero-centred RMSNorm of every head, then partial rotary."""

import torch

from engine.kernels import dispatch
from engine.kernels.qk_norm_rotary import reference

dispatch.register(
    "qk_norm_rotary",
    torch=reference.qk_norm_rotary,
    triton="engine.kernels.qk_norm_rotary.triton:qk_norm_rotary",
)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary(rms_norm(q, q_weight), cos, sin)` and the same for k, in one pass over both.

    Args:
        q: [T, Hq, D] queries, any head and token strides (a view of the projection output).
        k: [T, Hkv, D] keys, likewise.
        q_weight, k_weight: [D] zero-centred norm weights (the scale is `1 + weight`).
        cos, sin: [T, rd] fp32 rotary tables (`rotary_cos_sin`); channels past rd pass through.
        eps: added to the mean square.
    Returns:
        (q, k), contiguous [T, Hq, D] and [T, Hkv, D] in q's and k's dtype.
    """
    return dispatch.pick("qk_norm_rotary", q)(q, k, q_weight, k_weight, cos, sin, eps)
