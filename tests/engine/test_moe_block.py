"""The MoE block (`SparseMoe`) against transformers' Qwen3_5MoeSparseMoeBlock on the same weights: the shared
expert folded into the experts' kernels and its gate into the router's GEMM, on the torch references and on
the Triton kernels (Triton's interpreter on the CPU); and the FP8 shared expert, which runs on its own."""

import os

import pytest
import torch

from engine.config import config_from_dict
from engine.kernels import dispatch
from engine.model.fp8_linear import Fp8Linear, quantize_model_
from engine.model.moe import SparseMoe
from tests.engine.factories import text_config

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the MoE Triton module is imported

# hidden 64 (FP8 blocks of 128 cover it partially), 6 experts of 24, top 2, a shared expert of 40.
SHAPES = dict(hidden_size=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)


def blocks(seed=0, shared=40, dtype=torch.float32):
    """(transformers' block, ours with the same weights)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hf_config = text_config(**SHAPES, shared_expert_intermediate_size=shared)
    torch.manual_seed(seed)
    ref = Qwen3_5MoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        for p in ref.parameters():  # O(1) activations, and routing probabilities far from ties
            router = p.shape == ref.gate.weight.shape
            p.copy_(torch.randn(p.shape) * (2.0 if router else p.shape[-1] ** -0.5))
    ours = SparseMoe(config_from_dict(hf_config.to_dict()))
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.w13.copy_(ref.experts.gate_up_proj)
        ours.w2.copy_(ref.experts.down_proj)
        mlp = ref.shared_expert
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        ours.shared_expert.down_proj.weight.copy_(mlp.down_proj.weight)
        ours.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    return ref.to(dtype).eval(), ours.to(dtype).eval()


def tokens(t, seed=1, dtype=torch.float32):
    return torch.randn(t, SHAPES["hidden_size"], generator=torch.Generator().manual_seed(seed)).to(dtype)


# Every token count on the references; on Triton one: the kernels' sizes are tested in tests/engine/kernels,
# here the block's wiring into them. 33 tokens (99 (token, slot) pairs) take the same gemv kernels as 5, one
# interpreted program per pair and tile: the slowest case of this file.
@pytest.mark.parametrize("t, backend", [(1, "torch"), (5, "torch"), (33, "torch"), (5, "triton")])
def test_matches_transformers(backend, t, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", backend)
    ref, ours = blocks(seed=t)
    x = tokens(t)
    with torch.no_grad():
        expected = ref(x[None])[0]
        out = ours(x)
    # fp32 both ways; the Triton GEMMs sum in another order.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bf16_matches_transformers():
    # bf16 on the torch references: the same roundings in the same order, up to the fused router GEMM.
    ref, ours = blocks(seed=4, dtype=torch.bfloat16)
    x = tokens(17, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x[None])[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_without_shared_expert(backend, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", backend)
    ref, with_shared = blocks(seed=5)
    ours = SparseMoe(config_from_dict(text_config(**SHAPES, shared_expert_intermediate_size=0).to_dict()))
    assert ours.shared_expert is None
    ours.load_state_dict({k: v for k, v in with_shared.state_dict().items() if "shared" not in k})
    x = tokens(9)
    with torch.no_grad():
        _, weights, ids = ref.gate(x)
        torch.testing.assert_close(ours(x), ref.experts(x, ids, weights), rtol=1e-5, atol=1e-5)


def test_router_weight_follows_the_parameters():
    _, ours = blocks(seed=6)
    first = ours.router_weight()
    assert first.shape == (SHAPES["num_experts"] + 1, SHAPES["hidden_size"])
    assert ours.router_weight().data_ptr() == first.data_ptr()  # made once
    # Padded with zero rows to a multiple of 8, so the logits rows are 16-byte aligned for cuBLAS.
    padded = ours._router_rows()
    assert padded.shape[0] % 8 == 0 and not padded[first.shape[0] :].any()
    with torch.no_grad():
        ours.shared_expert_gate.weight.mul_(2.0)  # written in place, as the loader does
    again = ours.router_weight()
    assert again.data_ptr() != first.data_ptr()
    torch.testing.assert_close(again[-1:], ours.shared_expert_gate.weight)
    torch.testing.assert_close(again[:-1], ours.gate.weight)
    assert "_router" not in dict(ours.named_buffers()) and not any("_router" in k for k in ours.state_dict())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_shared_expert_runs_on_its_own(backend, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", backend)
    _, ours = blocks(seed=7)
    holder = torch.nn.Module()
    holder.mlp = ours
    x = tokens(5)  # 10 (token, slot) pairs: the gemv kernels on Triton, one interpreted program per pair
    with torch.no_grad():
        unquantised = ours(x)
        assert quantize_model_(holder, experts=False) == 2
        assert isinstance(ours.shared_expert.gate_up_proj, Fp8Linear)
        out = ours(x)
        logits = torch.nn.functional.linear(x, ours.router_weight())
        weights, ids = dispatch.implementation("moe_route", "torch")(logits, 2, True, True)
        routed = dispatch.implementation("moe_experts", "torch")(
            x, ours.w13, ours.w2, weights[:, :2], ids[:, :2]
        )
        expected = routed + weights[:, 2:] * ours.shared_expert(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # e4m3 weights and activations move the shared expert's share by a few percent.
    assert ((out - unquantised).norm() / unquantised.norm()).item() < 0.05


def test_hooked_modules_run_as_themselves():
    # A forward hook sees its module run (and may change its output), so hooked modules are not fused.
    ref, ours = blocks(seed=8)
    x = tokens(7)
    seen = []
    ours.gate.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    ours.shared_expert.down_proj.register_forward_hook(lambda m, args, out: out * 2)
    with torch.no_grad():
        out = ours(x)
        _, weights, ids = ref.gate(x)
        routed = ref.experts(x, ids, weights)
        shared = torch.sigmoid(ref.shared_expert_gate(x)) * ref.shared_expert(x)
    assert seen == [(7, SHAPES["num_experts"])]
    torch.testing.assert_close(out, routed + 2 * shared, rtol=1e-5, atol=1e-5)
