"""Block-scaled FP8 (e4m3) weights."""

import torch

from engine.kernels import dispatch
from engine.kernels.fp8 import reference

dispatch.register("dequantize_block_fp8", torch=reference.dequantize_block_fp8)


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`weight * scale_inv` with each scale covering one `block` (rows, cols) of the weight [..., N, K]."""
    return dispatch.pick("dequantize_block_fp8", weight)(weight, scale_inv, block, dtype)
