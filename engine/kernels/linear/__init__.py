"""Dense linear `x @ weight.T (+ bias)`: a weight-streaming Triton kernel for a few tokens, cuBLAS above."""

import torch

from engine.kernels import dispatch
from engine.kernels.linear import reference

dispatch.register("linear", torch=reference.linear, triton="engine.kernels.linear.triton:linear")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear`, with decode-sized batches (up to `triton.MAX_ROWS` tokens) on a kernel
    that reads the weight once at memory bandwidth.

    Args:
        x: [..., K] activations, fp16, bf16 or fp32.
        weight: [N, K] of x's dtype.
        bias: optional [N] of x's dtype.
    Returns:
        [..., N] in x's dtype.
    """
    return dispatch.pick("linear", x)(x, weight, bias)
