"""Plain-torch SwiGLU activation, rounded as the two ops of transformers' MLP (silu, then the product)."""

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
