"""Triton SwiGLU activation against the torch reference: odd widths, strided rows, every float dtype."""

import pytest
import torch

from engine.kernels import dispatch
from engine.kernels.swiglu import reference
from engine.kernels.swiglu import triton as swiglu_triton
from tests.engine.kernels.test_moe_triton import DEVICE, nan_empty, rand  # noqa: F401 (the fixture, by name)

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.parametrize("shape", [(1, 2 * 512), (3, 2 * 9), (17, 2 * 1000), (2, 5, 2 * 24), (65, 2 * 2049)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(shape, dtype):
    x = (rand(*shape, seed=shape[-1]) * 3).to(dtype)
    out = swiglu_triton.swiglu(x)
    expected = reference.swiglu(x)
    assert out.shape == expected.shape and out.dtype == dtype and out.is_contiguous()
    # fp32 silu, rounded like the reference's two ops: equal up to exp's last bits, one ulp of the dtype;
    # bf16 two, as Triton's interpreter casts fp32 -> bf16 toward zero.
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_strided_rows():
    x = rand(7, 3 * 40, seed=1)[:, : 2 * 40]  # a column slice: rows of stride 120
    torch.testing.assert_close(swiglu_triton.swiglu(x), reference.swiglu(x), rtol=1e-6, atol=1e-6)


def test_registered_with_dispatch():
    assert dispatch.implementation("swiglu", "triton") is swiglu_triton.swiglu
    assert dispatch.implementation("swiglu", "torch") is reference.swiglu
