"""Partial rotary position embedding."""

import torch

from engine.kernels import dispatch
from engine.kernels.rotary import reference

dispatch.register(
    "rotary_cos_sin", torch=reference.rotary_cos_sin, triton="engine.kernels.rotary.triton:rotary_cos_sin"
)
dispatch.register(
    "apply_rotary", torch=reference.apply_rotary, triton="engine.kernels.rotary.triton:apply_rotary"
)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim] (fp32) for token `positions` [T] and inverse frequencies [rotary_dim/2]."""
    return dispatch.pick("rotary_cos_sin", positions)(positions, inv_freq, scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of every head of `x` [T, H, D]; the rest pass through."""
    return dispatch.pick("apply_rotary", x)(x, cos, sin)
