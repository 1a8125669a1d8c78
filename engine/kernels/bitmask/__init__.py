"""A grammar's token mask applied to a step's logits on the device (constrained decoding)."""

import torch

from engine.kernels import dispatch
from engine.kernels.bitmask import reference

dispatch.register(
    "apply_token_bitmask",
    torch=reference.apply_token_bitmask,
    triton="engine.kernels.bitmask.triton:apply_token_bitmask",
)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set `logits[r, t]` to -inf, in place, for each row r in `rows` and each token t < V whose bit is 0
    in `bitmask[r]`.

    Args:
        logits: [R, V] float, the last dimension contiguous.
        bitmask: [>= R, ceil(V / 32)] int32 on the logits' device: bit t % 32 of word t // 32 is token t
            (llguidance's and xgrammar's layout).
        rows: [n] int64 on the logits' device, distinct.
    """
    dispatch.pick("apply_token_bitmask", logits)(logits, bitmask, rows)
