"""Plain-torch causal GQA attention over a paged KV cache (torch's SDPA does the math)."""

import torch
import torch.nn.functional as F

from engine.kernels.attention import fp8_kv
from engine.kernels.layout import SeqLayout


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
    # q [T, Hq, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. New keys/values are written
    # at each sequence's positions context .. context+n-1, then its queries attend causally over all of them.
    # An FP8 cache has scales [num_blocks, block_size, Hkv]: rows are quantised on write, dequantised on read.
    # k and v None: the caller stored them (`qk_norm_rotary_store`).
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if k is not None:
        fp8_kv.write(k, v, k_cache, v_cache, layout.slot_mapping(q.device), k_scale, v_scale)
    k_rows, v_rows = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    scales = _rows(k_scale, hkv), _rows(v_scale, hkv)
    out = torch.empty_like(q)
    if layout.short_seqs:
        _short(q, k_rows, v_rows, layout, scale, out, scales)
    long_sequences(q, k_rows, v_rows, layout, scale, out, scales)
    return out


def _rows(scale: torch.Tensor | None, hkv: int) -> torch.Tensor | None:
    return None if scale is None else scale.view(-1, hkv)  # [num_blocks * bs, Hkv]


def long_sequences(
    q, k_rows, v_rows, layout: SeqLayout, scale: float, out: torch.Tensor, scales=(None, None)
) -> None:
    """Each long sequence (a prefill chunk) on its own: SDPA over its gathered KV rows [num_blocks * bs];
    `scales` are the FP8 cache's (k, v) scale rows [num_blocks * bs, Hkv], or None."""
    ks, vs = scales
    for i in layout.long_seqs:
        start, n, ctx = layout.cu_seqlens[i], layout.query_lens[i], layout.context_lens[i]
        rows = layout.cached(
            ("attention_rows", i),
            q.device,
            lambda lay, i=i, m=ctx + n: torch.tensor(lay.kv_index(list(range(m)), i)),
        )
        # 4-D [1, H, m, D]: torch's fused CPU kernel only takes the batched layout (3-D falls back to math).
        keys = _read(k_rows, ks, rows, q.dtype).transpose(0, 1)[None]
        values = _read(v_rows, vs, rows, q.dtype).transpose(0, 1)[None]
        query = q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        if ctx == 0:
            o = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query j sits at position ctx + j and sees keys 0 .. ctx + j.
            allowed = torch.ones(n, ctx + n, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
            )
        out[start : start + n] = o[0].transpose(0, 1)


def _short_index(layout: SeqLayout) -> tuple[torch.Tensor, ...]:
    """For the short sequences, padded to B x n and B x m: token index, KV row, query mask, key validity,
    real (not padding) query rows."""
    seqs = layout.short_seqs
    n_max = max(layout.query_lens[i] for i in seqs)
    m = max(layout.context_lens[i] + layout.query_lens[i] for i in seqs)
    tokens = torch.zeros(len(seqs), n_max, dtype=torch.long)
    rows = torch.zeros(len(seqs), m, dtype=torch.long)
    allowed = torch.zeros(len(seqs), n_max, m, dtype=torch.bool)
    for b, i in enumerate(seqs):
        n, ctx = layout.query_lens[i], layout.context_lens[i]
        tokens[b, :n] = torch.arange(layout.cu_seqlens[i], layout.cu_seqlens[i] + n)
        rows[b, : ctx + n] = torch.tensor(layout.kv_index(list(range(ctx + n)), i))
        allowed[b, :n] = torch.ones(n, m, dtype=torch.bool).tril(ctx)
        allowed[b, n:, 0] = True  # padding queries see one key so softmax stays finite; dropped below
    live = torch.arange(n_max)[None, :] < torch.tensor([layout.query_lens[i] for i in seqs])[:, None]
    valid = (allowed & live[:, :, None]).any(1)  # [B, m] keys some real query reads
    return tokens, rows, allowed, valid, live


def _read(rows: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, dtype) -> torch.Tensor:
    """Cache rows at `index` in `dtype`, dequantised when the cache has scales."""
    return fp8_kv.dequantize(rows[index], None if scales is None else scales[index], dtype)


def _short(q, k_rows, v_rows, layout: SeqLayout, scale: float, out: torch.Tensor, scales) -> None:
    """Every short sequence (decode, MTP verify) in one padded SDPA call."""
    ks, vs = scales
    key = ("attention_short", q.device)
    if key not in layout._tensors:
        layout._tensors[key] = tuple(t.to(q.device) for t in _short_index(layout))
    tokens, rows, allowed, valid, live = layout._tensors[key]
    hidden = ~valid[:, None, :, None]
    # Rows past a sequence's end hold stale data (NaN included): zero them, since 0 * NaN = NaN.
    keys = _read(k_rows, ks, rows, q.dtype).transpose(1, 2).masked_fill(hidden, 0.0)  # [B, Hkv, m, D]
    values = _read(v_rows, vs, rows, q.dtype).transpose(1, 2).masked_fill(hidden, 0.0)
    query = q[tokens].transpose(1, 2)  # [B, Hq, n, D]
    o = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
    ).transpose(1, 2)  # [B, n, Hq, D]
    out[tokens[live]] = o[live]  # padding rows dropped
