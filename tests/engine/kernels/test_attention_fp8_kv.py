"""The FP8 KV cache (e4m3, an fp32 scale per position and kv head): its storage rule, the torch reference
reading it, and the Triton decode, verify, split-KV and prefill paths against that reference.

Caches start as NaN except the context rows (their scales too), so a stale row that leaks shows up.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.env import reset_engine_env
from engine.kernels.attention import fp8_kv, reference
from engine.kernels.attention import triton as attention_triton
from tests.engine.kernels.test_attention_triton import _no_sdpa, make_case

FP8, NAN = torch.float8_e4m3fn, float("nan")
# The kernel scales score columns after the QK product and SDPA dequantises the keys first: in fp32 they
# differ by summation order and one rounding, as the fp32 cache's comparison does.
TOL = dict(rtol=1e-5, atol=1e-5)


def fp8_case(*args, **kwargs):
    """`make_case`'s inputs with the caches quantised to e4m3 and their scales (NaN rows stay NaN)."""
    q, k, v, k_cache, v_cache, layout = make_case(*args, **kwargs)
    (k8, ks), (v8, vs) = fp8_kv.quantize(k_cache), fp8_kv.quantize(v_cache)
    return q, k, v, k8, v8, ks, vs, layout


def check(case, **kwargs):
    q, k, v, k8, v8, ks, vs, layout = case
    scale = q.shape[-1] ** -0.5
    ref = [t.clone() for t in (k8, v8, ks, vs)]
    expected = reference.attention(q, k, v, ref[0], ref[1], layout, scale, ref[2], ref[3])
    with pytest.MonkeyPatch.context() as mp:  # the Triton path must not fall back to SDPA
        mp.setattr(F, "scaled_dot_product_attention", _no_sdpa)
        got = attention_triton.paged_attention(
            q, k, v, k8, v8, layout, scale, k_scale=ks, v_scale=vs, **kwargs
        )
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **TOL)
    for mine, theirs in zip((k8, v8, ks, vs), ref, strict=True):  # the same rows and scales written
        torch.testing.assert_close(mine.float(), theirs.float(), equal_nan=True, rtol=0, atol=0)


def test_quantize_round_trip_error_and_no_overflow():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-6, 6, 64)[:, None, None]  # 1e-6 .. 1e6
    x[0] = 0.0
    q, s = fp8_kv.quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4) and s.dtype == torch.float32
    back = fp8_kv.dequantize(q, s, torch.float32)
    assert back.isfinite().all() and (back[0] == 0).all()
    # The largest value maps to 448, whose binade [256, 448] is spaced 32 apart: rounding moves a value by
    # at most 16 units of the scale, amax / 28.
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= amax / 28 * (1 + 1e-6)).all()


