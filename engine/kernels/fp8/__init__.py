"""Block-scaled FP8 (e4m3): weights dequantised at load, or kept in e4m3 for the w8a8 block linear."""

import torch

from engine.kernels import dispatch
from engine.kernels.fp8 import reference
from engine.kernels.fp8.reference import Fp8Activation

dispatch.register("dequantize_block_fp8", torch=reference.dequantize_block_fp8)
dispatch.register(
    "quantize_fp8_per_token_group",
    torch=reference.quantize_fp8_per_token_group,
    triton="engine.kernels.fp8.quant:quantize_fp8_per_token_group",
)
dispatch.register(
    "fp8_block_linear",
    torch=reference.fp8_block_linear,
    triton="engine.kernels.fp8.triton:fp8_block_linear",
)


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`weight * scale_inv` with each scale covering one `block` (rows, cols) of the weight [..., N, K]."""
    return dispatch.pick("dequantize_block_fp8", weight)(weight, scale_inv, block, dtype)


def quantize_block_fp8_weight(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [..., N, K] to e4m3, one scale per `block` (rows, cols), as FP8 checkpoints store it.

    Runs once per weight at load, so it is plain torch on the weight's device (no Triton variant).

    Returns:
        (weight_fp8 [..., N, K] float8_e4m3fn, weight_scale_inv [..., ceil(N/bn), ceil(K/bk)] fp32), with
        weight ~= weight_fp8 * weight_scale_inv per block (edge blocks partial).
    """
    return reference.quantize_block_fp8_weight(weight, block)


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations to e4m3 with one scale per token and per `group` channels (dynamic, amax / 448).

    Args:
        x: [..., K] activations, any float dtype; the last group is partial when `group` does not divide K.
    Returns:
        (x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K/group)] fp32), with x ~= x_fp8 * scale per group.
    """
    return dispatch.pick("quantize_fp8_per_token_group", x)(x, group)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` as a w8a8 block-FP8 GEMM (DeepSeek-V3 / vLLM semantics), weight kept in e4m3.

    x is quantised per token and per `block[1]` channels (or read from `xq`, x quantised already by the op
    that produced it); each K block's e4m3 product is scaled by the token's and the weight block's scales and
    summed in fp32.

    Args:
        x: [..., K] activations.
        weight: [N, K] float8_e4m3fn.
        weight_scale_inv: [ceil(N/block[0]), ceil(K/block[1])] fp32 multiplier per weight block (edge blocks
            partial).
        bias: optional [N].
        block: (rows, cols) of a weight scale block.
        xq: x quantised per token and `block[1]` channels (ignored when its group or shape differ).
    Returns:
        [..., N] in x's dtype.
    """
    return dispatch.pick("fp8_block_linear", x)(x, weight, weight_scale_inv, bias, block, xq)
