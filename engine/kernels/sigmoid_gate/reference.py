"""Plain-torch output gate."""

import torch


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # x, gate [T, H, D]; the sigmoid is rounded to gate's dtype before the product, as in the model.
    return x * torch.sigmoid(gate)
