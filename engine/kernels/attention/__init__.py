"""Causal grouped-query attention that appends to and reads from a paged KV cache."""

import torch

from engine.kernels import dispatch
from engine.kernels.attention import fp8_kv, reference
from engine.kernels.layout import SeqLayout

dispatch.register("attention", torch=reference.attention, triton="engine.kernels.attention.triton:attention")


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write each sequence's new keys/values into its blocks, then attend causally over all its positions.

    Args:
        q: [T, Hq, D] queries (rotary already applied).
        k, v: [T, Hkv, D] new keys and values; query head h reads kv head h // (Hq // Hkv). None, both: they
            are in the cache already (`qk_norm_rotary_store` wrote them).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] paged caches; `layout.block_tables` maps positions.
        layout: where each sequence's tokens, context length and slot are.
        scale: softmax scale, usually D ** -0.5.
        k_scale, v_scale: [num_blocks, block_size, Hkv] fp32 scales of an FP8 (e4m3) cache, None for a cache
            in the model's dtype; new rows are quantised into the cache, cached rows dequantised on load
            (`fp8_kv`).
    Returns:
        [T, Hq, D] in q's dtype.
    """
    return dispatch.pick("attention", q)(q, k, v, k_cache, v_cache, layout, scale, k_scale, v_scale)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new keys/values [T, Hkv, D] at the layout's positions, as `attention` does before attending
    (quantised, with their scales, into an FP8 cache)."""
    fp8_kv.write(k, v, k_cache, v_cache, layout.slot_mapping(k.device), k_scale, v_scale)
