"""The Triton grammar mask against the torch reference and a bit-by-bit check, over vocabularies that end
inside a bitmask word and a program's block, rows masked out of order, and logits rows inside a wider
tensor."""

import pytest
import torch

from engine.kernels.bitmask import reference
from engine.kernels.bitmask.triton import BLOCK_V, apply_token_bitmask
from tests.engine.kernels.cases import crossed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(rows: int, vocab: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, vocab + 5, generator=g).to(dtype=dtype, device=DEVICE)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (rows + 2, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # every token allowed
    bitmask[-1] = 0  # none (a row past the logits': never read)
    return wide, wide[:, :vocab], bitmask.to(DEVICE)  # each logits row inside a wider one


@pytest.mark.parametrize(
    "vocab, dtype, rows",
    crossed([1, 31, 33, 1000, BLOCK_V + 7], [torch.float32, torch.float16, torch.bfloat16], [1, 3, 6]),
)
def test_apply_token_bitmask(vocab, dtype, rows):
    wide, logits, bitmask = inputs(rows, vocab, dtype, seed=vocab + rows)
    expected = logits.clone()
    picked = torch.tensor([r for r in (rows - 1, 0, 2) if r < rows], dtype=torch.long, device=DEVICE)
    picked = picked.unique()[torch.randperm(picked.unique().numel())]  # distinct, in any order
    reference.apply_token_bitmask(expected, bitmask, picked)
    before = wide.clone()
    apply_token_bitmask(logits, bitmask, picked)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert torch.equal(wide[:, vocab:], before[:, vocab:])  # nothing past the vocabulary written
    # Bit by bit, independently of both: a masked row's token t is -inf exactly when its bit is 0.
    words = bitmask.cpu().to(torch.int64) & 0xFFFFFFFF
    masked = picked.tolist()
    got, was = logits.cpu().float(), before.cpu().float()
    for r in range(rows):
        for t in range(vocab):
            refused = r in masked and not (words[r, t // 32] >> (t % 32)) & 1
            assert got[r, t] == (float("-inf") if refused else was[r, t]), (r, t)


def test_no_rows_is_a_no_op():
    _, logits, bitmask = inputs(2, 40, torch.float32, seed=0)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert torch.equal(logits, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_token_bitmask_real_vocab_on_gpu():
    # Qwen3.5's vocabulary at batch 256, every row masked.
    _, logits, bitmask = inputs(256, 248_320, torch.float32, seed=1)
    expected = logits.clone()
    rows = torch.arange(256, device="cuda")
    reference.apply_token_bitmask(expected, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
