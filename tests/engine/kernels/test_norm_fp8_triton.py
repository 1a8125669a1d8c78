"""The norms that also quantise their output for FP8 GEMMs (`add_rms_norm_fp8`, `gated_rms_norm_fp8`) against
the references: the normed output as the plain norms' tests check it, and the e4m3 values and scales bit for
bit against the reference quantiser applied to the kernel's own output (the quantisation of a given row is
exact arithmetic, so any difference is a bug, not rounding)."""

import pytest
import torch

from engine.kernels.fp8.reference import quantize_fp8_per_token_group
from engine.kernels.norm import reference as norm_ref
from engine.kernels.norm.triton import add_rms_norm_fp8, gated_rms_norm_fp8
from tests.engine.kernels.cases import crossed

EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype=dtype, device=device)


def assert_quantised(xq, normed, group):
    """xq is `normed` quantised per row and `group` channels by the reference quantiser, bit for bit."""
    q, scale = quantize_fp8_per_token_group(normed, group)
    assert xq.group == group and xq.q.dtype == torch.float8_e4m3fn and xq.q.shape == normed.shape
    assert xq.scale.shape == scale.shape and xq.scale.dtype == torch.float32
    assert torch.equal(xq.scale, scale), (xq.scale - scale).abs().max()
    assert torch.equal(xq.q.view(torch.uint8), q.view(torch.uint8))


# Rows: one, a few, more than one row tile (65); widths: under one group (a tile narrower than the group),
# one group plus a masked tail, several groups with a partial last one, whole groups; groups 16 and 128.
@pytest.mark.parametrize(
    "rows, d, group, dtype",
    crossed([1, 3, 65], [7, 33, 200, 256], [16, 128], [torch.float32, torch.float16]),
)
def test_add_rms_norm_fp8(rows, d, group, dtype):
    x, res = rand(rows, d, seed=d, dtype=dtype), rand(rows, d, seed=d + 1, dtype=dtype)
    w = rand(d, seed=2, dtype=dtype) * 0.1
    normed, total, xq = add_rms_norm_fp8(x, res, w, EPS, group)
    ref_normed, ref_total = norm_ref.add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    assert_quantised(xq, normed, group)


def test_add_rms_norm_fp8_zero_rows():
    # a row of zeros: every group's amax is the epsilon, as the reference quantiser's
    x, res = torch.zeros(2, 256, device=DEVICE), torch.zeros(2, 256, device=DEVICE)
    normed, _, xq = add_rms_norm_fp8(x, res, torch.zeros(256, device=DEVICE), EPS, 128)
    assert_quantised(xq, normed, 128)


@pytest.mark.parametrize(
    "t, heads, d, dtype", crossed([1, 5], [1, 3], [16, 128], [torch.float32, torch.float16])
)
def test_gated_rms_norm_fp8_heads(t, heads, d, dtype):
    # DeltaNet: [T, Hv, dv] rows of one head each, gate z a strided slice; with group = dv the per-row
    # scales are the per-group scales of the flattened [T, Hv * dv] input of out_proj
    x = rand(t, heads, d, seed=1, dtype=dtype)
    z = rand(t, 3 + heads * d, seed=2, dtype=dtype)[:, 3:].view(t, heads, d)
    w = rand(d, seed=3, dtype=dtype)
    out, xq = gated_rms_norm_fp8(x, z, w, EPS, d)
    torch.testing.assert_close(out, norm_ref.gated_rms_norm(x, z, w, EPS), **TOL[dtype])
    assert_quantised(xq, out, d)
    flat_q, flat_s = quantize_fp8_per_token_group(out.reshape(t, -1), d)
    assert torch.equal(xq.scale.reshape(t, -1), flat_s)
    assert torch.equal(xq.q.reshape(t, -1).view(torch.uint8), flat_q.view(torch.uint8))


def test_reference_matches_the_unfused_ops():
    x, res, w = rand(3, 64, seed=1), rand(3, 64, seed=2), rand(64, seed=3) * 0.1
    normed, _, xq = norm_ref.add_rms_norm_fp8(x, res, w, EPS, 32)
    assert torch.equal(normed, norm_ref.add_rms_norm(x, res, w, EPS)[0])
    assert_quantised(xq, normed, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64, 4099])
def test_add_rms_norm_fp8_real_shapes_bf16(rows):
    x = rand(rows, 2048, seed=1, dtype=torch.bfloat16, device="cuda")
    res = rand(rows, 2048, seed=2, dtype=torch.bfloat16, device="cuda")
    w = rand(2048, seed=3, dtype=torch.bfloat16, device="cuda") * 0.1
    normed, total, xq = add_rms_norm_fp8(x, res, w, EPS, 128)
    ref_normed, ref_total = norm_ref.add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **BF16_TOL)
    assert_quantised(xq, normed, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gated_rms_norm_fp8_real_shapes_bf16():
    t, h, d = 1027, 32, 128
    x = rand(t, h, d, seed=1, dtype=torch.bfloat16, device="cuda")
    z = rand(t, 8192 + h * d, seed=2, dtype=torch.bfloat16, device="cuda")[:, 8192:].view(t, h, d)
    w = rand(d, seed=3, dtype=torch.bfloat16, device="cuda")
    out, xq = gated_rms_norm_fp8(x, z, w, EPS, 128)
    # two bf16 roundings (weight * normed, then the gate), as the plain gated norm's test allows
    torch.testing.assert_close(out, norm_ref.gated_rms_norm(x, z, w, EPS), rtol=2e-2, atol=2e-2)
    assert_quantised(xq, out, 128)
