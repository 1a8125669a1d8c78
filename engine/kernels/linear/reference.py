"""Plain-torch dense linear."""

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [..., K], weight [N, K], bias [N] -> [..., N]: cuBLAS on the GPU.
    return F.linear(x, weight, bias)
