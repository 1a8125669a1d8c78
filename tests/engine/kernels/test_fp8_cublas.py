"""cuBLASLt's block-scaled FP8 GEMM as the FP8 block linear's many-row path (`fp8.cublas`): when it is taken,
and, on an H100/H200, that it computes `fp8.reference.fp8_block_linear` at the model's shapes."""

import pytest
import torch

from engine.kernels import dispatch
from engine.kernels.fp8 import cublas, reference
from engine.kernels.fp8 import triton as fp8_triton
from tests.engine.kernels.test_fp8_triton import BF16, REAL, activations, block_weight, rand

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_fits_needs_many_rows_and_a_cuda_weight():
    w = torch.zeros(256, 2048, dtype=torch.float8_e4m3fn)
    few = cublas.fits(cublas.MIN_ROWS - 1, w, (128, 128), torch.bfloat16)
    assert few == "fewer rows than cuBLAS pays for"
    assert "no block-scaled cuBLASLt GEMM" in cublas.fits(cublas.MIN_ROWS, w, (128, 128), torch.bfloat16)


def test_a_shape_cublaslt_refuses_runs_on_the_triton_gemm_and_is_not_asked_again(monkeypatch, caplog):
    # cuBLASLt's heuristic may find no algorithm for a call (CUBLAS_STATUS_NOT_SUPPORTED, seen on the H200 at
    # 0356086): that shape falls back to the Triton GEMM, logged once, and cuBLASLt is not asked again.
    asked = []

    def refuse(a, *args, **kwargs):
        asked.append(a.shape[0])
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED (cublasLtMatmulAlgoGetHeuristic)")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(cublas, "_REFUSED", set())
    real_fits = cublas.fits
    monkeypatch.setattr(cublas, "fits", lambda rows, *rest: None if rows >= cublas.MIN_ROWS else "few")
    m, n, k = 600, 256, 512
    x = activations(m, k, torch.float32, seed=3)
    w, scale = block_weight(n, k, seed=4)
    for _ in range(2):
        out = fp8_triton.fp8_block_linear(x, w, scale)
        torch.testing.assert_close(out, reference.fp8_block_linear(x, w, scale), rtol=1e-4, atol=1e-5)
        assert dispatch.usage()["fp8_block_linear"] == "triton-gemm"
    assert asked == [m, m]  # the patched `fits` does not remember; the real one does:
    assert {(m, n, k)} == cublas._REFUSED
    assert real_fits(m, w, (128, 128), torch.bfloat16) == "cuBLASLt refused this shape before"
    assert [r for r in caplog.records if "cuBLASLt refused" in r.getMessage()][:1]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_fits_refuses_what_cublaslt_cannot_take():
    w = torch.zeros(256, 2048, dtype=torch.float8_e4m3fn, device="cuda")
    assert cublas.fits(4096, w, (128, 128), torch.bfloat16) is None
    assert cublas.fits(4096, w, (128, 64), torch.bfloat16) == "scale blocks are not 128 x 128"
    assert "multiple of 512" in cublas.fits(4096, w[:, :640], (128, 128), torch.bfloat16)
    assert "N of 16" in cublas.fits(4096, w[:200], (128, 128), torch.bfloat16)
    assert cublas.fits(4096, w, (128, 128), torch.float32) == "output dtype is not bf16 or fp16"
    assert "bias" in cublas.fits(4096, w, (128, 128), torch.bfloat16, bias=True)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("m", [cublas.MIN_ROWS, 1000, 8192])
@pytest.mark.parametrize("name", ["in_proj_qkvz", "linear_out_proj", "qkv_proj", "expert_w2"])
def test_many_rows_take_cublas_and_match_the_reference(name, m):
    n, k = REAL[name]
    x = activations(m, k, torch.bfloat16, seed=m, device="cuda")
    w, scale = block_weight(n, k, seed=1, device="cuda")
    out = fp8_triton.fp8_block_linear(x, w, scale)
    assert dispatch.usage()["fp8_block_linear"] == "cublas"
    ref = reference.fp8_block_linear(x.float(), w, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Bound: the bf16 rounding of the output, plus the accumulation's error, which scales with the sum of
    # |products| and not with the output: Hopper's e4m3 MMA adds inside a 128-channel block with fewer than
    # fp32's bits (about 2^-14 relative, hence DeepGEMM's per-block promotion), and where the products cancel
    # that is more than an ulp of the small output (on the H100 at dfb3aa5 one element of 16.8M was 0.0010025
    # off at expert_w2 x 8,192, and cuBLAS and Triton differed by more than the one ulp this asked for).
    magnitude = x.float().abs() @ reference.dequantize_block_fp8(w, scale, (128, 128), torch.float32).abs().T
    accumulation = 2**-12 * magnitude
    rounding = torch.finfo(torch.bfloat16).eps * ref.abs()
    assert ((out.float() - ref).abs() <= rounding + accumulation + 1e-6).all()
    torch.testing.assert_close(out.float(), ref, rtol=BF16["rtol"], atol=4 * BF16["atol"])
    # The Triton GEMM on the same e4m3 inputs: both sum each 128-channel block's e4m3 products and round
    # once; on the H200 at 0356086 they differed by at most one bf16 ulp, within the same bound here.
    tiles = fp8_triton.gemm_config(m, n, k, x.device)
    triton_out = fp8_triton.fp8_block_gemm(x, w, scale, config=tiles)
    ulp = torch.finfo(torch.bfloat16).eps * triton_out.float().abs()
    assert ((out.float() - triton_out.float()).abs() <= ulp * 1.01 + 2 * accumulation + 1e-6).all()
    # With a bias the Triton GEMM runs: adding it to cuBLAS's rounded output would round twice.
    bias = rand(n, seed=2, device="cuda").to(torch.bfloat16)
    fp8_triton.fp8_block_linear(x, w, scale, bias)
    assert dispatch.usage()["fp8_block_linear"] == "triton-gemm"
