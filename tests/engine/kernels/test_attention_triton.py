"""The Triton paged attention against the torch reference (Triton's interpreter on the CPU, the GPU if any).

Caches start as NaN except the context rows, so a stale row that leaks into an output shows up. Short
sequences (at most 8 new tokens) take the decode/verify kernel, longer ones the prefill kernel.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from engine.env import reset_engine_env
from engine.kernels import SeqLayout, dispatch
from engine.kernels.attention import reference
from engine.kernels.attention import triton as attention_triton
from tests.engine.kernels.cases import crossed

NAN = float("nan")
# fp32: the kernel and SDPA differ only in summation order. fp16: the kernel rounds the softmax weights to
# fp16 before the value product (as flash attention does); SDPA keeps them wider.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(
    query_lens, context_lens, *, hq, hkv, d, block_size, dtype=torch.float32, seed=0, device=DEVICE
):
    """Inputs over a NaN-filled pool whose blocks are handed out shuffled (block tables are not runs)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables, at = [], 0
    for k in need:
        tables.append(tuple(pool[at : at + k]))
        at += k
    layout = SeqLayout(
        query_lens=tuple(query_lens),
        context_lens=tuple(context_lens),
        slots=tuple(range(len(query_lens))),
        block_tables=tuple(tables),
        block_size=block_size,
    )
    t = layout.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k_cache = torch.full((num_blocks, block_size, hkv, d), NAN, dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, NAN)
    for i, c in enumerate(context_lens):
        rows = torch.tensor(layout.kv_index(list(range(c)), i), dtype=torch.long, device=device)
        k_cache.view(-1, hkv, d)[rows] = rand(c, hkv, d)
        v_cache.view(-1, hkv, d)[rows] = rand(c, hkv, d)
    return rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d), k_cache, v_cache, layout


def check(case, dtype, **kwargs):
    """Run both implementations on copies of the caches; outputs and written caches must agree."""
    q, k, v, k_cache, v_cache, layout = case
    scale = q.shape[-1] ** -0.5
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    expected = reference.attention(q, k, v, kc_ref, vc_ref, layout, scale)
    with pytest.MonkeyPatch.context() as mp:  # the Triton path must not fall back to SDPA
        mp.setattr(F, "scaled_dot_product_attention", _no_sdpa)
        got = attention_triton.paged_attention(q, k, v, k_cache, v_cache, layout, scale, **kwargs)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **TOL[dtype])
    torch.testing.assert_close(k_cache, kc_ref, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, vc_ref, equal_nan=True, rtol=0, atol=0)


def _no_sdpa(*args, **kwargs):
    raise AssertionError("the Triton attention called torch's SDPA")


HEADS = [(2, 2, 32), (3, 1, 16), (6, 2, 16)]  # (Hq, Hkv, D): GQA ratios 1, 3 (odd head counts), 3
F32, F16 = torch.float32, torch.float16


# Heads (GROUP, HEAD_DIM) with the cache block size (KV_BLOCK), dtype (dot precision, the rounding of the
# softmax weights) in turn: every pair of values meets (cases.crossed); the 12 combinations add no path.
@pytest.mark.parametrize("heads, block_size, dtype", crossed(HEADS, [4, 16], [F32, F16]))
def test_decode_over_contexts(dtype, heads, block_size):
    hq, hkv, d = heads
    case = make_case((1, 1, 1, 1), (0, 1, 37, 200), hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype)
    check(case, dtype, block_n=16)


# Each dtype and block size once (their pairs, and with the heads: test_decode_over_contexts).
@pytest.mark.parametrize("dtype, block_size", [(F32, 4), (F16, 16)])
def test_verify_steps_and_decodes(dtype, block_size):
    # MTP verify steps of 4 tokens beside decodes and the longest short step (8 tokens)
    case = make_case(
        (4, 4, 1, 4, 8, 4), (0, 1, 5, 37, 3, 200), hq=6, hkv=2, d=16, block_size=block_size, dtype=dtype
    )
    check(case, dtype, block_n=16)


def test_mixed_decode_and_prefill():
    # 20 and 9 new tokens go through the prefill kernel, the rest through the decode/verify kernel, into
    # one output (each kernel's dtypes: the tests above and below)
    case = make_case((1, 20, 4, 9, 1), (37, 0, 5, 30, 0), hq=6, hkv=2, d=16, block_size=4, dtype=F16)
    check(case, F16, block_n=16)


def test_mixed_with_split_kv_and_long_prefill():
    # a split decode over a long context beside prefill chunks of several tiles, default tiling
    case = make_case((1, 130, 4, 65), (700, 200, 3, 0), hq=6, hkv=2, d=16, block_size=16, seed=3)
    check(case, torch.float32, num_splits=4)


def test_prefill_only_layout():
    case = make_case((12, 30), (0, 7), hq=3, hkv=1, d=16, block_size=4)
    check(case, torch.float32)


@pytest.mark.parametrize("context", [0, 37])
@pytest.mark.parametrize("n", [9, 63, 65, 130])
def test_prefill_chunk_lengths(n, context):
    # 32-token tiles over 16-key blocks: tile edges fall inside and on cache blocks, the diagonal spans
    # key blocks. One partial tile (9), a last tile one row short (63) and one row long (65), several
    # tiles (130).
    case = make_case((n,), (context,), hq=3, hkv=1, d=16, block_size=4, seed=n + context)
    check(case, torch.float32, block_m=32, block_n=16)