def test_triton_write_rounds_as_torch_casts():
    """The one-launch write against `fp8_kv.write`: every e4m3 value, every midpoint between two (ties go
    to even), random values over five decades, a strided value view; the same bytes but for zero's sign."""
    g = torch.Generator().manual_seed(1)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    x = torch.cat(
        [grid, (grid[1:] + grid[:-1]) / 2, torch.randn(2000, generator=g) * torch.logspace(-3, 2, 2000)]
    )
    rows = x[: x.numel() // 32 * 32].view(-1, 1, 32).clone()
    rows[:, 0, 0] = 448.0  # scale 1: the grid and its midpoints are quantised as they are
    t = rows.shape[0]
    wide = torch.randn(t, 3, 32, generator=g) * 50
    v = wide[:, 1:2]  # [T, 1, 32] with a token stride of 96
    written = torch.randperm(t + 5, generator=g)[:t]
    caches = [torch.full((t + 5, 1, 1, 32), NAN).to(FP8) for _ in range(4)]
    scales = [torch.full((t + 5, 1, 1), NAN) for _ in range(4)]
    fp8_kv.write(rows, v, caches[0], caches[1], written, scales[0], scales[1])
    attention_triton.write_fp8(rows, v, caches[2], caches[3], scales[2], scales[3], written)
    for mine, theirs in (
        (caches[2], caches[0]),
        (caches[3], caches[1]),
        (scales[2], scales[0]),
        (scales[3], scales[1]),
    ):
        torch.testing.assert_close(mine.float(), theirs.float(), equal_nan=True, rtol=0, atol=0)


def test_reference_reads_the_fp8_cache_as_its_dequantised_values():
    """The FP8 reference equals the plain reference over an fp32 cache holding the dequantised rows."""
    q, k, v, k8, v8, ks, vs, layout = fp8_case([1, 3, 20], [9, 5, 0], hq=4, hkv=2, d=16, block_size=4)
    scale = 0.25
    got = reference.attention(q, k, v, k8, v8, layout, scale, ks, vs)
    (k8n, ksn), (v8n, vsn) = fp8_kv.quantize(k), fp8_kv.quantize(v)  # what the new rows become
    kd, vd = fp8_kv.dequantize(k8, ks, torch.float32), fp8_kv.dequantize(v8, vs, torch.float32)
    expected = reference.attention(
        q, fp8_kv.dequantize(k8n, ksn, q.dtype), fp8_kv.dequantize(v8n, vsn, q.dtype), kd, vd, layout, scale
    )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "heads"),
    [
        ([1, 1, 1], [0, 7, 33], (2, 2, 32)),  # decode
        ([3, 2], [5, 17], (6, 2, 16)),  # MTP verify, GQA 3
        ([20], [0], (3, 1, 16)),  # a prefill chunk from position 0
        ([1, 24, 4], [40, 9, 3], (4, 2, 16)),  # mixed: decode, prefill after a context, verify
    ],
)
def test_triton_matches_reference_on_an_fp8_cache(query_lens, context_lens, heads):
    hq, hkv, d = heads
    check(fp8_case(query_lens, context_lens, hq=hq, hkv=hkv, d=d, block_size=4), block_n=16, block_m=16)


def test_split_kv_decode_matches_reference_on_an_fp8_cache():
    check(fp8_case([1, 2], [70, 45], hq=4, hkv=2, d=16, block_size=8), num_splits=3, block_n=16)


@pytest.mark.parametrize("threshold, once", [(1, True), (10**9, False)])
def test_packed_prefill_reads_a_long_context_through_a_copy_dequantised_once(monkeypatch, threshold, once):
    """From COPY_ONCE_CONTEXT positions of context the packed kernel reads the step's blocks from a copy
    dequantised as the reference reads them (then as from a cache in q's dtype); below it, it dequantises
    its tiles itself. Both against the reference; the FP8 cache itself is left as written."""
    calls = []
    real = attention_triton._dequantised
    monkeypatch.setattr(attention_triton, "COPY_ONCE_CONTEXT", threshold)
    monkeypatch.setattr(attention_triton, "_COPY_SLICE", 3)  # several slices of blocks
    monkeypatch.setattr(attention_triton, "_dequantised", lambda *a: calls.append(1) or real(*a))
    # Two prompt chunks after contexts (one block shared by neither), beside a decode and a verify step.
    case = fp8_case([1, 24, 4, 13], [40, 9, 3, 22], hq=4, hkv=2, d=16, block_size=4)
    check(case, block_n=16, block_m=16, prefill_kernel="packed")
    assert calls == ([1] if once else [])


