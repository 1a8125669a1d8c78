"""The Triton q/k RMSNorm + partial rotary against the reference (the norm and rotary references in turn)."""

import pytest
import torch

from engine.kernels.attention import fp8_kv
from engine.kernels.qk_norm_rotary import reference
from engine.kernels.qk_norm_rotary.triton import qk_norm_rotary, qk_norm_rotary_store
from engine.kernels.rotary import reference as rotary_ref
from tests.engine.kernels.cases import crossed

EPS = 1e-6
# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The norm's mean square is summed in another order (a few fp32 ulps); in fp16 that can move the normed
# value by one ulp before the rotation, and the rotation's rounded products by one more.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = [torch.float32, torch.float16]


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def tables(t, rd, seed=0, device=DEVICE):
    positions = torch.randint(0, 5000, (t,), generator=torch.Generator().manual_seed(seed)).to(device)
    inv_freq = 1.0 / (10_000_000 ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    return rotary_ref.rotary_cos_sin(positions, inv_freq, 1.0)


def projection(t, hq, hkv, d, dtype, seed=0, device=DEVICE):
    """q [T, Hq, D] and k [T, Hkv, D] as the model's views: q interleaved with its gate per head, k a column
    slice of the same [q+gate | k | v] row."""
    row = rand(t, hq * 2 * d + 2 * hkv * d, seed=seed, dtype=dtype, device=device)
    q = row[:, : hq * 2 * d].view(t, hq, 2 * d)[..., :d]
    k = row[:, hq * 2 * d : hq * 2 * d + hkv * d].view(t, hkv, d)
    return q, k


def check(t, hq, hkv, d, rd, dtype, seed=0):
    q, k = projection(t, hq, hkv, d, dtype, seed=seed)
    wq, wk = rand(d, seed=seed + 1, dtype=dtype) * 0.2, rand(d, seed=seed + 2, dtype=dtype) * 0.2
    cos, sin = tables(t, rd, seed=seed)
    out_q, out_k = qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    ref_q, ref_k = reference.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    assert out_q.shape == (t, hq, d) and out_k.shape == (t, hkv, d)
    assert out_q.dtype == out_k.dtype == dtype and out_q.is_contiguous() and out_k.is_contiguous()
    torch.testing.assert_close(out_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, **TOL[dtype])


# Every head layout with every head size: together they set the tile (BH heads of BD channels) and its
# masks. dtype and token count (one program per token) in turn, every pair of values meeting (cases.crossed).
@pytest.mark.parametrize(
    "heads, dims, dtype, t",
    crossed([(1, 1), (4, 2), (6, 1), (16, 2)], [(7, 4), (33, 8), (64, 16), (16, 16)], DTYPES, [1, 3, 65]),
)
def test_qk_norm_rotary(t, heads, dims, dtype):
    (hq, hkv), (d, rd) = heads, dims
    check(t, hq, hkv, d, rd, dtype, seed=t + hq + d)


def test_qk_norm_rotary_contiguous_and_fp32_weights():
    # contiguous q/k (other callers), fp32 master weights with fp16 activations
    t, hq, hkv, d, rd = 5, 3, 1, 32, 8
    q, k = rand(t, hq, d, seed=1, dtype=torch.float16), rand(t, hkv, d, seed=2, dtype=torch.float16)
    wq, wk = rand(d, seed=3) * 0.2, rand(d, seed=4) * 0.2
    cos, sin = tables(t, rd, seed=5)
    out = qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    ref = reference.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4099])
def test_qk_norm_rotary_real_shapes_bf16(t):
    # Qwen3.5-35B-A3B: 16 query heads and 2 KV heads of 256, rotary on the first 64 channels
    q, k = projection(t, 16, 2, 256, torch.bfloat16, seed=t, device="cuda")
    wq = rand(256, seed=1, dtype=torch.bfloat16, device="cuda") * 0.2
    wk = rand(256, seed=2, dtype=torch.bfloat16, device="cuda") * 0.2
    cos, sin = tables(t, 64, seed=t, device="cuda")
    out = qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    ref = reference.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # a bf16 ulp or two where a rounding flips


