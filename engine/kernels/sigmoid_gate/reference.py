"""Plain-torch output gate."""

import torch

from engine.kernels.fp8.reference import Fp8Activation, quantize_fp8_per_token_group


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # x, gate [T, H, D]; the sigmoid is rounded to gate's dtype before the product, as in the model.
    return x * torch.sigmoid(gate)


def sigmoid_gate_fp8(x: torch.Tensor, gate: torch.Tensor, group: int) -> tuple[torch.Tensor, Fp8Activation]:
    # The output, and it [T, H * D] quantised per token and `group` channels for an FP8 o_proj.
    out = sigmoid_gate(x, gate)
    return out, Fp8Activation(*quantize_fp8_per_token_group(out.reshape(out.shape[0], -1), group), group)
