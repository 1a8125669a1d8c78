"""Triton MoE routing and experts against the torch reference, over odd token counts and expert sizes.

On the CPU these run in Triton's interpreter (conftest), which only handles fp32/fp16 `tl.dot`; the `gpu`
tests run the real Qwen3.5-35B-A3B shapes in bf16. The wrapper's buffers are filled with NaN (see
`nan_empty`), so anything a kernel leaves unwritten shows up in the output.
"""

import pytest
import torch

from engine.kernels import dispatch
from engine.kernels.moe import reference
from engine.kernels.moe import triton as moe_triton
from tests.engine.kernels.cases import captured, crossed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# fp16 GEMMs round act and each slot's output to fp16 (about 5e-4 relative each) where the fp32 reference
# keeps fp32; fp32 differs only in summation order.
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}

_EMPTY = torch.empty


def _nan_empty(*args, **kwargs):
    out = _EMPTY(*args, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-7)


@pytest.fixture
def nan_empty(monkeypatch):
    """Every torch.empty the wrapper allocates starts as NaN (floats) or -7 (integers)."""
    monkeypatch.setattr(torch, "empty", _nan_empty)


def rand(*shape, seed=0, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def expert_weights(e, h, i, dtype, seed=0, device=DEVICE):
    # Scaled so the activations and the output stay of order one.
    w13 = rand(e, 2 * i, h, seed=seed, device=device) * h**-0.5
    w2 = rand(e, h, i, seed=seed + 1, device=device) * i**-0.5
    return w13.to(dtype), w2.to(dtype)


def assert_relative(out, expected, rel_tol):
    """Relative error of the whole tensor (flash-linear-attention's check), then elementwise near it."""
    out, expected = out.float(), expected.float()
    assert not out.isnan().any()
    error = (out - expected).norm() / expected.norm().clamp_min(1e-12)
    assert error < rel_tol, f"relative error {error:.2e} over {rel_tol:.0e}"
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=10 * rel_tol, atol=10 * rel_tol * scale)


def assert_same_topk(weights, ids, logits, top_k, renormalize):
    """Same weights as the reference, and ids that pick those probabilities; ties may pick other ids."""
    ref_weights, ref_ids = reference.route(logits, top_k, renormalize)
    assert ids.dtype == ref_ids.dtype and weights.dtype == torch.float32
    # fp32 softmax either way; exp and the sum's order differ by an ulp or two.
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(probs.gather(-1, ids), probs.gather(-1, ref_ids), rtol=1e-5, atol=1e-7)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an expert was picked twice"


# Every (tokens, experts, top k) in every logits dtype; renormalised or not in turn (cases.crossed).
@pytest.mark.parametrize(
    "tek, dtype, renormalize",
    crossed(
        [(1, 5, 2), (3, 8, 3), (17, 5, 2), (65, 8, 3), (3, 256, 8), (17, 256, 8)],
        [torch.float32, torch.float16, torch.bfloat16],
        [True, False],
    ),
)
def test_route_matches_reference(tek, dtype, renormalize, nan_empty):
    t, e, k = tek
    logits = (rand(t, e, seed=t + e) * 3).to(dtype)
    weights, ids = moe_triton.route(logits, k, renormalize)
    assert_same_topk(weights, ids, logits, k, renormalize)
    assert (weights[:, :-1] >= weights[:, 1:]).all(), "weights are not in descending order"


