"""RMSNorm modules; the arithmetic lives in engine.kernels.norm."""

import torch
from torch import nn

from engine import kernels


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `norm(x) * (1 + weight)`, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)
