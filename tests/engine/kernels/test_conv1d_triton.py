"""The Triton causal conv1d against the reference, over decode, verify, prefill and mixed layouts.

States start NaN-filled: slots of sequences without context must be ignored, and any slot the op should
have written but did not stays NaN and fails the comparison.
"""

import pytest
import torch

from engine.kernels import SeqLayout
from engine.kernels.conv1d import reference
from engine.kernels.conv1d.triton import causal_conv1d
from tests.engine.kernels.cases import crossed

NAN = float("nan")
# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Both sides sum the same K fp32 products, in different orders: a few fp32 ulps, and at most one ulp of
# fp16 in the output. States are copies of inputs: exact.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def start_state(layout: SeqLayout, slots: int, c: int, km1: int, seed: int, dtype, device=DEVICE):
    """[S, C, K-1]: random in the slots of sequences with context, NaN everywhere else."""
    state = torch.full((slots, c, km1), NAN, dtype=dtype, device=device)
    for slot, ctx in zip(layout.slots, layout.context_lens, strict=True):
        if ctx > 0:
            state[slot] = rand(c, km1, seed=seed + slot, dtype=dtype, device=device)
    return state


def check(layout: SeqLayout, c: int, k: int, slots: int, dtype, activation=True, seed=0, strided=False):
    t = layout.num_tokens
    x = rand(t, c + 5, seed=seed, dtype=dtype)
    x = x[:, 2 : 2 + c] if strided else x[:, :c].contiguous()  # the model's qkv is a slice of a wider row
    w = rand(c, k, seed=seed + 1, dtype=dtype)
    state = start_state(layout, slots, c, k - 1, seed + 2, dtype)
    ref_state = state.clone()
    out = causal_conv1d(x, w, state, layout, activation)
    expected = reference.causal_conv1d(x, w, ref_state, layout, activation)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [2, 4])
def test_decode(k, dtype):
    # one token each; slot 3 without context holds NaN garbage
    layout = SeqLayout((1, 1, 1, 1), (5, 1, 0, 2), (4, 0, 3, 1))
    check(layout, c=37, k=k, slots=6, dtype=dtype, seed=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [2, 4])
def test_verify_keeps_every_token_state(k, dtype):
    # per-token states into scratch slots (the home slot last), mixed with a plain decode; one verify
    # sequence of a single token (fewer than K-1) and one without context
    layout = SeqLayout(
        (3, 1, 2, 1),
        (5, 2, 0, 7),
        (0, 1, 2, 3),
        state_out=((4, 5, 0), (), (6, 2), (3,)),
    )
    check(layout, c=19, k=k, slots=8, dtype=dtype, seed=10 + k)


# Every chunk length with both conv widths (the window straddles the cached state for n < K - 1), dtype in
# turn, every pair of values meeting (cases.crossed).
@pytest.mark.parametrize(
    "n, k, dtype", crossed([1, 2, 3, 63, 65, 130], [2, 4], [torch.float32, torch.float16])
)
def test_prefill(n, k, dtype):
    # a fresh prompt (NaN slot) and a chunk continuing a cached one, in one batch
    layout = SeqLayout((n, n), (0, 9), (2, 0))
    check(layout, c=37, k=k, slots=3, dtype=dtype, seed=n)


@pytest.mark.parametrize("k", [2, 4])
def test_mixed_batch_strided_input_and_many_channel_blocks(k):
    # long and short sequences together (several tiles and channel blocks), without activation
    layout = SeqLayout((70, 1, 2, 33, 5), (0, 4, 1, 3, 0), (1, 4, 0, 2, 3))
    check(layout, c=300, k=k, slots=5, dtype=torch.float32, seed=k, strided=True)
    check(layout, c=300, k=k, slots=5, dtype=torch.float32, seed=k, activation=False)


def test_decodes_beside_a_long_prompt():
    # short and long sequences take separate launches (tiles of their own length); interleaved in the batch
    layout = SeqLayout((1, 40, 1, 1, 3, 70), (5, 0, 1, 9, 2, 4), (0, 1, 2, 3, 4, 5))
    check(layout, c=70, k=4, slots=6, dtype=torch.float16, seed=3)


def test_short_chunks_carry_the_state_like_one_prefill():
    # tokens fed 5, then 1, 2 and 1 at a time end with the output and state of one 9-token prefill
    c, k = 11, 4
    x, w = rand(9, c, seed=1), rand(c, k, seed=2)
    state = torch.full((2, c, k - 1), NAN, device=DEVICE)
    full_state = state.clone()
    full = causal_conv1d(x, w, full_state, SeqLayout((9,), (0,), (1,)))
    outs, done = [], 0
    for n in (5, 1, 2, 1):
        outs.append(causal_conv1d(x[done : done + n], w, state, SeqLayout((n,), (done,), (1,))))
        done += n
    torch.testing.assert_close(torch.cat(outs), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state[1], full_state[1])


def test_long_verify_is_refused_like_the_reference():
    layout = SeqLayout((9,), (3,), (0,), state_out=(tuple(range(1, 10)),))
    with pytest.raises(ValueError, match="per-position states"):
        causal_conv1d(torch.zeros(9, 4), torch.zeros(4, 4), torch.zeros(10, 4, 3), layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "layout",
    [
        SeqLayout((1,) * 64, tuple(range(64)), tuple(range(64))),  # decode; slot 0 has no context
        SeqLayout((4,) * 16, (20,) * 16, tuple(range(16))),  # short chunks, final states only
        SeqLayout(
            (4,) * 16,
            (20,) * 16,
            tuple(range(16)),
            state_out=tuple((*range(16 + 3 * i, 19 + 3 * i), i) for i in range(16)),
        ),  # MTP verify, 3 scratch slots + home per sequence
        SeqLayout((2000, 1, 3, 517), (0, 40, 7, 1024), (0, 1, 2, 3)),  # prefill, chunk and decodes
        # a server's mixed step: decodes beside a prompt's chunk (two launches, short and long tiles)
        SeqLayout((*(1,) * 63, 1024), (*range(1, 64), 0), tuple(range(64))),
    ],
)
def test_real_shapes_bf16(layout):
    # Qwen3.5-35B-A3B: conv over q, k, v = 2048 + 2048 + 4096 channels, kernel 4, bf16 activations.
    c, k, slots = 8192, 4, 64
    x = rand(layout.num_tokens, c, seed=1, dtype=torch.bfloat16, device="cuda")
    w = rand(c, k, seed=2, dtype=torch.bfloat16, device="cuda") * 0.5
    state = start_state(layout, slots, c, k - 1, seed=3, dtype=torch.bfloat16, device="cuda")
    ref_state = state.float()
    out = causal_conv1d(x, w, state, layout)
    expected = reference.causal_conv1d(x.float(), w.float(), ref_state, layout)
    # bf16 output: one rounding of an fp32 sum (relative 2^-8), plus fp32 summation-order noise
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    # the state holds bf16 inputs, exact in fp32
    torch.testing.assert_close(state.float(), ref_state, rtol=0, atol=0, equal_nan=True)