@pytest.mark.parametrize("t, e, k", [(1, 5, 2), (17, 8, 3), (3, 256, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_with_shared_gate(t, e, k, dtype, nan_empty):
    # Logit E is the shared expert's gate: slot k gets sigmoid(logit) and id E; the rest is routing as usual.
    logits = (rand(t, e + 1, seed=t + e) * 3).to(dtype)
    weights, ids = moe_triton.route(logits, k, True, shared=True)
    assert weights.shape == ids.shape == (t, k + 1)
    assert_same_topk(weights[:, :k], ids[:, :k], logits[:, :e], k, True)
    assert (ids[:, k] == e).all()
    torch.testing.assert_close(weights[:, k], torch.sigmoid(logits[:, e].float()), rtol=1e-6, atol=1e-7)
    ref_weights, _ = reference.route(logits, k, True, shared=True)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)


def test_route_ids_equal_reference_without_ties():
    logits = rand(17, 256, seed=5) * 3  # fp32 draws: no two probabilities equal
    weights, ids = moe_triton.route(logits, 8, True)
    ref_weights, ref_ids = reference.route(logits, 8, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)


def test_route_ties_pick_distinct_experts():
    logits = torch.zeros(3, 6, device=DEVICE)  # all tied: any 4 distinct experts, 1/4 each renormalised
    weights, ids = moe_triton.route(logits, 4, True)
    torch.testing.assert_close(weights, torch.full((3, 4), 0.25, device=DEVICE))
    assert_same_topk(weights, ids, logits, 4, True)


# Up to gemv.MAX_PAIRS (token, slot) pairs `experts` takes the gemv kernels, tested at every size in
# test_moe_gemv_triton and here at one token, through this entry; 81 tokens (162 or 243 pairs) take the
# grouped GEMMs. (Tens of tokens on gemv cost tens of seconds in the interpreter and add no path.)
@pytest.mark.parametrize(
    "t, shape, dtype",
    crossed([1, 81], [(32, 16, 5, 2), (48, 24, 7, 3), (64, 32, 8, 3)], [torch.float32, torch.float16]),
)
def test_experts_match_reference(t, shape, dtype, nan_empty):
    h, i, e, k = shape
    x = rand(t, h, seed=t).to(dtype)
    w13, w2 = expert_weights(e, h, i, dtype, seed=h + t)
    logits = rand(t, e, seed=t + 1)
    logits[:, 0] = float("-inf")  # expert 0 receives no tokens
    weights, ids = reference.route(logits, k, renormalize=True)
    out = moe_triton.experts(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference.experts(x.float(), w13.float(), w2.float(), weights, ids)
    assert_relative(out, expected, REL_TOL[dtype])


@pytest.mark.parametrize("t", [3, 65])
@pytest.mark.parametrize("block_m, block_n, block_k", [(16, 16, 16), (32, 16, 32), (64, 64, 64)])
def test_experts_tile_sizes(t, block_m, block_n, block_k, nan_empty):
    # Several N tiles, a K loop with a ragged last step (H 48, I 24), and experts spanning several M blocks.
    h, i, e, k = 48, 24, 5, 3
    x = rand(t, h, seed=7)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=8)
    weights, ids = reference.route(rand(t, e, seed=9), k, renormalize=False)
    config = moe_triton.ExpertsConfig.uniform(block_m, block_n, block_k)
    out = moe_triton.fused_experts(x, w13, w2, weights, ids, config)
    assert_relative(out, reference.experts(x, w13, w2, weights, ids), REL_TOL[torch.float32])


def shared_weights(h, i, dtype, seed=0, device=DEVICE):
    w13, w2 = expert_weights(1, h, i, dtype, seed=seed, device=device)
    return w13[0], w2[0]


# One token takes gemv, 49 (147 or 196 pairs with the shared slot) the grouped GEMMs.
@pytest.mark.parametrize(
    "t, shape, dtype",
    crossed(
        [1, 49],
        [(32, 16, 16, 5, 2), (48, 24, 40, 7, 3), (64, 32, 8, 8, 3)],
        [torch.float32, torch.float16],
    ),
)
def test_experts_with_shared_expert(t, shape, dtype, nan_empty):
    h, i, shared_i, e, k = shape
    # Expert id E is the shared expert (its own intermediate size), one more slot of every token.
    x = rand(t, h, seed=t).to(dtype)
    w13, w2 = expert_weights(e, h, i, dtype, seed=h + t)
    s13, s2 = shared_weights(h, shared_i, dtype, seed=5)
    weights, ids = reference.route(rand(t, e + 1, seed=t + 2), k, True, shared=True)
    out = moe_triton.experts(x, w13, w2, weights, ids, s13, s2)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference.experts(x.float(), w13.float(), w2.float(), weights, ids, s13.float(), s2.float())
    assert_relative(out, expected, REL_TOL[dtype])


def test_reference_shared_expert_is_the_gated_mlp():
    # The reference's shared slot is transformers' `sigmoid(gate(x)) * shared_expert(x)`, added last.
    t, h, i, e, k = 9, 32, 16, 6, 2
    x = rand(t, h, seed=1)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=2)
    s13, s2 = shared_weights(h, 24, torch.float32, seed=3)
    logits = rand(t, e + 1, seed=4)
    weights, ids = reference.route(logits, k, True, shared=True)
    routed = reference.experts(x, w13, w2, weights[:, :k], ids[:, :k])
    gate, up = (x @ s13.T).chunk(2, dim=-1)
    shared = (torch.nn.functional.silu(gate) * up) @ s2.T
    expected = routed + torch.sigmoid(logits[:, e:]) * shared
    torch.testing.assert_close(reference.experts(x, w13, w2, weights, ids, s13, s2), expected)


@pytest.mark.parametrize("split_k, block_k", [(2, 16), (3, 16), (4, 32)])
def test_experts_down_split_k(split_k, block_k, nan_empty):
    # The down GEMM's K (I 24, shared 40) cut into fp32 partial sums; some splits get no K at all (zeros).
    t, h, i, e, k = 17, 48, 24, 5, 3
    x = rand(t, h, seed=11)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=12)
    s13, s2 = shared_weights(h, 40, torch.float32, seed=13)
    weights, ids = reference.route(rand(t, e + 1, seed=14), k, False, shared=True)
    config = moe_triton.ExpertsConfig.uniform(16, 16, block_k, split_k=split_k)
    out = moe_triton.fused_experts(x, w13, w2, weights, ids, config, s13, s2)
    expected = reference.experts(x, w13, w2, weights, ids, s13, s2)
    assert_relative(out, expected, REL_TOL[torch.float32])


