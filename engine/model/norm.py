"""RMSNorm modules; the arithmetic lives in engine.kernels.norm."""

import torch
from torch import nn

from engine import kernels
from engine.kernels import PendingCombine
from engine.kernels.fp8.reference import Fp8Activation


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `norm(x) * (1 + weight)`, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor | PendingCombine, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel; the sum is rounded to x's dtype first. An MoE
        block's deferred combine (`PendingCombine`) is summed in the same kernel."""
        if isinstance(x, PendingCombine):
            return kernels.combine_add_rms_norm(x, residual, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)

    def add_fp8(
        self, x: torch.Tensor | PendingCombine, residual: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
        """`add`, with the normed output also quantised per token and `group` channels for the FP8
        projections or experts that read it, in the same kernel."""
        if isinstance(x, PendingCombine):
            return kernels.combine_add_rms_norm_fp8(x, residual, self.weight, self.eps, group)
        return kernels.add_rms_norm_fp8(x, residual, self.weight, self.eps, group)
