"""SwiGLU's activation: `silu(gate) * up` of a fused [gate | up] projection output."""

import torch

from engine.kernels import dispatch
from engine.kernels.swiglu import reference

dispatch.register("swiglu", torch=reference.swiglu, triton="engine.kernels.swiglu.triton:swiglu")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for x [..., 2I] (rows of any stride; the last dim contiguous) ->
    contiguous [..., I] in x's dtype."""
    return dispatch.pick("swiglu", x)(x)
