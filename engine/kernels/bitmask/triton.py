"""Triton grammar mask: one launch sets every refused token's logit to -inf.

One program per (masked row, block of BLOCK_V tokens): it reads the row's bitmask words and stores -inf
where a bit is 0, never reading the logits. The reference unpacks the bitmask into a [rows, V] byte tensor
in chunks of 32 rows, about ten launches a chunk (80 at 256 rows).
"""

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # tokens per program: 128 bitmask words


@triton.jit
def _apply_token_bitmask_kernel(
    logits,  # [R, V], last dim contiguous
    bitmask,  # [>= R, W] int32, contiguous
    rows,  # [n] int64: the rows to mask
    stride_l,
    V,
    W,
    BLOCK_V: tl.constexpr,
):
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    t = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = t < V
    words = tl.load(bitmask + row * W + t // 32, mask=in_vocab, other=-1)  # a word per token (cached)
    refused = ((words >> (t % 32)) & 1) == 0
    tl.store(logits + row * stride_l + t, float("-inf"), mask=in_vocab & refused)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    # logits [R, V] float; bitmask [>= R, W] int32; rows [n] int64, all on one device.
    n, (_, vocab) = rows.shape[0], logits.shape
    if n == 0 or vocab == 0:
        return
    if logits.stride(-1) != 1:
        raise ValueError("the logits' last dimension must be contiguous")
    bitmask = bitmask.contiguous()
    grid = (n, triton.cdiv(vocab, BLOCK_V))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows, logits.stride(0), vocab, bitmask.shape[1], BLOCK_V=BLOCK_V
    )
