"""Plain-torch causal GQA attention over a per-slot contiguous KV cache (torch's SDPA does the math)."""

import torch
import torch.nn.functional as F

from engine.kernels.layout import SeqLayout


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
) -> torch.Tensor:
    # q [T, Hq, D]; k, v [T, Hkv, D]; caches [S, Hkv, L, D]. New keys/values are written at each sequence's
    # positions context .. context+n-1, then its queries attend causally over everything cached.
    if layout.is_decode:
        return _decode(q, k, v, k_cache, v_cache, layout, scale)
    out = torch.empty_like(q)
    for i, (start, slot, ctx) in enumerate(
        zip(layout.cu_seqlens, layout.slots, layout.context_lens, strict=False)
    ):
        n = layout.query_lens[i]
        k_cache[slot, :, ctx : ctx + n] = k[start : start + n].transpose(0, 1).to(k_cache.dtype)
        v_cache[slot, :, ctx : ctx + n] = v[start : start + n].transpose(0, 1).to(v_cache.dtype)
        # 4-D [1, H, n, D]: torch's fused CPU kernel only takes the batched layout (3-D falls back to math).
        keys = k_cache[slot, None, :, : ctx + n].to(q.dtype)  # [1, Hkv, m, D]
        values = v_cache[slot, None, :, : ctx + n].to(q.dtype)
        query = q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        if ctx == 0:
            o = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query i sits at position ctx + i and sees keys 0 .. ctx + i.
            allowed = torch.ones(n, ctx + n, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
            )
        o = o[0]
        out[start : start + n] = o.transpose(0, 1)
    return out


def _decode(q, k, v, k_cache, v_cache, layout: SeqLayout, scale: float) -> torch.Tensor:
    slots = layout.slot_tensor(q.device)
    ctx = layout.context_tensor(q.device)
    k_cache[slots, :, ctx] = k.to(k_cache.dtype)
    v_cache[slots, :, ctx] = v.to(v_cache.dtype)
    length = max(layout.context_lens) + 1
    allowed = torch.arange(length, device=q.device)[None, :] <= ctx[:, None]  # [B, m]
    keys = k_cache[slots, :, :length].to(q.dtype)  # [B, Hkv, m, D]
    # Positions past a shorter sequence's end hold stale data (NaN included): zero them, since 0 * NaN = NaN.
    values = v_cache[slots, :, :length].to(q.dtype).masked_fill(~allowed[:, None, :, None], 0.0)
    keys = keys.masked_fill(~allowed[:, None, :, None], 0.0)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=allowed[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o[:, :, 0]