@pytest.mark.parametrize("block_size, block_n", [(4, 16), (16, 16), (32, 16)])
def test_e4m3_products_over_a_long_context_read_values_transposed_once(monkeypatch, block_size, block_n):
    """From COPY_ONCE_CONTEXT positions of context, e4m3 products read the step's blocks from a gathered
    copy whose values are transposed per block ([D, positions]: K-major for Hopper's e4m3 PV product): the
    same numbers as reading the cache in place, bit for bit, with key tiles spanning cache blocks (4) and
    lying in one (16: a whole block; 32: part of one)."""
    calls = []
    real = attention_triton._fp8_gathered
    monkeypatch.setattr(attention_triton, "_fp8_gathered", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(attention_triton, "_COPY_SLICE", 3)  # the values copied in several slices
    case = fp8_case([1, 24, 4, 13], [40, 9, 3, 22], hq=4, hkv=2, d=16, block_size=block_size)
    q, k, v, k8, v8, ks, vs, layout = case

    def run(threshold):
        monkeypatch.setattr(attention_triton, "COPY_ONCE_CONTEXT", threshold)
        caches = [t.clone() for t in (k8, v8, ks, vs)]
        return attention_triton.paged_attention(
            q, k, v, caches[0], caches[1], layout, 0.25, k_scale=caches[2], v_scale=caches[3],
            block_n=block_n, block_m=16, fp8_products=True, prefill_kernel="packed",
        )  # fmt: skip

    in_place = run(10**9)
    assert calls == []
    once = run(1)
    assert calls == [1]
    assert not once.isnan().any()
    torch.testing.assert_close(once, in_place, rtol=0, atol=0)
    ref = [t.clone() for t in (k8, v8, ks, vs)]
    expected = reference.attention(q, k, v, ref[0], ref[1], layout, 0.25, ref[2], ref[3])
    err = (once - expected).abs()
    assert err.max() < 0.15 and err.mean() < 0.02, (err.max(), err.mean())


def test_fp8_cache_stays_close_to_the_fp32_cache():
    """Attention over the FP8 cache against the same inputs over an fp32 cache: e4m3 keeps 3 mantissa bits
    (a relative rounding of at most 2^-4 of each row's amax / 448 unit), so outputs of unit-scale inputs move
    by a few hundredths; 0.1 is well above what one rounding gives and far below a wrong row's O(1)."""
    q, k, v, k_cache, v_cache, layout = make_case([1, 3, 12], [30, 8, 0], hq=4, hkv=2, d=32, block_size=4)
    expected = reference.attention(q, k, v, k_cache.clone(), v_cache.clone(), layout, 32**-0.5)
    (k8, ks), (v8, vs) = fp8_kv.quantize(k_cache), fp8_kv.quantize(v_cache)
    got = reference.attention(q, k, v, k8, v8, layout, 32**-0.5, ks, vs)
    err = (got - expected).abs()
    assert err.max() < 0.1 and err.mean() < 0.02, (err.max(), err.mean())


def test_prefill_kernel_switched_off_reads_the_fp8_cache_in_the_reference(monkeypatch):
    """ENCLAVE_TRITON_PREFILL=0 hands the scales to the reference's prefill too."""
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "0")
    reset_engine_env()
    q, k, v, k8, v8, ks, vs, layout = fp8_case([1, 20], [37, 5], hq=4, hkv=2, d=16, block_size=4)
    ref = [t.clone() for t in (k8, v8, ks, vs)]
    expected = reference.attention(q, k, v, ref[0], ref[1], layout, 0.25, ref[2], ref[3])
    got = attention_triton.paged_attention(q, k, v, k8, v8, layout, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("kernel", ["rows", "packed"])
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "heads"),
    [([20], [0], (3, 1, 16)), ([1, 24, 4], [40, 9, 3], (4, 2, 32)), ([70], [50], (4, 2, 64))],
)
def test_fp8_products_stay_close_to_the_reference(query_lens, context_lens, heads, kernel):
    """The prefill kernel's e4m3 QK and PV products (queries, and softmax weights times the value scales,
    quantised per row) against the reference over the same FP8 cache. Each quantisation moves a factor by
    at most 2^-4 of itself; over unit-normal inputs that moved outputs (std 0.2-0.5) by 0.03-0.07 at most
    and 0.004-0.008 on average (measured); 0.15 and 0.02 leave room and still catch a lost scale (O(1))."""
    hq, hkv, d = heads
    q, k, v, k8, v8, ks, vs, layout = fp8_case(query_lens, context_lens, hq=hq, hkv=hkv, d=d, block_size=4)
    ref = [t.clone() for t in (k8, v8, ks, vs)]
    expected = reference.attention(q, k, v, ref[0], ref[1], layout, d**-0.5, ref[2], ref[3])
    got = attention_triton.paged_attention(
        q, k, v, k8, v8, layout, d**-0.5, k_scale=ks, v_scale=vs, block_n=16, block_m=16, fp8_products=True,
        prefill_kernel=kernel,
    )  # fmt: skip
    err = (got - expected).abs()
    assert err.max() < 0.15 and err.mean() < 0.02, (err.max(), err.mean())
    short = [t for i in layout.short_seqs for t in range(layout.cu_seqlens[i], layout.cu_seqlens[i + 1])]
    torch.testing.assert_close(got[short], expected[short], **TOL)  # decode and verify stay exact


