"""The Gated DeltaNet's per-head gates: write strength beta and log decay g, from the b and a projections."""

import torch

from engine.kernels import dispatch
from engine.kernels.deltanet_gate import reference

dispatch.register(
    "deltanet_gate", torch=reference.deltanet_gate, triton="engine.kernels.deltanet_gate.triton:deltanet_gate"
)


def deltanet_gate(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`g = -exp(A_log) * softplus(a + dt_bias)` in fp32 and `beta = sigmoid(b)`, in one pass.

    Args:
        a, b: [T, Hv] projections (any token stride: column slices of `in_proj_ba`'s output).
        a_log: [Hv] log decay rate per value head (`A_log`).
        dt_bias: [Hv] bias of the decay's time step.
    Returns:
        (g, beta): contiguous [T, Hv]; g fp32 (<= 0), beta in b's dtype.
    """
    return dispatch.pick("deltanet_gate", a)(a, b, a_log, dt_bias)
