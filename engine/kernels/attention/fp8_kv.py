"""The FP8 KV cache's storage rule, in torch: every path that writes or reads the paged cache uses it.

A key or value row [D] of one (position, kv head) is stored as float8 e4m3 (`x / scale`) with an fp32 scale
`amax(|x|) / 448` beside it, in a tensor [num_blocks, block_size, Hkv] parallel to the block pool. The scale
is worked out when the row is written, so no calibration is needed and no row can pass e4m3's +-448 (a
random-weight model's keys overflow a fixed scale); it costs 4 bytes per D-byte row (1.6% at D 256). A
cache in the model's dtype has no scales (None) and is written and read as before.
"""

from __future__ import annotations

import torch

from engine.kernels.fp8.reference import FP8_MAX, scale_of_amax

FP8_KV_DTYPE = torch.float8_e4m3fn
SCALE_TINY = 1e-12  # the scale of an all-zero row: its values stay 0 and 0 * scale stays 0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x / scale as e4m3 [..., D], fp32 scale [...]) with scale = amax(|x|) / 448 per row."""
    x = x.float()
    # Exact division (the kernel's div_rn): on CUDA `/ 448.0` is a reciprocal multiply, the likely cause of
    # the 36 in 55M values one e4m3 step off the kernel's on the H200 (not yet run again there).
    scale = scale_of_amax(x.abs().amax(-1)).clamp_min(SCALE_TINY)
    # The clamp only catches fp32 rounding of amax / scale a hair above 448 (a cast past it gives NaN).
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
    return q, scale


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., D] in `dtype`, times their scales [...] (None: an unscaled cache)."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[..., None]).to(dtype)


def write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    written: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Store new keys/values [T, Hkv, D] at flat cache rows `written` [T] (quantised when scales are given).

    Caches are [num_blocks, block_size, Hkv, D], scales [num_blocks, block_size, Hkv] fp32."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_rows, v_rows = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    if k_scale is None or v_scale is None:
        k_rows[written] = k.to(k_rows.dtype)
        v_rows[written] = v.to(v_rows.dtype)
        return
    k8, ks = quantize(k)
    v8, vs = quantize(v)
    k_rows[written] = k8
    v_rows[written] = v8
    k_scale.view(-1, hkv)[written] = ks
    v_scale.view(-1, hkv)[written] = vs