# GQA 1 or 3 with the cache block size, dtype in turn: every pair of values meets (the prefill constexprs).
@pytest.mark.parametrize("heads, block_size, dtype", crossed([(2, 2, 32), (6, 2, 16)], [4, 16], [F32, F16]))
def test_prefill_batch(dtype, heads, block_size):
    hq, hkv, d = heads
    case = make_case((65, 130, 9), (0, 50, 3), hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype)
    check(case, dtype, block_m=32, block_n=16)


@pytest.mark.parametrize("block_m, block_n", [(16, 64), (64, 16), (None, None)])
def test_prefill_tilings(block_m, block_n):
    # keys blocks wider and narrower than query tiles; None: the tiles the wrapper picks (64 x 64). 130
    # tokens: three tiles of 64 rows, the last one partial.
    case = make_case((130, 63), (20, 0), hq=3, hkv=1, d=16, block_size=16, seed=7)
    check(case, torch.float32, block_m=block_m, block_n=block_n)


# 3 splits: slices of uneven length; 8: empty ones. Both merge into fp32 and fp16 outputs. One split (no
# merge) is the decode tests' path.
@pytest.mark.parametrize("num_splits, dtype", [(3, F32), (8, F16), (8, F32)])
def test_split_kv_forced(num_splits, dtype):
    # 8 slices of 16 keys leave the short contexts with empty slices, and verify rows with no visible key
    case = make_case((1, 4, 1, 4, 1), (0, 1, 37, 30, 200), hq=6, hkv=2, d=16, block_size=4, dtype=dtype)
    check(case, dtype, num_splits=num_splits, block_n=16)


def test_split_kv_chosen_for_a_long_context():
    assert attention_triton._num_splits(2, 128 * 1024, torch.device("cpu")) > 1  # batch 1, 2 kv heads
    assert attention_triton._num_splits(2, 500, torch.device("cpu")) == 1  # short context
    assert attention_triton._num_splits(1024, 128 * 1024, torch.device("cpu")) == 1  # grid already full
    case = make_case((1,), (2500,), hq=2, hkv=1, d=16, block_size=16)
    assert attention_triton._num_splits(1, 2501, torch.device("cpu")) > 1
    check(case, torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 3, 65])
def test_odd_token_counts(num_tokens):
    lens = [8] * (num_tokens // 8) + [1] * (num_tokens % 8)
    contexts = [(7 * i) % 23 for i in range(len(lens))]
    case = make_case(lens, contexts, hq=3, hkv=1, d=16, block_size=4, seed=num_tokens)
    check(case, torch.float32, block_n=16)


def test_strided_inputs_and_dispatch(monkeypatch):
    # q, k, v as views into wider projections, as the model slices them
    q, k, v, k_cache, v_cache, layout = make_case((1, 4), (9, 3), hq=2, hkv=2, d=16, block_size=4)
    q = torch.cat((q, torch.zeros_like(q)), -1)[..., :16]
    kv = torch.cat((k, v), 1)
    k, v = kv[:, :2], kv[:, 2:]
    check((q, k, v, k_cache, v_cache, layout), torch.float32)
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    reset_engine_env()  # the kernels above read the engine's variables (once)
    assert dispatch.pick("attention", q) is attention_triton.attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ((1,) * 64, tuple((97 * i) % 4000 for i in range(64))),  # decode batch
        ((4,) * 16, tuple(300 * i for i in range(16))),  # MTP verify
        ((1,), (128 * 1024,)),  # one long context: split-KV
        ((4, 4), (30000, 17)),  # verify over a long context: split-KV
        ((8, 8, 1), (5000, 3, 100)),  # the longest verify step: a 64-row tile
        ((1, 300, 4, 1), (5000, 0, 12, 1)),  # decodes, a prefill chunk, a verify step
        ((8192,), (0,)),  # the first chunk of a long prompt
        ((2000, 9), (14000, 0)),  # a later chunk over a long context, a short prompt
        ((1, 1, 4, 1000, 63), (900, 20000, 40, 3000, 5)),  # decodes, verify, two chunks
    ],
)
def test_real_shapes_bf16(query_lens, context_lens):
    """Qwen3.5-35B-A3B attention (16 q heads, 2 kv heads, head dim 256, blocks of 16) in bf16 against the
    reference in fp32 on the same inputs."""
    q, k, v, k_cache, v_cache, layout = make_case(
        query_lens, context_lens, hq=16, hkv=2, d=256, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    scale = 256**-0.5
    kc32, vc32 = k_cache.float(), v_cache.float()
    expected = reference.attention(q.float(), k.float(), v.float(), kc32, vc32, layout, scale)
    got = attention_triton.attention(q, k, v, k_cache, v_cache, layout, scale)
    # bf16 keeps 8 bits: inputs, softmax weights and output are each rounded once (~4e-3 relative each).
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(k_cache.float(), kc32, equal_nan=True, rtol=0, atol=0)


def test_prefill_kernel_switched_off_uses_the_reference_for_long_sequences(monkeypatch):
    """ENCLAVE_TRITON_PREFILL=0 sends prefill chunks to the SDPA reference (decode stays on the kernel)."""
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "0")
    q, k, v, k_cache, v_cache, layout = make_case(
        (1, 20, 4, 9), (37, 0, 5, 30), hq=6, hkv=2, d=16, block_size=4, dtype=torch.float32
    )
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    expected = reference.attention(q, k, v, kc_ref, vc_ref, layout, 0.25)
    calls = []
    real = reference.long_sequences
    monkeypatch.setattr(reference, "long_sequences", lambda *a: calls.append(1) or real(*a))
    got = attention_triton.paged_attention(q, k, v, k_cache, v_cache, layout, 0.25)
    assert calls == [1]
    torch.testing.assert_close(got, expected, **TOL[torch.float32])
