"""The Triton block-FP8 quantiser and linear against the torch references, over odd token counts and N, K that
are not multiples of 128 (partial edge scale blocks, as in the FP8 test checkpoints).

The quantiser must agree bit for bit: both sides divide exactly and round to nearest even. Outputs start as
`torch.empty`, so the linear's comparison also catches unwritten elements.
"""

import pytest
import torch

from engine.kernels import dispatch
from engine.kernels.fp8 import reference
from engine.kernels.fp8 import triton as fp8_triton
from tests.engine.factories import quantize_block_fp8
from tests.engine.kernels.cases import crossed

# Same e4m3 values and scales on both sides; only the fp32 summation order differs (the reference sums
# dequantised products, the kernel scales each 128-wide block's sum): ~1e-6 relative for K <= 300.
FP32 = {"rtol": 1e-4, "atol": 1e-5}
# fp16 outputs rounded from fp32 values that agree to ~1e-6: at most one fp16 ulp (~1e-3 near 1) apart.
FP16 = {"rtol": 2e-3, "atol": 2e-3}
# bf16 outputs (GPU) against the fp32 reference: bf16 keeps 8 bits (rounding error <= 2**-9 relative), and the
# fp32 sums of K <= 4096 terms of size ~1/sqrt(K) differ by ~1e-5 near zero.
BF16 = {"rtol": 8e-3, "atol": 1e-3}


def rand(*shape, seed, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def activations(m, k, dtype, seed=0, device="cpu", wide=False):
    """[m, k] ~1 as a strided view of a wider packed tensor, with a zero group; `wide` spreads magnitudes over
    1e-3..1e2 and puts tiny values (e4m3 subnormals once scaled) beside the large ones of their group."""
    x = rand(m, k + 8, seed=seed)
    if wide:
        g = torch.Generator().manual_seed(seed)
        x *= torch.logspace(-3, 2, k + 8)[torch.randperm(k + 8, generator=g)]
        x[:, 3:10] *= 1e-4
    x[0, 3 : 3 + min(k, 128)] = 0.0  # a zero group: amax is guarded, not divided by
    return x.to(dtype).to(device)[:, 3 : 3 + k]


def block_weight(n, k, seed=0, device="cpu"):
    """(e4m3 [n, k], fp32 weight_scale_inv [ceil(n/128), ceil(k/128)]) of a weight ~1/sqrt(k): outputs ~1."""
    w_fp8, scale = quantize_block_fp8(rand(n, k, seed=seed) / k**0.5)
    return w_fp8.to(device), scale.to(device)


def assert_same_quantisation(x, group):
    q, s = fp8_triton.quantize_fp8_per_token_group(x, group)
    ref_q, ref_s = reference.quantize_fp8_per_token_group(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == ref_s.shape
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    torch.testing.assert_close(q.view(torch.uint8), ref_q.view(torch.uint8), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "m, k, group",
    [(1, 128, 128), (3, 200, 128), (63, 136, 128), (65, 272, 128), (5, 40, 16), (1030, 136, 128)],
)
def test_quantize_matches_reference(m, k, group, dtype):
    assert_same_quantisation(activations(m, k, dtype, seed=m + k, wide=True), group)


def test_quantize_rounds_ties_to_even_and_carries_into_the_exponent():
    # Scaled by 448 / 448 = 1: ties (1.0625 -> 1.0, 1.1875 -> 1.25), a carry (1.97 -> 2.0), subnormals.
    values = [448.0, 1.0625, 1.1875, 1.97, -1.97, 0.001, -0.001, 0.0029, 1e-6, -0.0, 3.0e-3, 300.0, 310.0]
    x = torch.tensor(values + [0.5] * (32 - len(values)))[None, :]
    assert_same_quantisation(x, 32)


def test_quantize_keeps_leading_dims():
    x = rand(2, 3, 160, seed=4)
    q, s = fp8_triton.quantize_fp8_per_token_group(x)
    ref_q, ref_s = reference.quantize_fp8_per_token_group(x)
    assert q.shape == (2, 3, 160) and s.shape == (2, 3, 2)
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=0, atol=0)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)


