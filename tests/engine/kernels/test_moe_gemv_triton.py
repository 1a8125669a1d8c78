"""The few-token MoE experts (`moe.gemv`) against the torch reference, bf16-style and W8A8 block FP8.

On the CPU the kernels run in Triton's interpreter (conftest) in fp32 and fp16; the `gpu` tests run the real
Qwen3.5-35B-A3B shapes. Odd sizes (H 48, I 40, a shared expert of another width) leave ragged N tiles and K
steps; small tokens counts with few experts make experts repeat across tokens. Buffers start as NaN
(`nan_empty`), so anything a kernel leaves unwritten shows up.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.fp8 import reference as fp8_reference
from engine.kernels.moe import gemv, reference
from tests.engine.kernels.cases import captured, ids
from tests.engine.kernels.test_moe_triton import (
    DEVICE,
    REL_TOL,
    assert_relative,
    expert_weights,
    needs_cuda,
    rand,
    shared_weights,
)
from tests.engine.kernels.test_moe_triton import nan_empty as nan_empty  # a fixture, used by name

# Small tiles: several N tiles per expert and K steps of 16 fp32 channels with a ragged last one.
SMALL = gemv.GemvTiles(up_n=4, down_n=8, k_bytes=64)


def routed(t, e, k, shared, seed):
    """(weights, ids) [T, k (+1)] of random logits; id E is the shared slot."""
    return reference.route(rand(t, e + shared, seed=seed), k, True, shared=shared)


F32, F16 = torch.float32, torch.float16
# (H, I, shared I, E, top k): odd sizes leave ragged N tiles and K steps; a shared expert of another width.
ODD = [(48, 40, 24, 5, 2), (80, 56, 40, 8, 3)]
# One program per (pair, N tile): the token count adds no branch, only experts repeating across tokens. So
# the dtype and shared-expert variants (the weights' dtype; a shared expert of its own width in slot E, or
# none) each run at 1, 3 and 8 tokens, on the two odd shapes in turn (9 of the 30 combinations); the
# 128-multiple shape (whole tiles, slow in the interpreter) at two counts.
CASES = [
    (t, *ODD[(v + n) % 2], dtype, shared)
    for v, (dtype, shared) in enumerate([(F32, False), (F32, True), (F16, True)])
    for n, t in enumerate((1, 3, 8))
]
CASES += [(1, 256, 128, 128, 8, 3, F32, False), (3, 256, 128, 128, 8, 3, F16, True)]


@pytest.mark.parametrize("t, h, i, shared_i, e, k, dtype, shared", CASES, ids=ids)
def test_experts_match_reference(t, h, i, shared_i, e, k, dtype, shared, nan_empty):
    x = rand(t, h, seed=t).to(dtype)
    w13, w2 = expert_weights(e, h, i, dtype, seed=h + t)
    s13, s2 = shared_weights(h, shared_i, dtype, seed=5) if shared else (None, None)
    weights, ids = routed(t, e, k, shared, seed=t + 1)
    out = gemv.experts(x, w13, w2, weights, ids, s13, s2)
    assert out.dtype == dtype and out.shape == x.shape
    f = torch.float32
    floats = (s13.to(f), s2.to(f)) if shared else ()
    expected = reference.experts(x.to(f), w13.to(f), w2.to(f), weights, ids, *floats)
    assert_relative(out, expected, REL_TOL[dtype])


# The down kernel with K steps and warps of its own (a whole 40-channel row per step, 2 warps).
SPLIT = gemv.GemvTiles(up_n=4, down_n=8, k_bytes=64, down_k_bytes=256, down_warps=2)


@pytest.mark.parametrize("tiles", [SMALL, SPLIT], ids=["small", "down-own"])
@pytest.mark.parametrize("t, shared_i", [(1, 24), (3, 56)])
def test_experts_small_tiles(t, shared_i, tiles, nan_empty):
    # A shared expert narrower and wider than the routed ones (the act buffer and N grid cover the wider).
    h, i, e, k = 48, 40, 5, 2
    x = rand(t, h, seed=3)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=4)
    s13, s2 = shared_weights(h, shared_i, torch.float32, seed=5)
    weights, ids = routed(t, e, k, True, seed=6)
    out = gemv.experts(x, w13, w2, weights, ids, s13, s2, tiles=tiles)
    assert_relative(out, reference.experts(x, w13, w2, weights, ids, s13, s2), REL_TOL[torch.float32])


def test_experts_repeated_experts(nan_empty):
    # Every token on expert 2, one token on it twice, the shared slot (id E) in the middle of a row.
    h, i, e = 32, 24, 4
    x = rand(3, h, seed=1)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=2)
    s13, s2 = shared_weights(h, 16, torch.float32, seed=3)
    ids = torch.tensor([[2, e, 2], [2, e, 0], [3, e, 2]], device=DEVICE)
    weights = rand(3, 3, seed=4).abs()
    out = gemv.experts(x, w13, w2, weights, ids, s13, s2)
    assert_relative(out, reference.experts(x, w13, w2, weights, ids, s13, s2), REL_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_with_shared_output_and_strides(dtype, nan_empty):
    # As the model passes an FP8 shared expert: column slices of the routing, the shared slot's weight as the
    # gate; x a column slice of a wider tensor.
    t, h, i, e, k = 5, 32, 16, 6, 2
    x = rand(t, 2 * h, seed=21).to(dtype)[:, :h]
    w13, w2 = expert_weights(e, h, i, dtype, seed=22)
    weights, ids = routed(t, e, k, True, seed=23)
    shared = rand(t, h, seed=24).to(dtype)
    out = gemv.experts(x, w13, w2, weights[:, :k], ids[:, :k], shared_out=shared, shared_gate=weights[:, k])
    routed_out = reference.experts(x.float(), w13.float(), w2.float(), weights[:, :k], ids[:, :k])
    assert_relative(out, routed_out + weights[:, k:] * shared.float(), REL_TOL[dtype])


def test_experts_deterministic():
    t, h, i, e, k = 3, 32, 16, 4, 3  # 3 tokens with the shared slot: 12 pairs, each summed in a fixed order
    x = rand(t, h, seed=31)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=32)
    s13, s2 = shared_weights(h, i, torch.float32, seed=33)
    weights, ids = routed(t, e, k, True, seed=34)
    first = gemv.experts(x, w13, w2, weights, ids, s13, s2)
    assert torch.equal(first, gemv.experts(x, w13, w2, weights, ids, s13, s2))


def test_unsupported_inputs_fall_back_to_reference():
    t, h, i, e, k = 3, 16, 16, 4, 2
    x = rand(t, h, seed=1).double()
    w13, w2 = expert_weights(e, h, i, torch.float64, seed=2)
    weights, ids = routed(t, e, k, False, seed=3)
    torch.testing.assert_close(
        gemv.experts(x, w13, w2, weights, ids), reference.experts(x, w13, w2, weights, ids)
    )
    empty = gemv.experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, h)


def fp8_weights(e, h, i, block, seed=0, device=DEVICE):
    """e4m3 (w13 [E, 2I, H], its scales [E, 2 ceil(I/bn), ceil(H/bk)], w2 [E, H, I], its scales): the gate and
    up halves quantised separately, their scale rows stacked gate first, as the checkpoints store them."""
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=seed, device=device)
    gate, gate_scale = fp8_reference.quantize_block_fp8_weight(w13[:, :i], block)
    up, up_scale = fp8_reference.quantize_block_fp8_weight(w13[:, i:], block)
    w2_q, w2_scale = fp8_reference.quantize_block_fp8_weight(w2, block)
    return torch.cat([gate, up], 1), torch.cat([gate_scale, up_scale], 1), w2_q, w2_scale


def fp8_linear(a, w, scale, block):
    """W8A8 as `fp8_reference.fp8_block_linear`, kept in fp32: a [M, K] quantised per token and bk channels,
    times the dequantised w [N, K]."""
    q, s = fp8_reference.quantize_fp8_per_token_group(a, block[1])
    a_deq = q.float() * s.repeat_interleave(block[1], dim=-1)[:, : a.shape[-1]]
    return a_deq @ fp8_reference.dequantize_block_fp8(w, scale, block, torch.float32).T


def fp8_expected(x, w13, w13_scale, w2, w2_scale, weights, ids, block, shared_out=None, shared_gate=None):
    """The FP8 experts pair by pair in fp32: act rounded to x's dtype between the projections, as the kernel
    stores it, and the slots summed in fp32."""
    inter = w2.shape[2]
    up_row = -(-inter // block[0])  # the up half's first scale row
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token, slot in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        e, row = ids[token, slot].item(), x[token : token + 1]
        gate = fp8_linear(row, w13[e, :inter], w13_scale[e, :up_row], block)
        up = fp8_linear(row, w13[e, inter:], w13_scale[e, up_row:], block)
        act = (F.silu(gate) * up).to(x.dtype)
        out[token] += weights[token, slot].float() * fp8_linear(act, w2[e], w2_scale[e], block)[0]
    if shared_out is not None:
        out += shared_gate.float()[:, None] * shared_out.float()
    return out


# Same e4m3 values and scales on both sides, fp32 sums in another order (~1e-6); act, rounded to x's dtype
# and requantised, may land on the other side of a rounding step in rare elements. fp16 adds the output's
# rounding (2^-11 relative), as in the bf16-style tests.
FP8_REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


# FP8: 5 and 8 experts (top 2 and 3) with 16 x 16 scale blocks at 1, 3 and 8 tokens, the two variants (fp32
# without a shared expert's output, fp16 with one) in turn; the 128 x 128 blocks of real checkpoints at two.
FP8_CASES = [
    (t, 48, 40, e, e // 3 + 1, (16, 16), *variant)
    for n, t in enumerate((1, 3, 8))
    for m, e in enumerate((5, 8))
    for variant in [[(F32, False), (F16, True)][(n + m) % 2]]
]
FP8_CASES += [(1, 256, 128, 8, 3, (128, 128), F32, False), (3, 256, 128, 8, 3, (128, 128), F16, True)]


@pytest.mark.parametrize("t, h, i, e, k, block, dtype, with_shared", FP8_CASES, ids=ids)
def test_experts_fp8_match_reference(t, h, i, e, k, block, dtype, with_shared, nan_empty):
    x = rand(t, h, seed=t).to(dtype)
    w13, w13_scale, w2, w2_scale = fp8_weights(e, h, i, block, seed=h + t)
    weights, ids = routed(t, e, k, True, seed=t + 1)  # slot k: the shared expert's weight
    shared = (rand(t, h, seed=9).to(dtype), weights[:, k]) if with_shared else (None, None)
    args = (x, w13, w13_scale, w2, w2_scale, weights[:, :k], ids[:, :k], block, *shared)
    out = gemv.experts_fp8(*args)
    assert out.dtype == dtype and out.shape == x.shape
    assert_relative(out, fp8_expected(*args), FP8_REL_TOL[dtype])


@pytest.mark.parametrize("t, block", [(1, (16, 16)), (5, (8, 24))])
def test_experts_fp8_small_tiles(t, block, nan_empty):
    # Scale blocks that the N tiles and K steps cut across, one of 24 channels (a padded power-of-two width);
    # repeated experts.
    h, i, e, k = 48, 40, 3, 2
    x = rand(t, h, seed=41)
    w13, w13_scale, w2, w2_scale = fp8_weights(e, h, i, block, seed=42)
    weights, ids = routed(t, e, k, False, seed=43)
    args = (x, w13, w13_scale, w2, w2_scale, weights, ids, block)
    tiles = gemv.GemvTiles(up_n=4, down_n=8, k_bytes=16)
    assert_relative(gemv.experts_fp8(*args, tiles=tiles), fp8_expected(*args), FP8_REL_TOL[torch.float32])


def test_experts_fp8_zero_group(nan_empty):
    # A token of zeros in its first 16 channels: that group's amax is guarded, not divided by.
    h, i, e, k, block = 48, 40, 4, 2, (16, 16)
    x = rand(2, h, seed=51)
    x[0, :16] = 0.0
    w13, w13_scale, w2, w2_scale = fp8_weights(e, h, i, block, seed=52)
    weights, ids = routed(2, e, k, False, seed=53)
    args = (x, w13, w13_scale, w2, w2_scale, weights, ids, block)
    assert_relative(gemv.experts_fp8(*args), fp8_expected(*args), FP8_REL_TOL[torch.float32])


# Qwen3.5-35B-A3B: hidden 2048, 256 experts of intermediate 512, top 8, renormalised, a shared expert of 512.
H, I, E, K = 2048, 512, 256, 8


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_experts_real_shapes_gpu(t):
    x = rand(t, H, seed=t).to(torch.bfloat16)
    w13, w2 = expert_weights(E, H, I, torch.bfloat16, seed=1)
    s13, s2 = shared_weights(H, I, torch.bfloat16, seed=2)
    weights, ids = routed(t, E, K, True, seed=t + 1)
    out = gemv.experts(x, w13, w2, weights, ids, s13, s2)
    f = torch.float32
    expected = reference.experts(x.to(f), w13.to(f), w2.to(f), weights, ids, s13.to(f), s2.to(f))
    assert out.dtype == torch.bfloat16
    assert_relative(out, expected, REL_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 4, 8])
def test_experts_fp8_real_shapes_gpu(t):
    x = rand(t, H, seed=t).to(torch.bfloat16)
    w13, w13_scale, w2, w2_scale = fp8_weights(E, H, I, (128, 128), seed=1)
    weights, ids = routed(t, E, K, True, seed=t + 1)
    shared = (rand(t, H, seed=3).to(torch.bfloat16), weights[:, K])
    args = (x, w13, w13_scale, w2, w2_scale, weights[:, :K], ids[:, :K], (128, 128), *shared)
    out = gemv.experts_fp8(*args)
    assert_relative(out, fp8_expected(*args), FP8_REL_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 8])
def test_experts_replay_in_cuda_graph_gpu(t):
    # No host sync: captured once, replayed on new tokens and routing, equal to an eager call.
    w13, w2 = expert_weights(E, H, I, torch.bfloat16, seed=1)
    s13, s2 = shared_weights(H, I, torch.bfloat16, seed=2)
    x = rand(t, H, seed=3).to(torch.bfloat16)
    weights, ids = routed(t, E, K, True, seed=4)

    def block():
        return gemv.experts(x, w13, w2, weights, ids, s13, s2)

    graph, out = captured(block)
    new_weights, new_ids = routed(t, E, K, True, seed=5)
    x.copy_(rand(t, H, seed=6))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, block(), rtol=0, atol=0)
