"""Sampling on the device: temperature, top-k and top-p, then the exponential race."""

import torch

from engine.kernels import dispatch
from engine.kernels.sampling import reference

# Rows from which the kernel runs under ENCLAVE_KERNELS=auto. H200, V 248,320, fp32 logits, graphed
# (`benchmarks/kernels_sampling.py`, 2026-11-30): B=1 697-1,140 us against torch's 280-322; B=16 0.7-1.5x
# torch by request mix; B=64 1.5-3.4x faster; B=256 2.5-5.6x.
MIN_KERNEL_ROWS = 64

dispatch.register(
    "sample_filtered",
    torch=reference.sample_filtered,
    triton="engine.kernels.sampling.triton:sample_filtered",
)


def sample_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    race: torch.Tensor,
) -> torch.Tensor:
    """One token per row drawn from softmax(logits / T) restricted by top-k then top-p.

    Args:
        logits: [B, V], any float dtype (rows of any stride, the last dim contiguous).
        temperature: [B] fp32, > 0 (greedy rows are the caller's business).
        top_k: [B] int32/int64; <= 0 or >= V: no top-k limit. Ties with the k-th value stay.
        top_p: [B] fp32; >= 1: no top-p limit. Over what top-k kept, a token is dropped once the tokens
            ranked above it (value descending, then index) cover top_p; the first always stays.
        race: [B, V] fp32 Exp(1) noise, drawn by the caller from each request's generator.
    Returns:
        ids [B] int64: argmax over the kept tokens of p / race, an exact draw from the filtered p.
    """
    sample = dispatch.pick("sample_filtered", logits)
    if logits.shape[0] < MIN_KERNEL_ROWS and dispatch.backend() == "auto":
        sample = reference.sample_filtered  # few rows: one program per row is slower than torch's sort
        dispatch.choose("sample_filtered", "torch")
    return sample(logits, temperature, top_k, top_p, race)
