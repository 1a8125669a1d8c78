"""The model's dense projections: `nn.Linear` with its forward on `kernels.linear`; and how a module hands an
FP8 projection its input quantised already."""

from __future__ import annotations

import torch
from torch import nn

from engine import kernels
from engine.kernels.fp8.reference import Fp8Activation


class Linear(nn.Linear):
    """`nn.Linear` (same `weight` and `bias`, so checkpoints and the FP8 swap see no difference) whose forward
    runs `kernels.linear`: a weight-streaming kernel at decode batch sizes, cuBLAS above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


def fp8_group(module: nn.Module) -> int | None:
    """The channels per activation scale group of an FP8 projection (`Fp8Linear`: its scale block's K), or
    None for a projection in the model dtype."""
    block = getattr(module, "block", None)
    weight = getattr(module, "weight", None)
    return (
        block[1] if block is not None and weight is not None and weight.dtype == torch.float8_e4m3fn else None
    )


def project(module: nn.Module, x: torch.Tensor, xq: Fp8Activation | None) -> torch.Tensor:
    """`module(x)`, handing an FP8 projection `xq` (x quantised by the op that produced it) when it is in the
    projection's group, so the projection runs no quantiser of its own."""
    if xq is not None and fp8_group(module) == xq.group:
        return module(x, xq)
    return module(x)
