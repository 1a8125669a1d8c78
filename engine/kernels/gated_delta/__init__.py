"""Gated delta rule (the core of Gated DeltaNet linear attention) over a flat variable-length batch."""

import torch

from engine.kernels import dispatch
from engine.kernels.gated_delta import reference
from engine.kernels.layout import SeqLayout

dispatch.register(
    "gated_delta_rule",
    torch=reference.gated_delta_rule,
    triton="engine.kernels.gated_delta.triton:gated_delta_rule",
)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: SeqLayout,
) -> torch.Tensor:
    """Run the recurrence for each sequence from its slot's state (or zeros when it has no context).

    Args:
        q, k: [T, Hk, dk] raw queries and keys; l2-normalised (and q scaled by dk^-0.5) inside.
        v: [T, Hv, dv] values; value head j uses key head j // (Hv // Hk).
        g: [T, Hv] log decay (<= 0), fp32.
        beta: [T, Hv] write strength in (0, 1).
        state: [S, Hv, dk, dv] recurrent state per slot, updated in place: fp32, or a 16-bit dtype the
            recurrence rounds to after every token (a long sequence's chunked form once, at the end).
        layout: where each sequence's tokens and slot are.
    Returns:
        [T, Hv, dv] in v's dtype.
    """
    return dispatch.pick("gated_delta_rule", q)(q, k, v, g, beta, state, layout)
