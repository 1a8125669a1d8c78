"""Plain-torch MoE: top-k routing, the experts' SwiGLU summed over each token's slots (model-dtype or
block-FP8 weights), and the sorted, block-padded pair order the grouped GEMMs run over."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.fp8.reference import Fp8Activation, dequantize_block_fp8, quantized


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 softmax over all experts, then the top k; renormalised so the kept weights sum to one.
    # With `shared` the last logit is the shared expert's gate: it becomes one more slot, weight
    # sigmoid(logit) and expert id E (the number of routed experts).
    logits = router_logits[..., :-1] if shared else router_logits
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if shared:
        gate = torch.sigmoid(router_logits[..., -1:].float())
        weights = torch.cat([weights, gate], dim=-1)
        ids = torch.cat([ids, torch.full_like(ids[..., :1], logits.shape[-1])], dim=-1)
    return weights, ids


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    # x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; weights, ids [T, S];
    # id E means the shared expert, shared_w13 [2Is, H] and shared_w2 [H, Is]; or a shared expert run
    # elsewhere, shared_out [T, H] weighted by shared_gate [T].
    # Experts in id order, each slot's output rounded to x's dtype and added there, as transformers does;
    # the shared expert (the largest id) comes last, as transformers adds it after the routed sum.
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    weights = weights.to(x.dtype)
    for e in torch.unique(ids).tolist():
        gate_up, down = (shared_w13, shared_w2) if e == num_experts else (w13[e], w2[e])
        token, which = torch.where(ids == e)
        h = F.linear(x[token], gate_up)
        inter = down.shape[-1]
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, down) * weights[token, which, None]
        out.index_add_(0, token, y)
    if shared_out is not None:
        out = out + shared_gate.to(x.dtype)[:, None] * shared_out
    return out


def _dequantize_activations(x: torch.Tensor, group: int, xq: Fp8Activation | None = None) -> torch.Tensor:
    # x [N, K] through the w8a8 activation rounding (per token, per `group` channels; or `xq`), back in fp32.
    q, scale = quantized(x, group, xq)
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, : x.shape[-1]]


def fp8_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    xq: Fp8Activation | None = None,
) -> torch.Tensor:
    # x [T, H] (`xq`: x quantised already); w13 [E, 2I, H] e4m3 with w13_scale [E, 2 * ceil(I/bn),
    # ceil(H/bk)]: the gate half's row blocks, then the up half's; w2 [E, H, I] e4m3 with w2_scale
    # [E, ceil(H/bn), ceil(I/bk)]; weights and ids [T, S] (routed experts only); shared_out [T, H] weighted
    # by shared_gate [T].
    # W8A8 as `fp8.reference.fp8_block_linear`: x, and act (first rounded to x's dtype, as the kernel stores
    # it), quantised per token and per bk channels, then multiplied with the dequantised weights in fp32
    # (equal, up to summation order, to summing each K block's e4m3 product times x_scale * w_scale). Each
    # slot's output is rounded to x's dtype, the slots summed in fp32 (as the Triton combine), then rounded.
    bn, bk = block
    inter = w2.shape[-1]
    half = -(-inter // bn)  # scale rows of each of the gate and up halves
    x_deq = _dequantize_activations(x, bk, xq)  # [T, H] fp32
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        gate = dequantize_block_fp8(w13[e, :inter], w13_scale[e, :half], block, torch.float32)  # [I, H]
        up = dequantize_block_fp8(w13[e, inter:], w13_scale[e, half:], block, torch.float32)  # [I, H]
        down = dequantize_block_fp8(w2[e], w2_scale[e], block, torch.float32)  # [H, I]
        token, which = torch.where(ids == e)
        xe = x_deq[token]
        act = (F.silu(xe @ gate.T) * (xe @ up.T)).to(x.dtype)  # [n, I]
        y = _dequantize_activations(act, bk) @ down.T * weights[token, which, None].float()
        out.index_add_(0, token, y.to(x.dtype).float())
    if shared_out is not None:
        out += shared_gate.float()[:, None] * shared_out.float()
    return out.to(x.dtype)


def align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair ids (token * S + slot) grouped by expert, each expert's run padded to a multiple of `block_m`.

    Args:
        ids: [T, S] expert ids in [0, num_experts).
    Returns:
        sorted_pairs [num_blocks * block_m] int32: each expert's pairs in ascending order, its run starting
            at a multiple of block_m; slots past an expert's pairs (padding) are unspecified.
        block_experts [num_blocks] int32: the expert of each block, -1 for blocks past the last used one.
        block_rows [num_blocks] int32: how many of each block's rows hold pairs (0 for unused blocks).
    num_blocks = ceil(T*S / block_m) + min(num_experts, T*S) bounds the blocks used from shapes alone (each
    expert with pairs pads less than one block), so nothing here syncs with the host.
    """
    flat = ids.reshape(-1).long()  # [N]
    n = flat.numel()
    device = flat.device
    num_blocks = -(-n // block_m) + min(num_experts, n)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync on CUDA
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    row_start = (block_end - blocks) * block_m  # [E] first padded row of each expert
    count_start = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    order = torch.argsort(flat, stable=True)  # [N] pair ids grouped by expert, ascending within each
    sorted_experts = flat[order]
    dest = row_start[sorted_experts] + torch.arange(n, device=device) - count_start[sorted_experts]
    sorted_pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_ids = torch.arange(num_blocks, dtype=torch.int64, device=device)
    block_experts = torch.searchsorted(block_end, block_ids, right=True)  # [num_blocks]; E when unused
    used = block_experts < num_experts
    expert = block_experts.clamp(max=num_experts - 1)
    rows = (row_start[expert] + counts[expert] - block_ids * block_m).clamp(0, block_m)
    block_experts = torch.where(used, block_experts, -1).to(torch.int32)
    block_rows = torch.where(used, rows, 0).to(torch.int32)
    return sorted_pairs, block_experts, block_rows
