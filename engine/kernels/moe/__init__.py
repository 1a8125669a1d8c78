"""Mixture-of-experts ops: top-k softmax routing (with the shared expert's gate as one more slot), the
experts' SwiGLU summed over each token's slots (model-dtype weights, or block-FP8 weights as W8A8), the
expert-sorted pair order the grouped GEMMs use, and the experts' last sum deferred to the op after them
(`PendingCombine`)."""

import torch

from engine.kernels import dispatch
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe import reference
from engine.kernels.moe.pending import PendingCombine, deferred

dispatch.register("moe_route", torch=reference.route, triton="engine.kernels.moe.triton:route")
dispatch.register("moe_experts", torch=reference.experts, triton="engine.kernels.moe.triton:experts")
dispatch.register("moe_experts_fp8", torch=reference.fp8_experts, triton="engine.kernels.moe.fp8:experts")
dispatch.register(
    "moe_align_block_size",
    torch=reference.align_block_size,
    triton="engine.kernels.moe.align:align_block_size",
)
# `PendingCombine.tensor()`: a deferred combine launched after all.
dispatch.register(
    "moe_combine", torch="engine.kernels.moe.pending:reference", triton="engine.kernels.moe.combine:launch"
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
    *,
    defer: bool = False,
) -> torch.Tensor | PendingCombine:
    """Sum over each token's slots of weight * down(silu(gate(x)) * up(x)).

    Args:
        x: [T, H] tokens.
        w13: [E, 2I, H] stacked gate (first I rows) and up (last I rows) projections.
        w2: [E, H, I] stacked down projections.
        weights, ids: [T, S] routing weights and expert ids; id E is the shared expert.
        shared_w13, shared_w2: [2Is, H] and [H, Is], the shared expert's projections (for id E).
        shared_out, shared_gate: [T, H] and [T], a shared expert run elsewhere (an FP8 one) and its weight,
            added as shared_gate * shared_out.
        defer: a Triton path returns its last launch's inputs (`PendingCombine`) instead of launching it,
            for the residual add + norm that reads the output to sum them in its own kernel; the reference
            (and any fallback to it) returns the tensor.
    Returns:
        [T, H] in x's dtype, or with `defer` possibly a `PendingCombine` of it.
    """
    shared = (shared_w13, shared_w2, shared_out, shared_gate)
    with deferred(defer):
        return dispatch.pick("moe_experts", x)(x, w13, w2, weights, ids, *shared)


def experts_fp8(
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
    *,
    defer: bool = False,
) -> torch.Tensor | PendingCombine:
    """`experts` with block-FP8 expert weights, as W8A8 (DeepSeek-V3 / vLLM block FP8): x, and the SwiGLU
    output act (rounded to x's dtype), are quantised to e4m3 per token and per `block[1]` channels, and each
    K block's e4m3 product is scaled by the token's and the weight block's scales and summed in fp32.

    Args:
        x: [T, H] tokens (fp16, bf16 or fp32).
        w13: [E, 2I, H] float8_e4m3fn, stacked gate (first I rows) and up (last I rows) projections.
        w13_scale: [E, 2 * ceil(I/bn), ceil(H/bk)] fp32 block multipliers: the gate half's row blocks, then
            the up half's (the stacked block scale of gate_proj and up_proj when bn divides I).
        w2: [E, H, I] float8_e4m3fn down projections.
        w2_scale: [E, ceil(H/bn), ceil(I/bk)] fp32.
        weights, ids: [T, S] routing weights and routed expert ids (no shared-expert slot).
        block: (bn, bk) rows and columns of a weight scale block; bk is also the activation group.
        shared_out, shared_gate: [T, H] and [T], the shared expert run elsewhere (FP8 `Fp8Linear`s) and its
            weight, added as shared_gate * shared_out.
        xq: x quantised per token and bk channels by the op that produced it (ignored if its group differs).
        defer: as `experts`.
    Returns:
        [T, H] in x's dtype, or with `defer` possibly a `PendingCombine` of it.
    """
    args = (x, w13, w13_scale, w2, w2_scale, weights, ids, block, shared_out, shared_gate, xq)
    with deferred(defer):
        return dispatch.pick("moe_experts_fp8", x)(*args)


def align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair ids grouped by expert, each expert's run padded to `block_m` rows; see
    `reference.align_block_size` for the outputs."""
    return dispatch.pick("moe_align_block_size", ids)(ids, num_experts, block_m)
