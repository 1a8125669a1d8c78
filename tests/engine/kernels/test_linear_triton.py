"""The few-token dense linear (`linear.triton`) against F.linear in fp32, and its W8A8 block-FP8 variant (the
small-M route of `fp8.triton.fp8_block_linear`) against `fp8.reference.fp8_block_linear`.

On the CPU the kernels run in Triton's interpreter (conftest) in fp32 and fp16; the `gpu` tests run the
Qwen3.5-35B-A3B projection shapes in bf16 and FP8. Odd N and K leave ragged N tiles and K steps; small N
makes the launcher split K (the interpreter counts as 4 SMs). Buffers start as NaN (`nan_empty`), so
anything a kernel leaves unwritten shows up.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.env import reset_engine_env
from engine.kernels import dispatch
from engine.kernels.fp8 import reference as fp8_reference
from engine.kernels.fp8 import triton as fp8_triton
from engine.kernels.linear import reference
from engine.kernels.linear import triton as linear_triton
from engine.model.fp8_linear import is_fp8_projection
from engine.model.linear import Linear
from tests.engine.kernels.cases import captured, crossed, ids
from tests.engine.kernels.test_moe_triton import DEVICE, assert_relative, needs_cuda, rand
from tests.engine.kernels.test_moe_triton import nan_empty as nan_empty  # a fixture, used by name

# fp32: the same products summed in another order (~1e-7 relative). fp16: the output rounded once (2^-11).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# FP8: same e4m3 values and scales on both sides, fp32 sums in another order; fp16 adds the output rounding.
FP8_TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-3),
}
MAX = linear_triton.MAX_ROWS


def weights(n, k, dtype, seed=0, bias=False, device=DEVICE):
    """(weight [N, K] ~1/sqrt(K), bias [N] or None) in `dtype`: outputs of order one."""
    w = (rand(n, k, seed=seed, device=device) * k**-0.5).to(dtype)
    return w, (rand(n, seed=seed + 1, device=device).to(dtype) if bias else None)


def expected(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


DTYPES = [torch.float32, torch.float16]
# Every row count (ROWS is a constexpr: one row takes the wide tiles, 3 and 5 mask a power-of-two block) with
# every odd (N, K); K = 2048 (several steps, split for small N) at three counts; dtype in turn, every pair of
# values meeting (cases.crossed).
SHAPES = crossed([1, 2, 3, 5, MAX], [(1, 16), (7, 100), (300, 100), (64, 272)], DTYPES)
SHAPES += crossed([1, 5, MAX], [(64, 2048), (257, 2048)], DTYPES)


@pytest.mark.parametrize("m, nk, dtype", SHAPES)
def test_linear_matches_reference(m, nk, dtype, nan_empty):
    n, k = nk
    x = rand(m, k, seed=m + k).to(dtype)
    w, b = weights(n, k, dtype, seed=n, bias=(m + n) % 2 == 1)
    out = linear_triton.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_relative(out, expected(x, w, b), REL_TOL[dtype])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_strided_x_and_leading_dims(bias, dtype, nan_empty):
    n, k = 37, 90
    w, b = weights(n, k, dtype, seed=1, bias=bias)
    x = rand(3, k + 11, seed=2).to(dtype)[:, 5 : 5 + k]  # a column slice: row stride k + 11
    assert_relative(linear_triton.linear(x, w, b), expected(x, w, b), REL_TOL[dtype])
    x3 = rand(2, 3, k, seed=3).to(dtype)  # 6 rows as [2, 3, K]
    out = linear_triton.linear(x3, w, b)
    assert out.shape == (2, 3, n)
    assert_relative(out, expected(x3, w, b), REL_TOL[dtype])


@pytest.mark.parametrize(
    "tiles",
    [
        linear_triton.LinearTiles(block_n=4, k_bytes=64, split_k=3),  # uneven splits: 7 steps as 3, 3, 1
        linear_triton.LinearTiles(block_n=2, k_bytes=128, split_k=1, num_warps=2),
        linear_triton.LinearTiles(block_n=16, k_bytes=32, split_k=100),  # more splits asked than steps
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_tiles_and_splits(tiles, bias, nan_empty):
    m, n, k = 3, 21, 100
    x = rand(m, k, seed=4)
    w, b = weights(n, k, torch.float32, seed=5, bias=bias)
    out = linear_triton.linear(x, w, b, tiles=tiles)
    assert_relative(out, expected(x, w, b), REL_TOL[torch.float32])
    assert torch.equal(out, linear_triton.linear(x, w, b, tiles=tiles)), "not deterministic"


def test_linear_plan_splits_k_for_few_rows_only():
    # H200 (132 SMs), bf16: in_proj_qkvz has 1536 N tiles and no split; out_proj (256 tiles of K 4096),
    # the router (33) and in_proj_ba (8) split K into whole 512-channel steps.
    plan = linear_triton.plan
    tiles = linear_triton.LinearTiles()
    assert plan(1, 12288, 2048, 2, None, tiles, 132)["splits"] == 1
    out_proj = plan(1, 2048, 4096, 2, None, tiles, 132)
    assert out_proj["splits"] > 1 and out_proj["k_split"] % 512 == 0
    assert plan(1, 257, 2048, 2, None, tiles, 132)["splits"] == 4
    assert plan(1, 64, 2048, 2, None, tiles, 132)["splits"] == 4
    fp8 = plan(1, 64, 2048, 1, 128, tiles, 132)
    assert fp8["blocks"] == dict(GROUP=128, BLOCK_C=128, KG=8) and fp8["splits"] == 2


def test_linear_above_max_rows_and_other_dtypes_fall_back(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(linear_triton, "run_kernel", no_kernel)
    w, b = weights(9, 20, torch.float32, seed=6, bias=True)
    for x in (rand(MAX + 1, 20, seed=7), rand(2, 5, 20, seed=8), rand(0, 20, seed=9)):  # 9, 10 and 0 rows
        torch.testing.assert_close(linear_triton.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    x = rand(2, 20, seed=10).double()
    torch.testing.assert_close(linear_triton.linear(x, w.double()), F.linear(x, w.double()), rtol=0, atol=0)
    w_t = rand(20, 9, seed=11).T  # a weight strided along K
    torch.testing.assert_close(linear_triton.linear(x.float(), w_t), F.linear(x.float(), w_t), rtol=0, atol=0)


def test_dispatch(monkeypatch):
    from engine import kernels

    x = rand(2, 24, seed=12)
    w, b = weights(5, 24, torch.float32, seed=13, bias=True)
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    assert dispatch.pick("linear", x) is linear_triton.linear
    assert_relative(kernels.linear(x, w, b), expected(x, w, b), REL_TOL[torch.float32])
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    reset_engine_env()  # the engine reads its variables once
    assert dispatch.pick("linear", x) is reference.linear


def test_model_linear_is_an_nn_linear(monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    layer = Linear(24, 5, bias=True).to(DEVICE)
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert is_fp8_projection("model.layers.0.self_attn.o_proj", layer)
    x = rand(3, 24, seed=14)
    with torch.no_grad():
        assert_relative(layer(x), expected(x, layer.weight, layer.bias), REL_TOL[torch.float32])


def fp8_weight(n, k, block, seed=0, device=DEVICE):
    """(e4m3 [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]) of a weight ~1/sqrt(K), partial edge blocks."""
    return fp8_reference.quantize_block_fp8_weight(rand(n, k, seed=seed, device=device) * k**-0.5, block)


def fp8_activations(m, k, dtype, seed=0):
    """[m, k] ~1 as a column slice of a wider tensor, with a zero group in row 0 (amax guarded, not divided
    by)."""
    x = rand(m, k + 8, seed=seed)
    x[0, 3 : 3 + min(k, 16)] = 0.0
    return x.to(dtype)[:, 3 : 3 + k]


FP8_SHAPES = [(m, 300, 272, (128, 128)) for m in (1, 2, 3, 5, MAX)]
FP8_SHAPES += [
    (m, n, k, block) for m in (1, 3, MAX) for n, k, block in ((7, 100, (16, 16)), (45, 60, (8, 24)))
]
FP8_SHAPES += [(2, 64, 2048, (128, 128)), (5, 90, 100, (64, 32))]
# Each shape in one dtype, fp32 and fp16 in turn: both at every row count of the first shape and at each
# block shape (the dtype is read and written at the edges of the kernel, away from the scale blocks).
FP8_CASES = [(*shape, DTYPES[i % 2]) for i, shape in enumerate(FP8_SHAPES)]


@pytest.mark.parametrize("m, n, k, block, dtype", FP8_CASES, ids=ids)
def test_fp8_block_linear_small_m_matches_reference(m, n, k, block, dtype, nan_empty):
    x = fp8_activations(m, k, dtype, seed=m + k)
    w, scale = fp8_weight(n, k, block, seed=n)
    bias = rand(n, seed=1).to(dtype) if m % 2 else None
    out = fp8_triton.fp8_block_linear(x, w, scale, bias, block)
    assert out.dtype == dtype and out.shape == (m, n) and not out.isnan().any()
    torch.testing.assert_close(
        out, fp8_reference.fp8_block_linear(x, w, scale, bias, block), **FP8_TOL[dtype]
    )


@pytest.mark.parametrize(
    "m, n, k, block, dtype", [(*shape, DTYPES[i % 2]) for i, shape in enumerate(FP8_SHAPES[::2])], ids=ids
)
def test_fp8_linear_prequantized_matches_reference(m, n, k, block, dtype, nan_empty):
    # x quantised by its own kernel first: the same e4m3 values and scales as inline, so the same tolerance.
    x = fp8_activations(m, k, dtype, seed=m + k)
    w, scale = fp8_weight(n, k, block, seed=n)
    bias = rand(n, seed=1).to(dtype) if m % 2 else None
    tiles = linear_triton.LinearTiles(block_n=4, k_bytes=64, split_k=2)  # several K steps and a split
    for t in (tiles, None):
        out = linear_triton.fp8_linear(x, w, scale, bias, block, tiles=t, prequantize=True)
        assert out.dtype == dtype and out.shape == (m, n) and not out.isnan().any()
        torch.testing.assert_close(
            out, fp8_reference.fp8_block_linear(x, w, scale, bias, block), **FP8_TOL[dtype]
        )


@pytest.mark.parametrize("m", [1, linear_triton.FP8_PREFER_MAX_ROWS + 1])
def test_fp8_block_linear_routes_by_rows(m, monkeypatch):
    # Up to FP8_PREFER_MAX_ROWS rows (and N) the weight-streaming kernel, above it the quantiser + GEMM.
    calls = []
    small, gemm = linear_triton.fp8_linear, fp8_triton.fp8_block_gemm
    monkeypatch.setattr(linear_triton, "fp8_linear", lambda *a, **k: calls.append("small") or small(*a, **k))
    monkeypatch.setattr(fp8_triton, "fp8_block_gemm", lambda *a, **k: calls.append("gemm") or gemm(*a, **k))
    x = fp8_activations(m, 136, torch.float32, seed=2)
    w, scale = fp8_weight(40, 136, (128, 128), seed=3)
    out = fp8_triton.fp8_block_linear(x, w, scale)
    assert calls == ["small" if m <= linear_triton.FP8_PREFER_MAX_ROWS else "gemm"]
    torch.testing.assert_close(out, fp8_reference.fp8_block_linear(x, w, scale), **FP8_TOL[torch.float32])


def test_fp8_block_linear_prequantizes_wide_outputs(monkeypatch):
    # One row: inline quantisation up to FP8_PREFER_MAX_N outputs, the quantiser first above it.
    monkeypatch.setattr(linear_triton, "FP8_PREFER_MAX_N", 32)
    seen = []
    small = linear_triton.fp8_linear
    monkeypatch.setattr(
        linear_triton, "fp8_linear", lambda *a, **k: seen.append(k["prequantize"]) or small(*a, **k)
    )
    x = fp8_activations(1, 136, torch.float32, seed=2)
    for n in (32, 40):
        w, scale = fp8_weight(n, 136, (128, 128), seed=3)
        out = fp8_triton.fp8_block_linear(x, w, scale)
        torch.testing.assert_close(out, fp8_reference.fp8_block_linear(x, w, scale), **FP8_TOL[x.dtype])
    assert seen == [False, True]


def test_fp8_split_k_deterministic(nan_empty):
    x = fp8_activations(3, 200, torch.float32, seed=4)
    w, scale = fp8_weight(19, 200, (16, 16), seed=5)
    tiles = linear_triton.LinearTiles(block_n=4, k_bytes=32, split_k=3)
    out = linear_triton.fp8_linear(x, w, scale, None, (16, 16), tiles=tiles)
    torch.testing.assert_close(
        out, fp8_reference.fp8_block_linear(x, w, scale, None, (16, 16)), **FP8_TOL[x.dtype]
    )
    assert torch.equal(out, linear_triton.fp8_linear(x, w, scale, None, (16, 16), tiles=tiles))


# (K, N) of Qwen3.5-35B-A3B's projections at decode: in_proj_qkvz, out_proj / o_proj, in_proj_ba, the router
# (256 experts + the shared gate), qkv_proj.
REAL = [(2048, 12288), (4096, 2048), (2048, 64), (2048, 257), (2048, 9216)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, MAX])
@pytest.mark.parametrize("k, n", REAL)
def test_linear_real_shapes_gpu(k, n, m):
    x = rand(m, k, seed=m).to(torch.bfloat16)
    w, b = weights(n, k, torch.bfloat16, seed=1, bias=n == 9216)
    out = linear_triton.linear(x, w, b)
    assert out.dtype == torch.bfloat16
    assert_relative(out, expected(x, w, b), REL_TOL[torch.bfloat16])
    assert torch.equal(out, linear_triton.linear(x, w, b)), "not deterministic"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, MAX])
@pytest.mark.parametrize("k, n", REAL)
def test_fp8_block_linear_real_shapes_gpu(k, n, m):
    x = rand(m, k, seed=m).to(torch.bfloat16)
    w, scale = fp8_weight(n, k, (128, 128), seed=1)
    out = fp8_triton.fp8_block_linear(x, w, scale)
    ref = fp8_reference.fp8_block_linear(x.float(), w, scale)
    torch.testing.assert_close(out.float(), ref, **FP8_TOL[torch.bfloat16])
    pre = linear_triton.fp8_linear(x, w, scale, prequantize=True)
    torch.testing.assert_close(pre.float(), ref, **FP8_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k, n", [(4096, 2048), (2048, 64)])
def test_linear_replays_in_cuda_graph_gpu(k, n):
    # Split K (a second launch) included: captured once, replayed on new x, equal to an eager call.
    x = rand(1, k, seed=1).to(torch.bfloat16)
    w, _ = weights(n, k, torch.bfloat16, seed=2)
    graph, out = captured(lambda: linear_triton.linear(x, w))
    x.copy_(rand(1, k, seed=3).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, linear_triton.linear(x, w))


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n", [linear_triton.PREFER_MAX_N, linear_triton.PREFER_MAX_N + 1])
def test_linear_routes_wide_outputs_to_torch(m, n, monkeypatch):
    # The kernel only where it measured faster than cuBLAS: narrow outputs (PREFER_MAX_N) up to MAX_ROWS
    # rows, and any at one row (WIDE_MAX_ROWS) with WIDE_TILES.
    calls = []
    kernel = linear_triton.run_kernel
    monkeypatch.setattr(
        linear_triton, "run_kernel", lambda *a, **kw: calls.append(a[-1].block_n) or kernel(*a, **kw)
    )
    x, w = rand(m, 32, seed=11), rand(n, 32, seed=12)
    torch.testing.assert_close(linear_triton.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    if m <= linear_triton.WIDE_MAX_ROWS:
        assert calls == [linear_triton.WIDE_TILES.block_n]
    else:
        assert calls == ([linear_triton.LinearTiles().block_n] if n <= linear_triton.PREFER_MAX_N else [])
