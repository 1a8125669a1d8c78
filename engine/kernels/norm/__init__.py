"""RMSNorm ops: zero-centred `x * (1 + w)` for layer, q/k and final norms; gated norm for DeltaNet outputs."""

import torch

from engine.kernels import dispatch
from engine.kernels.norm import reference

dispatch.register("rms_norm", torch=reference.rms_norm, triton="engine.kernels.norm.triton:rms_norm")
dispatch.register(
    "gated_rms_norm", torch=reference.gated_rms_norm, triton="engine.kernels.norm.triton:gated_rms_norm"
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """RMS-normalise the last dim of `x` [..., D], scale by `1 + weight` (or `weight`); x's dtype out."""
    return dispatch.pick("rms_norm", x)(x, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rmsnorm(x) * weight * silu(gate)` over the last dim; x, gate [..., D], weight [D]."""
    return dispatch.pick("gated_rms_norm", x)(x, gate, weight, eps)