def test_fp8_products_follow_their_variable(monkeypatch):
    case = fp8_case([24], [9], hq=4, hkv=2, d=32, block_size=4)
    q, k, v, k8, v8, ks, vs, layout = case

    def run(**kwargs):
        caches = [t.clone() for t in (k8, v8, ks, vs)]
        return attention_triton.paged_attention(
            q, k, v, caches[0], caches[1], layout, 32**-0.5, k_scale=caches[2], v_scale=caches[3], **kwargs
        )

    plain, products = run(fp8_products=False), run(fp8_products=True)
    assert not torch.equal(plain, products)
    assert torch.equal(run(), plain)  # off by default
    monkeypatch.setenv("ENCLAVE_FP8_ATTENTION", "1")
    reset_engine_env()
    assert torch.equal(run(), products)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ((1,) * 64, tuple((97 * i) % 4000 for i in range(64))),  # decode batch
        ((4,) * 16, tuple(300 * i for i in range(16))),  # MTP verify
        ((1,), (128 * 1024,)),  # one long context: split-KV
        ((1, 300, 4, 1), (5000, 0, 12, 1)),  # decodes, a prefill chunk, a verify step
        ((2000, 9), (14000, 0)),  # a later chunk over a long context, a short prompt
        ((2048, 1), (20000, 77)),  # past COPY_ONCE_CONTEXT: the prefill reads a dequantised copy
    ],
)
def test_real_shapes_bf16_fp8_cache(query_lens, context_lens):
    """Qwen3.5-35B-A3B attention in bf16 over an FP8 cache against the reference in fp32 over the same
    cache (its dequantised rows are exact in fp32), and the bytes the write kernel stores (the GPU's own
    e4m3 conversion) against torch's cast."""
    q, k, v, k8, v8, ks, vs, layout = fp8_case(
        query_lens, context_lens, hq=16, hkv=2, d=256, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    scale = 256**-0.5
    ref = [t.clone() for t in (k8, v8, ks, vs)]
    expected = reference.attention(q.float(), k.float(), v.float(), ref[0], ref[1], layout, scale, *ref[2:])
    got = attention_triton.attention(q, k, v, k8, v8, layout, scale, ks, vs)
    # As the bf16 cache's test: inputs, softmax weights and output each rounded once to bf16.
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    for mine, theirs in zip((k8, v8, ks, vs), ref, strict=True):
        torch.testing.assert_close(mine.float(), theirs.float(), equal_nan=True, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "query_lens, context_lens, block_size",
    [
        ((8192,), (0,), 16),
        ((2000, 300), (14000, 0), 16),
        # past COPY_ONCE_CONTEXT: values read from a transposed copy, key tiles across cache blocks
        # (16 positions) and inside one (64, the CUDA default)
        ((2048, 1), (20000, 77), 16),
        ((2048, 1), (20000, 77), 64),
    ],
)
def test_real_shapes_fp8_products(query_lens, context_lens, block_size):
    """The e4m3 products at Qwen3.5's prefill shapes against the fp32 reference over the same FP8 cache:
    the first measurement of their error on the GPU (bounds as the interpreter's test, which at these
    lengths average more rounding per output)."""
    q, k, v, k8, v8, ks, vs, layout = fp8_case(
        query_lens, context_lens, hq=16, hkv=2, d=256, block_size=block_size, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    scale = 256**-0.5
    ref = [t.clone() for t in (k8, v8, ks, vs)]
    expected = reference.attention(q.float(), k.float(), v.float(), ref[0], ref[1], layout, scale, *ref[2:])
    got = attention_triton.paged_attention(
        q, k, v, k8, v8, layout, scale, k_scale=ks, v_scale=vs, fp8_products=True
    )
    err = (got.float() - expected).abs()
    assert err.max() < 0.15 and err.mean() < 0.02, (err.max(), err.mean())
