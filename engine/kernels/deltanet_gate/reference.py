"""Plain-torch DeltaNet gates, as transformers' Qwen3.5 computes them."""

import torch
import torch.nn.functional as F


def deltanet_gate(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32: exp(A_log) and softplus overflow or lose the decay in bf16.
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # [T, Hv]
    return g, torch.sigmoid(b)
