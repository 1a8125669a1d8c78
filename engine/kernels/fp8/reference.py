"""Plain-torch dequantisation of block-scaled FP8 weights."""

import torch


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    # weight [..., N, K] e4m3; scale_inv [..., ceil(N/bn), ceil(K/bk)]: one multiplier per block, edge blocks
    # partial.
    bn, bk = block
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return (weight.float() * scale).to(dtype)
