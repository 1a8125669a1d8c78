"""FP8 consumers that take x quantised already (`Fp8Activation`, made by the norm that produced x): the block
linear's GEMM and one-row paths, and the FP8 experts' GEMV and grouped paths.

Each is given the quantisation of a *different* tensor x2 of x's shape: the output must then be the output for
x2, which shows the kernel read `xq` rather than quantising x again (e4m3 values and scales are exact, so the
grouped and GEMM paths, which skip only the quantiser launch, are bit-identical; the GEMV and one-row kernels
take other tiles and compare with the reference). An `xq` of another group is ignored.
"""

import pytest
import torch

from engine.kernels.fp8 import reference as fp8_ref
from engine.kernels.fp8 import triton as fp8_triton
from engine.kernels.fp8.reference import Fp8Activation, quantize_fp8_per_token_group
from engine.kernels.linear import triton as linear_triton
from engine.kernels.moe import fp8 as moe_fp8
from engine.kernels.moe import gemv, reference
from tests.engine.kernels.test_fp8_triton import FP32, activations, block_weight
from tests.engine.kernels.test_moe_fp8_triton import REL_TOL, fp8_weights, routing
from tests.engine.kernels.test_moe_triton import assert_relative, rand
from tests.engine.kernels.test_moe_triton import nan_empty as nan_empty  # a fixture, used by name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantised(x, group=128):
    return Fp8Activation(*quantize_fp8_per_token_group(x, group), group)


@pytest.mark.parametrize("m", [5, 33])  # the tensor-core GEMM path (more than one row)
def test_block_gemm_reads_xq(m):
    n, k = 200, 300
    w, s = block_weight(n, k, seed=1, device=DEVICE)
    x, x2 = (
        activations(m, k, torch.float32, seed=2, device=DEVICE),
        activations(m, k, torch.float32, seed=3, device=DEVICE),
    )
    out = fp8_triton.fp8_block_linear(x, w, s, xq=quantised(x2))
    assert torch.equal(out, fp8_triton.fp8_block_linear(x2, w, s))
    ignored = fp8_triton.fp8_block_linear(x, w, s, xq=quantised(x2, 64))  # another group: x is quantised
    assert torch.equal(ignored, fp8_triton.fp8_block_linear(x, w, s))


@pytest.mark.parametrize("n", [200, 4100])  # inline-quantising width, and wider (prequantised) outputs
def test_one_row_linear_reads_xq(n):
    k = 300
    w, s = block_weight(n, k, seed=4, device=DEVICE)
    x, x2 = (
        activations(1, k, torch.float32, seed=5, device=DEVICE),
        activations(1, k, torch.float32, seed=6, device=DEVICE),
    )
    out = fp8_triton.fp8_block_linear(x, w, s, xq=quantised(x2))
    torch.testing.assert_close(out, fp8_ref.fp8_block_linear(x2, w, s), **FP32)
    tiles = linear_triton.FP8Q_TILES
    direct = linear_triton.fp8_linear(x, w, s, tiles=tiles, xq=quantised(x2))
    torch.testing.assert_close(direct, fp8_ref.fp8_block_linear(x2, w, s), **FP32)


@pytest.mark.parametrize("t", [2, 81])  # gemv kernels (8 pairs), grouped GEMMs (324 pairs)
def test_experts_read_xq(t, nan_empty):
    h, i, e, k, block = 256, 128, 16, 4, (128, 128)
    x, x2 = rand(t, h, seed=t), rand(t, h, seed=t + 7)
    w = fp8_weights(e, h, i, block, seed=3)
    weights, ids = routing(t, e, k, seed=t + 1)
    out = moe_fp8.experts(x, *w, weights, ids, block, xq=quantised(x2))
    expected = moe_fp8.experts(x2, *w, weights, ids, block)
    if ids.numel() <= gemv.MAX_PAIRS:
        assert_relative(out, reference.fp8_experts(x2, *w, weights, ids, block), REL_TOL[torch.float32])
    else:
        assert torch.equal(out, expected)
    assert_relative(expected, reference.fp8_experts(x, *w, weights, ids, block, xq=quantised(x2)), 1e-5)


def test_gemv_fp8_reads_xq_bit_for_bit():
    # x's quantisation inside each program and the given one are the same values and sums
    t, h, i, e, k, block = 1, 256, 128, 6, 4, (128, 128)
    x = rand(t, h, seed=1)
    w = fp8_weights(e, h, i, block, seed=2)
    weights, ids = routing(t, e, k, seed=3)
    inline = gemv.experts_fp8(x, *w, weights, ids, block)
    assert torch.equal(gemv.experts_fp8(x, *w, weights, ids, block, xq=quantised(x)), inline)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m, n, k", [(1, 12288, 2048), (1, 9216, 2048), (64, 12288, 2048), (256, 2048, 4096)])
def test_prequantized_real_shapes_gpu(m, n, k):
    w, s = block_weight(n, k, seed=1, device="cuda")
    x = activations(m, k, torch.bfloat16, seed=2, device="cuda")
    out = fp8_triton.fp8_block_linear(x, w, s, xq=quantised(x))
    torch.testing.assert_close(out, fp8_triton.fp8_block_linear(x, w, s), rtol=8e-3, atol=1e-3)
