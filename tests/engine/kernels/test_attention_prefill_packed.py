"""The packed GQA prefill kernel (`attention/prefill.py`: all query heads of a kv head in one tile) against
the torch reference, in Triton's interpreter on the CPU (the GPU if any), through `paged_attention`.

As in test_attention_triton.py, caches start as NaN except the context rows and block tables are shuffled.
"""

import pytest
import torch

from engine import kernels
from engine.env import reset_engine_env
from engine.kernels import dispatch
from engine.kernels.attention import fp8_kv, prefill, reference
from engine.kernels.attention import triton as attention_triton
from tests.engine.kernels.cases import crossed
from tests.engine.kernels.test_attention_fp8_kv import check as check_fp8
from tests.engine.kernels.test_attention_triton import check, make_case

F32, F16 = torch.float32, torch.float16
PACKED = "triton-prefill-packed"


def check_packed(case, dtype, **kwargs):
    dispatch.reset_usage()
    check(case, dtype, prefill_kernel="packed", **kwargs)
    assert dispatch.usage()["attention"] == PACKED  # the packed kernel ran, not the rows kernel


# (Hq, Hkv, D): GQA 1, 2 and 8 (Qwen's 16:2), and 3 (rows padded past TOKENS x GROUP); with cache blocks
# that divide the 16-key tiles (4, 16: a key's place in its block is the same in every tile), that neither
# divide them nor hold whole tiles (12: each key's table entry and place computed), and that hold two whole
# tiles (32: one table read per tile).
HEADS = [(2, 2, 16), (4, 2, 16), (8, 1, 16), (6, 2, 16)]


@pytest.mark.parametrize("heads, block_size, dtype", crossed(HEADS, [4, 12, 16, 32], [F32, F16]))
def test_packed_ragged_batch(heads, block_size, dtype):
    # A prompt from position 0 (a partial last tile), a chunk after a context that is not a multiple of the
    # tiles, and a short chunk (one tile, diagonal only) after a longer context.
    hq, hkv, d = heads
    case = make_case((37, 21, 9), (0, 45, 70), hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype)
    check_packed(case, dtype, block_m=32, block_n=16)


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (64, 16), (None, None)])
def test_packed_tilings(block_m, block_n):
    # Tiles of 2, 8 and (None: the wrapper's fp32 choice, 16 rows) 2 tokens of 8 heads, keys narrower and
    # wider than a tile's positions; 40 tokens after 23 cached keys.
    case = make_case((40, 17), (23, 0), hq=8, hkv=1, d=16, block_size=8, seed=5)
    check_packed(case, F32, block_m=block_m, block_n=block_n)


def test_packed_beside_decodes_and_verify():
    # Decode and verify steps take the short kernel, the two chunks the packed one: one output.
    case = make_case((1, 30, 4, 19, 1), (37, 0, 5, 30, 0), hq=8, hkv=2, d=16, block_size=16, dtype=F16)
    check_packed(case, F16, block_m=32, block_n=16)


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "block_size"), [([24], [9], 4), ([1, 33, 4], [40, 50, 3], 32)]
)
def test_packed_reads_an_fp8_cache(query_lens, context_lens, block_size):
    dispatch.reset_usage()
    case = fp8_case(query_lens, context_lens, block_size)
    check_fp8(case, block_n=16, block_m=32, prefill_kernel="packed")
    assert dispatch.usage()["attention"] == PACKED


def fp8_case(query_lens, context_lens, block_size):
    q, k, v, k_cache, v_cache, layout = make_case(
        query_lens, context_lens, hq=8, hkv=2, d=16, block_size=block_size
    )
    (k8, ks), (v8, vs) = fp8_kv.quantize(k_cache), fp8_kv.quantize(v_cache)
    return q, k, v, k8, v8, ks, vs, layout


