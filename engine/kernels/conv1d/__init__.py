"""Causal depthwise conv1d (kernel size K, no bias) followed by SiLU, with per-slot rolling state."""

import torch

from engine.kernels import dispatch
from engine.kernels.conv1d import reference
from engine.kernels.layout import SeqLayout

dispatch.register(
    "causal_conv1d", torch=reference.causal_conv1d, triton="engine.kernels.conv1d.triton:causal_conv1d"
)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, layout: SeqLayout, activation: bool = True
) -> torch.Tensor:
    """Convolve each sequence's new tokens with its cached inputs.

    Args:
        x: [T, C] new inputs of all sequences, flat.
        weight: [C, K] depthwise filter.
        state: [S, C, K-1] last K-1 inputs per cache slot; read when a sequence has context, then updated.
        layout: where each sequence's tokens and slot are.
        activation: apply SiLU to the output.
    Returns:
        [T, C] in x's dtype.
    """
    return dispatch.pick("causal_conv1d", x)(x, weight, state, layout, activation)
