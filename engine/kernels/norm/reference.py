"""Plain-torch RMSNorm variants of the Qwen3.5/Qwen3-Next family, and with the output quantised for FP8."""

import torch
import torch.nn.functional as F

from engine.kernels.fp8.reference import Fp8Activation, quantize_fp8_per_token_group


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    # fp32 accumulation; the product is taken in fp32 and cast once (the reference does (x * w).to(dtype)).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if zero_centered:
        w = 1.0 + w
    return (xf * w).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # The sum is rounded to x's dtype before the norm reads it, as the model's `residual + x` is.
    total = x + residual
    return rms_norm(total, weight, eps), total


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Norm before gate, plain (not 1 + w) weight; the weight multiplies the normed value in the input dtype,
    # as the reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return (out * F.silu(gate.float())).to(x.dtype)


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation]:
    # The normed output, as it is returned, quantised per token and `group` channels.
    normed, total = add_rms_norm(x, residual, weight, eps)
    return normed, total, Fp8Activation(*quantize_fp8_per_token_group(normed, group), group)


def gated_rms_norm_fp8(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, Fp8Activation]:
    out = gated_rms_norm(x, gate, weight, eps)
    return out, Fp8Activation(*quantize_fp8_per_token_group(out, group), group)
