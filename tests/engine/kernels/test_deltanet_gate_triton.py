"""The Triton DeltaNet gates (beta, log decay g) against the reference, over odd sizes and extreme inputs."""

import pytest
import torch

from engine.kernels.deltanet_gate import reference
from engine.kernels.deltanet_gate.triton import deltanet_gate
from tests.engine.kernels.cases import crossed

# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# g: fp32 on both sides, exp/log of other libraries: a few ulps, and on a GPU Triton's approximate exp
# (ex2 of x * log2 e), whose relative error grows with |x| (about 5e-6 at |x| = 60). beta: at most one ulp
# of fp16 after the cast of an fp32 sigmoid that differs by an ulp.
G_TOL = dict(rtol=3e-5, atol=1e-6)
BETA_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def ba(t, hv, dtype, seed=0, scale=1.0, device=DEVICE):
    """b and a [T, Hv] as column slices of one [T, 2 Hv] projection output (the model's in_proj_ba)."""
    row = rand(t, 2 * hv, seed=seed, dtype=torch.float32, device=device) * scale
    row = row.to(dtype)
    return row[:, :hv], row[:, hv:]


def check(b, a, a_log, dt_bias):
    g, beta = deltanet_gate(a, b, a_log, dt_bias)
    ref_g, ref_beta = reference.deltanet_gate(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == b.dtype
    assert g.shape == beta.shape == b.shape and g.is_contiguous() and beta.is_contiguous()
    torch.testing.assert_close(g, ref_g, **G_TOL)
    torch.testing.assert_close(beta, ref_beta, **BETA_TOL[b.dtype])


# Every token count with every head count, dtype in turn, every pair of values meeting (cases.crossed).
@pytest.mark.parametrize(
    "t, hv, dtype", crossed([1, 3, 65, 300], [1, 5, 32, 48], [torch.float32, torch.float16])
)
def test_deltanet_gate(t, hv, dtype):
    b, a = ba(t, hv, dtype, seed=t + hv)
    a_log = rand(hv, seed=1).uniform_(0.0, 2.8).to(dtype)  # exp(A_log) in [1, 16]
    dt_bias = rand(hv, seed=2, dtype=dtype)
    check(b, a, a_log, dt_bias)


def test_deltanet_gate_softplus_range():
    # softplus's threshold (x > 20 passes through) and its far tail, where log(1 + exp(x)) would round
    # to 0 (the reference's log1p keeps exp(x)); fp32 parameters with fp16 projections
    hv = 8
    b, a = ba(4, hv, torch.float16, seed=3, scale=30.0)
    a_log, dt_bias = rand(hv, seed=4), rand(hv, seed=5) * 10.0
    check(b, a, a_log, dt_bias)
    x = torch.tensor([[-60.0, -30.0, -17.0, -1e-3, 0.0, 19.9, 20.0, 20.1]], device=DEVICE)
    g, _ = deltanet_gate(x, x, torch.zeros(hv, device=DEVICE), torch.zeros(hv, device=DEVICE))
    torch.testing.assert_close(g, -torch.nn.functional.softplus(x), rtol=G_TOL["rtol"], atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4099])
def test_deltanet_gate_real_shapes_bf16(t):
    # 32 value heads; bf16 projections and parameters
    b, a = ba(t, 32, torch.bfloat16, seed=t, device="cuda")
    a_log = rand(32, seed=1, device="cuda").uniform_(0.0, 2.8).to(torch.bfloat16)
    dt_bias = torch.ones(32, dtype=torch.bfloat16, device="cuda")
    g, beta = deltanet_gate(a, b, a_log, dt_bias)
    ref_g, ref_beta = reference.deltanet_gate(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, ref_g, **G_TOL)
    torch.testing.assert_close(beta, ref_beta, rtol=1e-2, atol=1e-2)  # one bf16 ulp where the cast flips
