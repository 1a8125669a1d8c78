"""An FP8 shared expert stacked with the routed FP8 experts (`SparseMoe.stack_fp8_shared_`): the MoE block's
output is that of the shared expert run on its own (torch references), on the reference path and on the
Triton kernels (GEMV for a few tokens, grouped GEMMs above `gemv.MAX_PAIRS` pairs), and nothing it
declines to stack changes."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before a Triton kernel module is imported

from engine.env import reset_engine_env
from engine.model.moe import SparseMoe
from tests.engine.test_fp8_experts import fp8_block

BLOCK = (8, 16)  # bn divides the intermediate size (24), as Qwen3.5's 128 divides 512


def fp8_moe(shared: int, seed: int = 0) -> SparseMoe:
    """A SparseMoe (hidden 64, 6 experts of 24, top 2) whose experts and shared expert are block FP8."""
    return fp8_block(shared, seed, BLOCK, fp8_shared=True)


def run(moe: SparseMoe, x: torch.Tensor, kernels: str, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("ENCLAVE_KERNELS", kernels)
    reset_engine_env()
    with torch.no_grad():
        return moe(x)


@pytest.mark.parametrize("tokens", [3, 80])  # 3 x 3 pairs: the GEMV; 80 x 3 = 240 > MAX_PAIRS: grouped GEMMs
def test_stacked_shared_expert_matches_it_run_alone(tokens, monkeypatch):
    moe = fp8_moe(shared=24, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    alone = run(moe, x, "torch", monkeypatch)  # shared expert as two FP8 linears, references throughout
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    assert moe.stack_fp8_shared_()
    assert not moe.stack_fp8_shared_()  # once
    assert moe.state_dict().keys() == state.keys()
    for key, value in moe.state_dict().items():  # the same values: e4m3 compared bit for bit
        same = value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value
        assert torch.equal(
            same, state[key].view(torch.uint8) if value.dtype == torch.float8_e4m3fn else state[key]
        )
    # fp32 throughout: only the summation order differs from the shared expert run alone
    torch.testing.assert_close(run(moe, x, "torch", monkeypatch), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(moe, x, "triton", monkeypatch), alone, rtol=1e-4, atol=1e-4)


def test_hooked_shared_expert_runs_alone(monkeypatch):
    moe = fp8_moe(shared=24, seed=4)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    moe.stack_fp8_shared_()
    plain = run(moe, x, "torch", monkeypatch)
    seen = []
    moe.shared_expert.down_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    torch.testing.assert_close(run(moe, x, "torch", monkeypatch), plain, rtol=1e-5, atol=1e-5)
    assert seen == [(5, 64)]


def test_other_shapes_are_not_stacked(monkeypatch):
    moe = fp8_moe(shared=40, seed=5)  # 40 shared channels against the experts' 24
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    before = run(moe, x, "torch", monkeypatch)
    assert not moe.stack_fp8_shared_()
    torch.testing.assert_close(run(moe, x, "torch", monkeypatch), before, rtol=0, atol=0)
