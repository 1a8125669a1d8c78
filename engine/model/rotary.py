"""Inverse frequencies of the partial rotary embedding (default, linear and YaRN scaling)."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, scale applied to cos and sin)."""
    rope = config.rope
    dim = rope.rotary_dim
    # Always on the CPU: under a meta-device context, factory ops route through torch._refs, whose first
    # use imports torch._dynamo (seconds).
    powers = rope.theta ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    )  # theta^(2i/dim)
    inv_freq = 1.0 / powers
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    return _yarn(config, powers)


def _yarn(config: ModelConfig, powers: torch.Tensor) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv 2309.00071): interpolate low frequencies by `factor`, keep high ones, ramp in between,
    # and scale attention by 0.1 ln(factor) + 1.
    rope = config.rope
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor
    original = rope.original_max_position_embeddings or config.max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep frequency), 0: interpolate (divide by factor)
    # The same fp32 operations as transformers, so the frequencies agree to the bit: at position 1,048,575 one
    # unit in the last place of a frequency moves the angle by up to 0.06 radians.
    return 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep, attention