# Every row count (one row takes the weight-streaming kernel, more the quantiser + GEMM, whose tiles 63 and 65
# fill just under and over) in both dtypes; the e4m3 tl.dot or its fp16 stand-in in turn (cases.crossed).
@pytest.mark.parametrize(
    "m, dtype, use_fp8_dot", crossed([1, 3, 63, 65, 130], [torch.float32, torch.float16], [True, False])
)
def test_linear_matches_reference(m, dtype, use_fp8_dot, monkeypatch):
    tol = FP32 if dtype == torch.float32 else FP16
    monkeypatch.setattr(fp8_triton, "has_fp8_dot", lambda device: use_fp8_dot)
    n, k = (200, 136) if m % 2 else (144, 264)
    x = activations(m, k, dtype, seed=m)
    w, scale = block_weight(n, k, seed=m + 1)
    bias = rand(n, seed=m + 2).to(dtype) if m != 63 else None
    out = fp8_triton.fp8_block_linear(x, w, scale, bias)
    ref = reference.fp8_block_linear(x, w, scale, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, ref, **tol)


def test_linear_other_block_sizes_and_leading_dims():
    # 64-row, 32-column scale blocks; x [2, 3, K].
    n, k, block = 90, 100, (64, 32)
    w = (rand(n, k, seed=1) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(2, 4, generator=torch.Generator().manual_seed(2)) + 0.5) / (64 * k**0.5)
    x = rand(2, 3, k, seed=3)
    out = fp8_triton.fp8_block_linear(x, w, scale, None, block)
    torch.testing.assert_close(out, reference.fp8_block_linear(x, w, scale, None, block), **FP32)


def test_dispatch_picks_triton_when_forced(monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    x = rand(3, 136, seed=5)
    w, scale = block_weight(72, 136, seed=6)
    from engine.kernels import fp8

    assert dispatch.pick("fp8_block_linear", x) is fp8_triton.fp8_block_linear
    assert dispatch.pick("quantize_fp8_per_token_group", x) is fp8_triton.quantize_fp8_per_token_group
    torch.testing.assert_close(
        fp8.fp8_block_linear(x, w, scale), reference.fp8_block_linear(x, w, scale), **FP32
    )


# (N, K) of the FP8 linears of Qwen3.5-35B-A3B (hidden 2048): DeltaNet in_proj_qkvz [q|k|v|z] and out_proj,
# attention qkv_proj [q+gate | k | v] and o_proj, one expert's w13 (gate and up, 2 x 512) and w2.
REAL = {
    "in_proj_qkvz": (2 * 2048 + 2 * 4096, 2048),
    "linear_out_proj": (2048, 4096),
    "qkv_proj": (2 * 16 * 256 + 2 * 2 * 256, 2048),
    "o_proj": (2048, 16 * 256),
    "expert_w13": (2 * 512, 2048),
    "expert_w2": (2048, 512),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize("name", list(REAL))
def test_real_shapes_bf16_on_gpu(name, m):
    n, k = REAL[name]
    x = activations(m, k, torch.bfloat16, seed=m, device="cuda")
    w, scale = block_weight(n, k, seed=1, device="cuda")
    bias = rand(n, seed=2, device="cuda").to(torch.bfloat16)
    assert_same_quantisation(activations(m, k, torch.bfloat16, seed=m, device="cuda", wide=True), 128)
    out = fp8_triton.fp8_block_linear(x, w, scale, bias)
    ref = reference.fp8_block_linear(x.float(), w, scale, bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, **BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_dot_path_on_gpu(monkeypatch):
    # The path for GPUs without e4m3 tensor cores (before sm_89), forced on this one.
    monkeypatch.setattr(fp8_triton, "has_fp8_dot", lambda device: False)
    n, k = REAL["in_proj_qkvz"]
    x = activations(256, k, torch.bfloat16, device="cuda")
    w, scale = block_weight(n, k, device="cuda")
    out = fp8_triton.fp8_block_linear(x, w, scale)
    torch.testing.assert_close(out.float(), reference.fp8_block_linear(x.float(), w, scale), **BF16)
