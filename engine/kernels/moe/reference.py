"""Plain-torch MoE routing and routed-expert SwiGLU over stacked expert weights."""

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 softmax over all experts, then the top k; renormalised so the kept weights sum to one.
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    # x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; weights, ids [T, k].
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    weights = weights.to(x.dtype)
    for e in torch.unique(ids).tolist():
        token, which = torch.where(ids == e)
        h = F.linear(x[token], w13[e])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, w2[e]) * weights[token, which, None]
        out.index_add_(0, token, y)
    return out
