"""A grammar's token mask applied to a step's logits on the device (constrained decoding)."""

import torch

from engine.kernels import dispatch
from engine.kernels.bitmask import reference

# A kernel graduates into the CUDA path once it has run on a GPU (docs/ARCHITECTURE.md, section 11): until
# `test_apply_token_bitmask_real_vocab_on_gpu` has passed on the H200, ENCLAVE_KERNELS=auto keeps the
# reference there and only ENCLAVE_KERNELS=triton runs the kernel.
ON_CUDA_BY_DEFAULT = False

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
    apply = dispatch.pick("apply_token_bitmask", logits)
    if logits.is_cuda and dispatch.backend() == "auto" and not ON_CUDA_BY_DEFAULT:
        apply = reference.apply_token_bitmask
        dispatch.choose("apply_token_bitmask", "torch")
    apply(logits, bitmask, rows)