# 3 tokens take the gemv kernels, 73 (146 pairs) the grouped GEMMs.
@pytest.mark.parametrize("t, dtype", [(3, torch.float16), (73, torch.float32)])
def test_experts_with_shared_output(t, dtype, nan_empty):
    # An FP8 shared expert runs on its own: the model passes the routed slots (column slices) and the shared
    # expert's output with its slot's weight, which the combine adds.
    h, i, e, k = 32, 16, 6, 2
    x = rand(t, h, seed=21).to(dtype)
    w13, w2 = expert_weights(e, h, i, dtype, seed=22)
    weights, ids = reference.route(rand(t, e + 1, seed=23), k, True, shared=True)
    shared = rand(t, h, seed=24).to(dtype)
    out = moe_triton.experts(
        x, w13, w2, weights[:, :k], ids[:, :k], shared_out=shared, shared_gate=weights[:, k]
    )
    routed = reference.experts(x.float(), w13.float(), w2.float(), weights[:, :k], ids[:, :k])
    expected = routed + weights[:, k:] * shared.float()
    assert_relative(out, expected, REL_TOL[dtype])
    torch.testing.assert_close(
        reference.experts(
            x, w13, w2, weights[:, :k], ids[:, :k], shared_out=shared, shared_gate=weights[:, k]
        ),
        reference.experts(x, w13, w2, weights[:, :k], ids[:, :k]) + weights[:, k:].to(dtype) * shared,
    )


def test_experts_deterministic():
    t, h, i, e, k = 40, 32, 16, 4, 3
    x = rand(t, h, seed=31)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=32)
    s13, s2 = shared_weights(h, i, torch.float32, seed=33)
    weights, ids = reference.route(rand(t, e + 1, seed=34), k, True, shared=True)
    first = moe_triton.experts(x, w13, w2, weights, ids, s13, s2)
    assert torch.equal(first, moe_triton.experts(x, w13, w2, weights, ids, s13, s2))


