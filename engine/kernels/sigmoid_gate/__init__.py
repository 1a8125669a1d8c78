"""The gated attention's output gate: `x * sigmoid(gate)`."""

import torch

from engine.kernels import dispatch
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.sigmoid_gate import reference

dispatch.register(
    "sigmoid_gate", torch=reference.sigmoid_gate, triton="engine.kernels.sigmoid_gate.triton:sigmoid_gate"
)
dispatch.register(
    "sigmoid_gate_fp8",
    torch=reference.sigmoid_gate_fp8,
    triton="engine.kernels.sigmoid_gate.triton:sigmoid_gate_fp8",
)


def quantises(head_dim: int, group: int) -> bool:
    """Whether `sigmoid_gate_fp8` takes scale groups of `group` channels: a power of two dividing D."""
    return group > 0 and head_dim % group == 0 and group & (group - 1) == 0


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(gate)` for x, gate [T, H, D] (gate with any token and head strides: it is read in place
    from the projection output); contiguous [T, H, D] in x's dtype."""
    return dispatch.pick("sigmoid_gate", x)(x, gate)


def sigmoid_gate_fp8(x: torch.Tensor, gate: torch.Tensor, group: int) -> tuple[torch.Tensor, Fp8Activation]:
    """`sigmoid_gate`, with its output [T, H * D] also quantised per token and `group` channels for the FP8
    o_proj that reads it (`group` a power of two dividing D), in the same kernel.

    Returns:
        (out, xq): `sigmoid_gate`'s output, and `xq` as `quantize_fp8_per_token_group` gives it.
    """
    return dispatch.pick("sigmoid_gate_fp8", x)(x, gate, group)
