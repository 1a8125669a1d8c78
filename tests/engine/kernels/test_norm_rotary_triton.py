"""The Triton RMSNorm (alone and after a residual add), gated RMSNorm, partial rotary and its cos/sin tables
against their references, over odd sizes."""

import pytest
import torch

from engine.kernels.norm import reference as norm_ref
from engine.kernels.norm.triton import add_rms_norm, gated_rms_norm, rms_norm
from engine.kernels.rotary import reference as rotary_ref
from engine.kernels.rotary.triton import apply_rotary, rotary_cos_sin
from tests.engine.kernels.cases import crossed

EPS = 1e-6
# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Norms: the same fp32 math with a different summation order for the mean square, so a few fp32 ulps,
# and at most one ulp of fp16 after the final cast.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}
ROTARY_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=0, atol=0)}
DTYPES = [torch.float32, torch.float16]


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


# Here and below: every row count with every width (odd widths mask the row tile; 65 rows span more than one
# block of rows), the other axes in turn, every pair of values meeting (cases.crossed).
@pytest.mark.parametrize(
    "rows, d, dtype, zero_centered", crossed([1, 3, 65], [7, 33, 128], DTYPES, [True, False])
)
def test_rms_norm(rows, d, dtype, zero_centered):
    x, w = rand(rows, d, seed=rows + d, dtype=dtype), rand(d, seed=1, dtype=dtype) * 0.1
    out = rms_norm(x, w, EPS, zero_centered)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, norm_ref.rms_norm(x, w, EPS, zero_centered), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype):
    # the q norm reads q out of [T, H, q_h | gate_h]; the k norm reads a column slice viewed as heads
    qg = rand(5, 3, 2 * 16, seed=2, dtype=dtype)
    w = rand(16, seed=3, dtype=torch.float32)  # fp32 master weight with fp16 activations
    q = qg[..., :16]
    torch.testing.assert_close(rms_norm(q, w, EPS), norm_ref.rms_norm(q, w, EPS), **TOL[dtype])
    k = rand(5, 70, seed=4, dtype=dtype)[:, 3:51].view(5, 3, 16)
    torch.testing.assert_close(rms_norm(k, w, EPS), norm_ref.rms_norm(k, w, EPS), **TOL[dtype])
    x4 = rand(2, 3, 4, 16, seed=5, dtype=dtype)  # more than three dims
    torch.testing.assert_close(rms_norm(x4, w, EPS), norm_ref.rms_norm(x4, w, EPS), **TOL[dtype])


@pytest.mark.parametrize("rows, d, dtype", crossed([1, 3, 65], [7, 33, 128], DTYPES))
def test_add_rms_norm(rows, d, dtype):
    x, res = rand(rows, d, seed=d, dtype=dtype), rand(rows, d, seed=d + 1, dtype=dtype)
    w = rand(d, seed=2, dtype=dtype) * 0.1
    x_before, res_before = x.clone(), res.clone()
    normed, total = add_rms_norm(x, res, w, EPS)
    ref_normed, ref_total = norm_ref.add_rms_norm(x, res, w, EPS)
    assert normed.dtype == total.dtype == dtype and normed.shape == total.shape == x.shape
    # the sum is one rounded add on both sides: exact
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs are not written


def test_add_rms_norm_strided_and_fp32_weight():
    # x a column slice of a wider row, a 3-d residual, an fp32 weight with fp16 activations
    x = rand(4, 2, 40, seed=1, dtype=torch.float16)[..., 3:35]
    res = rand(4, 2, 32, seed=2, dtype=torch.float16)
    w = rand(32, seed=3) * 0.1
    normed, total = add_rms_norm(x, res, w, EPS)
    ref_normed, ref_total = norm_ref.add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **TOL[torch.float16])


@pytest.mark.parametrize("rows, d, dtype", crossed([1, 3, 65], [7, 33, 128], DTYPES))
def test_gated_rms_norm(rows, d, dtype):
    x, gate = rand(rows, d, seed=d, dtype=dtype), rand(rows, d, seed=d + 1, dtype=dtype)
    w = rand(d, seed=2, dtype=dtype)  # same dtype: the reference rounds weight * normed to it
    out = gated_rms_norm(x, gate, w, EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm_ref.gated_rms_norm(x, gate, w, EPS), **TOL[dtype])


def test_gated_rms_norm_heads_strided_gate_fp32_weight():
    # DeltaNet: [T, Hv, dv] output, gate z a slice of the projection viewed as heads; an fp32 weight with
    # fp16 activations makes the reference's product fp32 (no rounding in between)
    t, h, d = 3, 5, 12
    x = rand(t, h, d, seed=1, dtype=torch.float16)
    z = rand(t, 9 + h * d, seed=2, dtype=torch.float16)[:, 9:].view(t, h, d)
    w = rand(d, seed=3)
    out = gated_rms_norm(x, z, w, EPS)
    torch.testing.assert_close(out, norm_ref.gated_rms_norm(x, z, w, EPS), **TOL[torch.float16])