@pytest.mark.parametrize("t", [3, 73])  # the gemv kernels, the grouped GEMMs
def test_experts_strided_inputs(t):
    # x a column slice of a wider tensor, w13 transposed storage: the kernels follow strides.
    h, i, e, k = 32, 16, 6, 2
    x = rand(t, 2 * h, seed=1)[:, :h]
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=2)
    w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    weights, ids = reference.route(rand(t, e, seed=3), k, renormalize=True)
    out = moe_triton.experts(x, w13, w2, weights, ids)
    assert_relative(out, reference.experts(x, w13, w2, weights, ids), REL_TOL[torch.float32])


def test_registered_with_dispatch():
    assert dispatch.implementation("moe_route", "triton") is moe_triton.route
    assert dispatch.implementation("moe_experts", "triton") is moe_triton.experts


def test_unsupported_dtypes_fall_back_to_reference():
    t, h, i, e, k = 3, 16, 16, 4, 2
    x = rand(t, h, seed=1)
    w13, w2 = expert_weights(e, h, i, torch.float64, seed=2)
    weights, ids = reference.route(rand(t, e, seed=3), k, renormalize=True)
    out = moe_triton.experts(x.double(), w13, w2, weights, ids)
    torch.testing.assert_close(out, reference.experts(x.double(), w13, w2, weights, ids))


# Qwen3.5-35B-A3B: hidden 2048, 256 experts of intermediate 512, top 8, renormalised.
H, I, E, K = 2048, 512, 256, 8


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 3, 64, 130, 1000, 4096])
def test_route_real_shapes_gpu(t):
    logits = (rand(t, E, seed=t) * 2).to(torch.bfloat16)  # bf16 logits: ties happen
    weights, ids = moe_triton.route(logits, K, True)
    assert_same_topk(weights, ids, logits, K, True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 3, 64, 130, 1000, 4096])
def test_experts_real_shapes_gpu(t):
    x = rand(t, H, seed=t).to(torch.bfloat16)
    w13, w2 = expert_weights(E, H, I, torch.bfloat16, seed=1)
    weights, ids = reference.route(rand(t, E, seed=t + 1), K, renormalize=True)
    out = moe_triton.experts(x, w13, w2, weights, ids)
    # bf16 rounds act and each slot's output (2^-8 relative each) where the fp32 reference does not.
    expected = reference.experts(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == torch.bfloat16
    assert_relative(out, expected, REL_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 3, 64, 130, 1000, 4096])
def test_experts_with_shared_real_shapes_gpu(t):
    x = rand(t, H, seed=t).to(torch.bfloat16)
    w13, w2 = expert_weights(E, H, I, torch.bfloat16, seed=1)
    s13, s2 = shared_weights(H, I, torch.bfloat16, seed=2)
    weights, ids = moe_triton.route(rand(t, E + 1, seed=t + 1).to(torch.bfloat16), K, True, shared=True)
    out = moe_triton.experts(x, w13, w2, weights, ids, s13, s2)
    f = torch.float32
    expected = reference.experts(x.to(f), w13.to(f), w2.to(f), weights, ids, s13.to(f), s2.to(f))
    assert_relative(out, expected, REL_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 16, 64])
def test_route_and_experts_replay_in_cuda_graph_gpu(t):
    # No host sync anywhere: captured once, replayed on new tokens and logits, same as running it eagerly.
    w13, w2 = expert_weights(E, H, I, torch.bfloat16, seed=1)
    s13, s2 = shared_weights(H, I, torch.bfloat16, seed=2)
    x = rand(t, H, seed=3).to(torch.bfloat16)
    logits = rand(t, E + 1, seed=4).to(torch.bfloat16)

    def block():
        weights, ids = moe_triton.route(logits, K, True, shared=True)
        return moe_triton.experts(x, w13, w2, weights, ids, s13, s2)

    graph, out = captured(block)
    x.copy_(rand(t, H, seed=5))
    logits.copy_(rand(t, E + 1, seed=6))
    graph.replay()
    torch.testing.assert_close(out, block(), rtol=0, atol=0)
