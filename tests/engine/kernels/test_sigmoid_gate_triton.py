"""The Triton attention output gate `x * sigmoid(gate)` against the reference, the gate strided as in the
model."""

import pytest
import torch

from engine.kernels.sigmoid_gate import reference
from engine.kernels.sigmoid_gate.triton import sigmoid_gate
from tests.engine.kernels.cases import crossed

# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The same two roundings on both sides; exp of another library can move the sigmoid by an fp32 ulp, and
# through its cast an fp16 ulp.
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def gated_inputs(t, h, d, dtype, seed=0, device=DEVICE):
    """x [T, H, D] contiguous (the attention output) and gate [T, H, D], the second half of each head of
    the [T, H, q_h | gate_h] projection, inside a wider row."""
    x = rand(t, h, d, seed=seed, dtype=dtype, device=device)
    row = rand(t, h * 2 * d + 7, seed=seed + 1, dtype=dtype, device=device)
    gate = row[:, : h * 2 * d].view(t, h, 2 * d)[..., d:]
    return x, gate


# Heads with head sizes (together they set the BH x BD tile and its masks); dtype and token count (one
# program row per token) in turn, every pair of values meeting (cases.crossed): 10 of the 54 combinations.
@pytest.mark.parametrize(
    "h, d, dtype, t", crossed([1, 3, 16], [7, 33, 128], [torch.float32, torch.float16], [1, 3, 65])
)
def test_sigmoid_gate(t, h, d, dtype):
    x, gate = gated_inputs(t, h, d, dtype, seed=t + h + d)
    out = sigmoid_gate(x, gate)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, reference.sigmoid_gate(x, gate), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4099])
def test_sigmoid_gate_real_shapes_bf16(t):
    # 16 query heads of 256
    x, gate = gated_inputs(t, 16, 256, torch.bfloat16, seed=t, device="cuda")
    out = sigmoid_gate(x, gate)
    torch.testing.assert_close(out, reference.sigmoid_gate(x, gate), rtol=1e-2, atol=1e-2)  # one bf16 ulp


# Head sizes that are a whole number of scale groups (one, two, three: D 384 pads to a 512 tile), heads,
# dtypes and tokens, every pair of values meeting.
@pytest.mark.parametrize(
    "d, h, dtype, t",
    crossed([32, 256, 384], [1, 3, 16], [torch.float32, torch.float16], [1, 3, 65]),
)
def test_sigmoid_gate_fp8_quantises_its_output_as_the_reference_quantiser(t, h, d, dtype):
    from engine.kernels.fp8.reference import quantize_fp8_per_token_group
    from engine.kernels.sigmoid_gate.triton import sigmoid_gate_fp8

    group = 32 if d == 32 else 128
    x, gate = gated_inputs(t, h, d, dtype, seed=t + h + d)
    out, xq = sigmoid_gate_fp8(x, gate, group)
    torch.testing.assert_close(out, reference.sigmoid_gate(x, gate), **TOL[dtype])
    assert out.shape == x.shape and xq.q.shape == (t, h * d) and xq.scale.shape == (t, h * d // group)
    # The quantiser's output on the kernel's own rounded output, bit for bit (the gate itself is compared
    # with the reference above; an ulp there would move a group's scale).
    q, scale = quantize_fp8_per_token_group(out.reshape(t, h * d), group)
    assert torch.equal(xq.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(xq.scale, scale) and xq.group == group
    _, ref_xq = reference.sigmoid_gate_fp8(x, gate, group)  # the torch path the CPU engine takes
    torch.testing.assert_close(ref_xq.scale, xq.scale, **TOL[dtype])


def test_sigmoid_gate_fp8_refuses_a_group_that_does_not_divide_the_heads():
    from engine.kernels.sigmoid_gate.triton import sigmoid_gate_fp8

    x, gate = gated_inputs(2, 2, 96, torch.float32)
    with pytest.raises(ValueError, match="power of two dividing the head size"):
        sigmoid_gate_fp8(x, gate, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4099])
def test_sigmoid_gate_fp8_real_shapes_bf16(t):
    from engine.kernels.fp8.reference import quantize_fp8_per_token_group
    from engine.kernels.sigmoid_gate.triton import sigmoid_gate_fp8

    x, gate = gated_inputs(t, 16, 256, torch.bfloat16, seed=t, device="cuda")
    out, xq = sigmoid_gate_fp8(x, gate, 128)
    torch.testing.assert_close(out, reference.sigmoid_gate(x, gate), rtol=1e-2, atol=1e-2)
    q, scale = quantize_fp8_per_token_group(out.reshape(t, -1), 128)
    assert torch.equal(xq.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(xq.scale, scale)