def store_case(t, hq, hkv, d, rd, dtype, seed=0, device=DEVICE, block_size=4):
    """Inputs of `qk_norm_rotary_store`: the projection's strided q/k/v views, NaN-filled caches with spare
    blocks, and each token's row in a shuffled block order."""
    row = rand(t, hq * 2 * d + 2 * hkv * d, seed=seed, dtype=dtype, device=device)
    q = row[:, : hq * 2 * d].view(t, hq, 2 * d)[..., :d]
    k = row[:, hq * 2 * d : hq * 2 * d + hkv * d].view(t, hkv, d)
    v = row[:, hq * 2 * d + hkv * d :].view(t, hkv, d)
    blocks = -(-t // block_size) + 3
    caches = [
        torch.full((blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device) for _ in "kv"
    ]
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    slots = (order[torch.arange(t) // block_size] * block_size + torch.arange(t) % block_size).to(device)
    wq, wk = (
        rand(d, seed=seed + 1, dtype=dtype, device=device) * 0.2,
        rand(d, seed=seed + 2, dtype=dtype) * 0.2,
    )
    cos, sin = tables(t, rd, seed=seed, device=device)
    return (q, k, v, wq, wk.to(device), cos, sin, EPS, *caches, slots)


def check_store(args, tol):
    """The fused kernel against the reference norm, rotary and cache write in turn: equal queries, equal
    written rows, and every other cache row still NaN."""
    q, k, v, wq, wk, cos, sin, eps, k_cache, v_cache, slots = args
    ref_caches = [c.clone() for c in (k_cache, v_cache)]
    out = qk_norm_rotary_store(*args)
    ref_q, ref_k = reference.qk_norm_rotary(q, k, wq, wk, cos, sin, eps)
    fp8_kv.write(ref_k, v, *ref_caches, slots, None, None)
    torch.testing.assert_close(out, ref_q, **tol)
    assert out.shape == q.shape and out.is_contiguous()
    hkv, d = k_cache.shape[2:]
    for got, want in zip((k_cache, v_cache), ref_caches, strict=True):
        got, want = got.view(-1, hkv, d), want.view(-1, hkv, d)
        torch.testing.assert_close(got[slots], want[slots], **tol)
        untouched = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
        untouched[slots] = False
        assert got[untouched].isnan().all(), "a row no token maps to was written"


@pytest.mark.parametrize(
    "heads, dims, dtype, t",
    crossed([(1, 1), (4, 2), (6, 1), (16, 2)], [(7, 4), (33, 8), (64, 16)], DTYPES, [1, 3, 9]),
)
def test_qk_norm_rotary_store(t, heads, dims, dtype):
    (hq, hkv), (d, rd) = heads, dims
    check_store(store_case(t, hq, hkv, d, rd, dtype, seed=t + hq + d), TOL[dtype])


def test_qk_norm_rotary_store_contiguous_values_and_no_tokens():
    args = list(store_case(5, 3, 1, 32, 8, torch.float16, seed=4))
    args[2] = args[2].contiguous()
    check_store(tuple(args), TOL[torch.float16])
    empty = store_case(0, 2, 1, 16, 4, torch.float32)
    assert qk_norm_rotary_store(*empty).shape == (0, 2, 16)
    assert empty[8].isnan().all() and empty[9].isnan().all()


def test_the_op_runs_the_two_ops_in_turn_under_the_torch_backend(monkeypatch):
    """The op's torch side is the path it replaces: the dispatched norm kernel, then the attention op's cache
    write (what `auto` ran on CUDA until its gpu test passed, 2026-12-05)."""
    from engine.kernels import dispatch
    from engine.kernels import qk_norm_rotary_store as op

    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    args = store_case(6, 4, 2, 16, 8, torch.float32, seed=7, device="cpu")
    ref_caches = [c.clone() for c in args[8:10]]
    out = op(*args)
    assert (
        dispatch.usage()["qk_norm_rotary_store"] == "torch" and dispatch.usage()["qk_norm_rotary"] == "torch"
    )
    ref_q, ref_k = reference.qk_norm_rotary(*args[:2], *args[3:8])
    fp8_kv.write(ref_k, args[2], *ref_caches, args[10], None, None)
    assert torch.equal(out, ref_q)
    for got, want in zip(args[8:10], ref_caches, strict=True):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert "qk_norm_rotary_store" not in dispatch._HELD_BACK  # its gpu test passed on an sm_90 GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4099])
def test_qk_norm_rotary_store_real_shapes_bf16(t):
    # Qwen3.5-35B-A3B's gated attention: 16 query heads, 2 KV heads of 256, rotary on 64, 16-position blocks
    args = store_case(t, 16, 2, 256, 64, torch.bfloat16, seed=t, device="cuda", block_size=16)
    check_store(args, dict(rtol=2e-2, atol=2e-2))  # a bf16 ulp or two where a rounding flips