def rotary_inputs(t, h, d, rd, dtype, seed=0, device=DEVICE):
    x = rand(t, h, d, seed=seed, dtype=dtype, device=device)
    positions = torch.randint(0, 5000, (t,), generator=torch.Generator().manual_seed(seed)).to(device)
    inv_freq = 1.0 / (10_000_000 ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    cos, sin = rotary_ref.rotary_cos_sin(positions, inv_freq, 1.0)
    return x, cos, sin


@pytest.mark.parametrize(
    "dims, t, dtype, h", crossed([(7, 4), (33, 8), (128, 32), (16, 16)], [1, 3, 65], DTYPES, [1, 3])
)
def test_apply_rotary(t, h, dims, dtype):
    d, rd = dims
    x, cos, sin = rotary_inputs(t, h, d, rd, dtype, seed=t + d)
    out = apply_rotary(x, cos, sin)
    # same rounding order as the reference (cast cos/sin, round each product, then the sum): exact, but
    # for fp32 on a GPU, where the compiler may fuse a product and the sum into one FMA
    torch.testing.assert_close(out, rotary_ref.apply_rotary(x, cos, sin), **ROTARY_TOL[dtype])


@pytest.mark.parametrize("rd, t, scale", crossed([2, 8, 64, 96], [1, 3, 65], [1.0, 1.25]))
def test_rotary_cos_sin(t, rd, scale):
    # positions up to Qwen3.5's 262144 (angles of 2.6e5 rad at the first frequency): the same fp32 angle
    # on both sides, then cos/sin of two libraries (an ulp or so)
    positions = torch.randint(0, 262144, (t,), generator=torch.Generator().manual_seed(t)).to(DEVICE)
    inv_freq = 1.0 / (10_000_000 ** (torch.arange(0, rd, 2, dtype=torch.float32, device=DEVICE) / rd))
    cos, sin = rotary_cos_sin(positions, inv_freq, scale)
    ref_cos, ref_sin = rotary_ref.rotary_cos_sin(positions, inv_freq, scale)
    assert cos.shape == sin.shape == (t, rd) and cos.dtype == sin.dtype == torch.float32
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=2e-6)


def test_apply_rotary_strided_input():
    x, cos, sin = rotary_inputs(5, 3, 40, 8, torch.float32, seed=3)
    wide = torch.cat((x, rand(5, 3, 8, seed=4)), dim=-1)[..., :40]  # [T, H, D] view of wider heads
    torch.testing.assert_close(
        apply_rotary(wide, cos, sin), rotary_ref.apply_rotary(x, cos, sin), rtol=0, atol=0
    )


# bf16 outputs against the fp32 reference: one bf16 rounding (relative 2^-8) plus fp32 noise
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("rows", "d"), [(4099, 2048), (4099 * 16, 256), (37, 256)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_real_shapes_bf16(rows, d):
    # Qwen3.5-35B-A3B: hidden 2048 (layer and final norms), head dim 256 (q/k norms)
    x = rand(rows, d, seed=1, dtype=torch.bfloat16, device="cuda")
    w = rand(d, seed=2, dtype=torch.bfloat16, device="cuda") * 0.1
    out = rms_norm(x, w, EPS)
    torch.testing.assert_close(out.float(), norm_ref.rms_norm(x.float(), w.float(), EPS), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64, 4099])
def test_add_rms_norm_real_shapes_bf16(rows):
    # the decoder's residual stream: hidden 2048, decode and prefill row counts
    x = rand(rows, 2048, seed=1, dtype=torch.bfloat16, device="cuda")
    res = rand(rows, 2048, seed=2, dtype=torch.bfloat16, device="cuda")
    w = rand(2048, seed=3, dtype=torch.bfloat16, device="cuda") * 0.1
    normed, total = add_rms_norm(x, res, w, EPS)
    ref_normed, ref_total = norm_ref.add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gated_rms_norm_real_shapes_bf16():
    # DeltaNet output: 32 value heads of 128, gate z sliced from the projection
    t, h, d = 1027, 32, 128
    x = rand(t, h, d, seed=1, dtype=torch.bfloat16, device="cuda")
    z = rand(t, 8192 + h * d, seed=2, dtype=torch.bfloat16, device="cuda")[:, 8192:].view(t, h, d)
    w = rand(d, seed=3, dtype=torch.bfloat16, device="cuda")
    out = gated_rms_norm(x, z, w, EPS)
    expected = norm_ref.gated_rms_norm(x.float(), z.float(), w.float(), EPS)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)  # two bf16 roundings
    torch.testing.assert_close(out, norm_ref.gated_rms_norm(x, z, w, EPS), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("h", [16, 2])
def test_apply_rotary_real_shapes_bf16(h):
    # 16 query heads and 2 KV heads of 256, rotary on the first 64 channels
    x, cos, sin = rotary_inputs(4099, h, 256, 64, torch.bfloat16, seed=h, device="cuda")
    out = apply_rotary(x, cos, sin)
    expected = rotary_ref.apply_rotary(x.float(), cos, sin)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)  # three bf16 roundings
    torch.testing.assert_close(out, rotary_ref.apply_rotary(x, cos, sin), rtol=0, atol=0)  # same order
