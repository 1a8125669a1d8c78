"""The model's dense projections: `nn.Linear` with its forward on `kernels.linear`."""

import torch
from torch import nn

from engine import kernels


class Linear(nn.Linear):
    """`nn.Linear` (same `weight` and `bias`, so checkpoints and the FP8 swap see no difference) whose forward
    runs `kernels.linear`: a weight-streaming kernel at decode batch sizes, cuBLAS above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)
