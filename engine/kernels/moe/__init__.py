"""Mixture-of-experts ops: top-k softmax routing and the routed experts' SwiGLU with weighted combine."""

import torch

from engine.kernels import dispatch
from engine.kernels.moe import reference

dispatch.register("moe_route", torch=reference.route, triton="engine.kernels.moe.triton:route")
dispatch.register("moe_experts", torch=reference.experts, triton="engine.kernels.moe.triton:experts")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the fp32 softmax of `router_logits` [T, E]: (weights [T, k] fp32, expert ids [T, k])."""
    return dispatch.pick("moe_route", router_logits)(router_logits, top_k, renormalize)


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Sum over each token's experts of weight * down(silu(gate(x)) * up(x)).

    Args:
        x: [T, H] tokens.
        w13: [E, 2I, H] stacked gate (first I rows) and up (last I rows) projections.
        w2: [E, H, I] stacked down projections.
        weights, ids: [T, k] routing weights and expert ids.
    Returns:
        [T, H] in x's dtype.
    """
    return dispatch.pick("moe_experts", x)(x, w13, w2, weights, ids)
