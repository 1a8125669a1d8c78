"""Plain-torch causal GQA attention over a per-slot contiguous KV cache."""

import torch

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
    group = q.shape[1] // k.shape[1]
    if layout.is_decode:
        return _decode(q, k, v, k_cache, v_cache, layout, scale, group)
    out = torch.empty_like(q)
    for i, (start, slot, ctx) in enumerate(
        zip(layout.cu_seqlens, layout.slots, layout.context_lens, strict=False)
    ):
        n = layout.query_lens[i]
        k_cache[slot, :, ctx : ctx + n] = k[start : start + n].transpose(0, 1).to(k_cache.dtype)
        v_cache[slot, :, ctx : ctx + n] = v[start : start + n].transpose(0, 1).to(v_cache.dtype)
        keys = k_cache[slot, :, : ctx + n].to(q.dtype).repeat_interleave(group, dim=0)  # [Hq, m, D]
        values = v_cache[slot, :, : ctx + n].to(q.dtype).repeat_interleave(group, dim=0)
        scores = q[start : start + n].transpose(0, 1) @ keys.transpose(1, 2) * scale  # [Hq, n, m]
        allowed = (
            torch.arange(ctx + n, device=q.device)[None, :]
            <= (ctx + torch.arange(n, device=q.device))[:, None]
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start : start + n] = (probs @ values).transpose(0, 1)
    return out


def _decode(q, k, v, k_cache, v_cache, layout: SeqLayout, scale: float, group: int) -> torch.Tensor:
    slots = layout.slot_tensor(q.device)
    ctx = layout.context_tensor(q.device)
    k_cache[slots, :, ctx] = k.to(k_cache.dtype)
    v_cache[slots, :, ctx] = v.to(v_cache.dtype)
    length = max(layout.context_lens) + 1
    keys = k_cache[slots, :, :length].to(q.dtype).repeat_interleave(group, dim=1)  # [B, Hq, m, D]
    values = v_cache[slots, :, :length].to(q.dtype).repeat_interleave(group, dim=1)
    scores = (q[:, :, None, :] @ keys.transpose(2, 3))[:, :, 0] * scale  # [B, Hq, m]
    allowed = torch.arange(length, device=q.device)[None, :] <= ctx[:, None]  # [B, m]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    # Positions past a shorter sequence's end hold stale data (NaN included): zero them, since 0 * NaN = NaN.
    values = values.masked_fill(~allowed[:, None, :, None], 0.0)
    return (probs[:, :, None, :] @ values)[:, :, 0]
