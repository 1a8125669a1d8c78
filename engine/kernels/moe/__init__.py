"""Mixture-of-experts ops: top-k softmax routing (with the shared expert's gate as one more slot), the
experts' SwiGLU summed over each token's slots, and the expert-sorted pair order the grouped GEMMs use."""

import torch

from engine.kernels import dispatch
from engine.kernels.moe import reference

dispatch.register("moe_route", torch=reference.route, triton="engine.kernels.moe.triton:route")
dispatch.register("moe_experts", torch=reference.experts, triton="engine.kernels.moe.triton:experts")
dispatch.register(
    "moe_align_block_size",
    torch=reference.align_block_size,
    triton="engine.kernels.moe.align:align_block_size",
)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the fp32 softmax of `router_logits` [T, E]: (weights [T, k] fp32, expert ids [T, k] int64).

    With `shared`, router_logits is [T, E + 1] whose last column is the shared expert's gate logit (one GEMM
    gives both): it becomes slot k, with weight sigmoid(logit) and expert id E, so the outputs are [T, k + 1].
    """
    return dispatch.pick("moe_route", router_logits)(router_logits, top_k, renormalize, shared)


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
    """Sum over each token's slots of weight * down(silu(gate(x)) * up(x)).

    Args:
        x: [T, H] tokens.
        w13: [E, 2I, H] stacked gate (first I rows) and up (last I rows) projections.
        w2: [E, H, I] stacked down projections.
        weights, ids: [T, S] routing weights and expert ids; id E is the shared expert.
        shared_w13, shared_w2: [2Is, H] and [H, Is], the shared expert's projections (for id E).
        shared_out, shared_gate: [T, H] and [T], a shared expert run elsewhere (an FP8 one) and its weight,
            added as shared_gate * shared_out.
    Returns:
        [T, H] in x's dtype.
    """
    shared = (shared_w13, shared_w2, shared_out, shared_gate)
    return dispatch.pick("moe_experts", x)(x, w13, w2, weights, ids, *shared)


def align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair ids grouped by expert, each expert's run padded to `block_m` rows; see
    `reference.align_block_size` for the outputs."""
    return dispatch.pick("moe_align_block_size", ids)(ids, num_experts, block_m)