@pytest.mark.parametrize("block_size", [4, 32])
def test_the_packed_kernel_runs_the_fp8_products_itself(block_size):
    """ENCLAVE_FP8_ATTENTION's e4m3 products on the packed kernel (no longer handed to the rows kernel): it
    runs them (not its bf16 products over the same cache), within e4m3's reach of the rows kernel's."""
    q, k, v, k8, v8, ks, vs, layout = fp8_case([24, 40], [9, 0], block_size)

    def run(kernel, products):
        caches = [t.clone() for t in (k8, v8, ks, vs)]
        dispatch.reset_usage()
        out = attention_triton.paged_attention(
            q, k, v, caches[0], caches[1], layout, 0.25, k_scale=caches[2], v_scale=caches[3],
            block_m=16, block_n=16, fp8_products=products, prefill_kernel=kernel,
        )  # fmt: skip
        return out, dispatch.usage().get("attention")

    (packed, used), (plain, _), (rows, _) = run("packed", True), run("packed", False), run("rows", True)
    assert used == PACKED and not torch.equal(packed, plain)
    err = (packed - rows).abs()
    assert err.max() < 0.15 and err.mean() < 0.02, (err.max(), err.mean())


def test_the_variable_picks_the_kernel(monkeypatch):
    """ENCLAVE_PREFILL_KERNEL through the dispatched op: the choice shows in `dispatch.usage()`."""
    q, k, v, k_cache, v_cache, layout = make_case((20,), (5,), hq=4, hkv=2, d=16, block_size=4)
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    expected = reference.attention(q, k, v, k_cache.clone(), v_cache.clone(), layout, 0.25)
    for kernel, recorded in (("rows", "triton"), ("packed", PACKED)):
        monkeypatch.setenv("ENCLAVE_PREFILL_KERNEL", kernel)
        reset_engine_env()
        dispatch.reset_usage()
        out = kernels.attention(q, k, v, k_cache.clone(), v_cache.clone(), layout, 0.25)
        assert dispatch.usage()["attention"] == recorded
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_tiling_defaults():
    assert prefill.tiling(torch.bfloat16, 8) == (128, 64, 8, 2)  # 16 tokens x 8 heads
    assert prefill.tiling(torch.float32, 8)[:2] == (16, 16)  # fp32 spills above 16 x 16 at D 256
    assert prefill.tiling(torch.float16, 32, block_m=16)[0] == 32  # at least one token's heads
    assert prefill.tiling(torch.bfloat16, 8, block_m=64, block_n=32)[2] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ((8192,), (0,)),  # the first chunk of a long prompt
        ((2000, 9), (14000, 0)),  # a later chunk over a long context, a short prompt
        ((1, 1, 4, 1000, 63), (900, 20000, 40, 3000, 5)),  # decodes, verify, two chunks
    ],
)
def test_real_shapes_bf16(query_lens, context_lens, fp8_cache):
    """Qwen3.5-35B-A3B attention (16 q heads, 2 kv heads, head dim 256, blocks of 16) in bf16 through the
    packed kernel at its default tiles against the reference in fp32 on the same inputs (cache)."""
    q, k, v, k_cache, v_cache, layout = make_case(
        query_lens, context_lens, hq=16, hkv=2, d=256, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    scales = [None, None]
    if fp8_cache:
        (k_cache, scales[0]), (v_cache, scales[1]) = fp8_kv.quantize(k_cache), fp8_kv.quantize(v_cache)
    ref = [t.clone() if t is not None else None for t in (k_cache, v_cache, *scales)]
    if not fp8_cache:
        ref[:2] = [t.float() for t in ref[:2]]
    expected = reference.attention(q.float(), k.float(), v.float(), *ref[:2], layout, 256**-0.5, *ref[2:])
    dispatch.reset_usage()
    got = attention_triton.paged_attention(
        q, k, v, k_cache, v_cache, layout, 256**-0.5, k_scale=scales[0], v_scale=scales[1],
        prefill_kernel="packed",
    )  # fmt: skip
    assert dispatch.usage()["attention"] == PACKED
    # bf16 keeps 8 bits: inputs, softmax weights and output are each rounded once (~4e-3 relative each).
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
