"""The gated attention's output gate: `x * sigmoid(gate)`."""

import torch

from engine.kernels import dispatch
from engine.kernels.sigmoid_gate import reference

dispatch.register(
    "sigmoid_gate", torch=reference.sigmoid_gate, triton="engine.kernels.sigmoid_gate.triton:sigmoid_gate"
)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(gate)` for x, gate [T, H, D] (gate with any token and head strides: it is read in place
    from the projection output); contiguous [T, H, D] in x's dtype."""
    return dispatch.pick("sigmoid_gate", x)(x, gate)
