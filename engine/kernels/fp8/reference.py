"""Plain-torch block-scaled FP8: weight (de)quantisation, the per-token-group activation quantiser and the
w8a8 block linear; `Fp8Activation`, activations quantised once by the op that produces them."""

from __future__ import annotations

from dataclasses import dataclass

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


FP8_MAX = 448.0  # largest finite e4m3 (float8_e4m3fn) value
AMAX_EPS = 1e-10  # a group of zeros gets this amax, so its scale is not 0 (0 / 0 would give NaN)


def scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, divided exactly on every device. The divisor is a tensor: CUDA turns division by a Python
    number into a multiplication by its reciprocal, one ulp off the exact quotient in some rows, and the
    kernels (and the CPU) divide exactly (`tl.math.div_rn`)."""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    # x [..., K] -> (e4m3 [..., K], fp32 scales [..., ceil(K/group)]); the last group may be partial.
    k = x.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k))
    blocks = padded.unflatten(-1, (groups, group))  # [..., G, group]
    amax = blocks.abs().amax(dim=-1).clamp(min=AMAX_EPS)  # [..., G]
    scale = scale_of_amax(amax)
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :k]
    return q.to(torch.float8_e4m3fn), scale


@dataclass(frozen=True)
class Fp8Activation:
    """x quantised per token and `group` channels, as `quantize_fp8_per_token_group` returns it: e4m3 `q`
    [..., K] and fp32 `scale` [..., ceil(K/group)].

    Made once by the op that produces x (the residual add + RMSNorm before a layer's FP8 projections and FP8
    experts, the DeltaNet gated norm before out_proj), so that the FP8 GEMMs reading x run no quantiser of
    their own. A consumer whose scale block is not `group` quantises x itself."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int

    def fits(self, x: torch.Tensor, group: int) -> bool:
        """Whether this is x [..., K] quantised in `group`-channel groups (else the consumer quantises x)."""
        return self.group == group and self.q.shape == x.shape


def quantized(x: torch.Tensor, group: int, xq: Fp8Activation | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, scales): `xq`'s when it is x quantised in `group`-channel groups, else x quantised now."""
    if xq is not None and xq.fits(x, group):
        return xq.q, xq.scale
    return quantize_fp8_per_token_group(x, group)


def quantize_block_fp8_weight(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    # weight [..., N, K] -> (e4m3 [..., N, K], fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)]): one scale per
    # block, amax / 448 (edge blocks partial), so weight ~= e4m3 * scale_inv, as Qwen's FP8 releases store it.
    bn, bk = block
    n, k = weight.shape[-2:]
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.unflatten(-1, (cols, bk)).unflatten(-3, (rows, bn))  # [..., rows, bn, cols, bk]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=AMAX_EPS)  # [..., rows, cols]
    scale = scale_of_amax(amax)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    # x [..., K]; weight [N, K] e4m3; weight_scale_inv [ceil(N/bn), ceil(K/bk)] -> [..., N] in x's dtype.
    # x is quantised per token and per bk channels (or taken from `xq`), then both sides are dequantised and
    # multiplied in fp32: equal, up to fp32 summation order, to summing the K blocks' e4m3 products times
    # x_scale * w_scale.
    k = x.shape[-1]
    x_q, x_scale = quantized(x, block[1], xq)
    x_deq = x_q.float() * x_scale.repeat_interleave(block[1], dim=-1)[..., :k]
    w_deq = dequantize_block_fp8(weight, weight_scale_inv, block, torch.float32)  # [N, K]
    y = x_deq @ w_deq.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
