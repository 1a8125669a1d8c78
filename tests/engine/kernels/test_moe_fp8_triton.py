"""Triton FP8 experts (block-FP8 weights, W8A8) against `reference.fp8_experts`, over odd token counts, sizes
that are not multiples of the scale block, and the real 128 x 128 block; and the reference itself against
independent computations.

Kernel and reference quantise the same activations to the same e4m3 values and scales (`quantize_rows` is the
reference quantiser bit for bit), so they differ by fp32 summation order, plus the rounding of act and each
slot's output to x's dtype. On the CPU the kernels run in Triton's interpreter (conftest), which emulates the
e4m3 `tl.dot` but casts fp32 to bf16 by truncation (act, stored in x's dtype, then lands one bf16 ulp off and
its e4m3 rounding moves: 3% apart), so bf16 activations are tested on the GPU only. Buffers start as NaN.
"""

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import dispatch
from engine.kernels.fp8.reference import (
    dequantize_block_fp8,
    quantize_block_fp8_weight,
    quantize_fp8_per_token_group,
)
from engine.kernels.moe import fp8 as moe_fp8
from engine.kernels.moe import gemv, reference
from engine.kernels.moe.config import ExpertsConfig
from engine.model.fp8_linear import quantize_gate_up
from tests.engine.kernels.cases import captured, crossed
from tests.engine.kernels.test_moe_triton import assert_relative, rand

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# fp32: summation order only (measured <= 1e-6). fp16/bf16: act and each slot's output are rounded to x's
# dtype on both sides from fp32 values that differ in the last bits, so a rounding may land one ulp apart
# (fp16 2**-11, bf16 2**-8 relative) and, rarely, move an act element one e4m3 step.
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}

_EMPTY = torch.empty


def _nan_empty(*args, **kwargs):
    out = _EMPTY(*args, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-7)


@pytest.fixture
def nan_empty(monkeypatch):
    """Every torch.empty the wrapper allocates starts as NaN (floats) or -7 (integers)."""
    monkeypatch.setattr(torch, "empty", _nan_empty)


def blocky(w, rows, bk, seed):
    """w [E, N, K] with each (scale row, K block) multiplied by its own power of two in 1/8..2, so a scale
    read from the wrong block shows; rows [N] maps each row to its scale row."""
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** torch.randint(-3, 2, (w.shape[0], int(rows.max()) + 1, -(-w.shape[2] // bk)), generator=g)
    return w * mag[:, rows].repeat_interleave(bk, dim=2)[..., : w.shape[2]]


def expert_weights(e, h, i, block, seed=0):
    """Unquantised fp32 (w13 [E, 2I, H], w2 [E, H, I]) on the CPU, outputs of order one."""
    bn, bk = block
    half = -(-i // bn)
    gate_up_rows = torch.cat([torch.arange(i) // bn, half + torch.arange(i) // bn])
    w13 = blocky(rand(e, 2 * i, h, seed=seed, device="cpu") * h**-0.5, gate_up_rows, bk, seed + 2)
    w2 = blocky(rand(e, h, i, seed=seed + 1, device="cpu") * i**-0.5, torch.arange(h) // bn, bk, seed + 3)
    return w13, w2


def fp8_weights(e, h, i, block, seed=0, device=DEVICE):
    """(w13 e4m3 [E, 2I, H], w13_scale [E, 2 * ceil(I/bn), ceil(H/bk)], w2 e4m3 [E, H, I], w2_scale)."""
    w13, w2 = expert_weights(e, h, i, block, seed)
    q13, s13 = quantize_gate_up(w13, block)
    q2, s2 = quantize_block_fp8_weight(w2, block)
    return tuple(w.to(device) for w in (q13, s13, q2, s2))


def routing(t, e, k, seed, device=DEVICE):
    logits = rand(t, e, seed=seed, device=device)
    logits[:, 0] = float("-inf")  # expert 0 receives no tokens
    return reference.route(logits, k, renormalize=True)


# Up to gemv.MAX_PAIRS (token, slot) pairs `experts` takes the FP8 gemv kernels, tested at every size in
# test_moe_gemv_triton and here at one token, through this entry; 81 tokens (162 or 243 pairs) take the
# grouped GEMMs. (Tens of tokens on gemv cost a minute in the interpreter and add no path.)
@pytest.mark.parametrize(
    "t, shape, dtype",
    crossed(
        [1, 81],
        [(48, 40, 5, 2, (16, 16)), (48, 40, 8, 3, (32, 32)), (64, 40, 5, 2, (16, 32))],
        [torch.float32, torch.float16],
    ),
)
def test_experts_match_reference(t, shape, dtype, nan_empty):
    # H, I not multiples of the block (partial scale blocks, a ragged last K step); bn != bk in the last.
    h, i, e, k, block = shape
    x = rand(t, h, seed=t).to(dtype)
    w = fp8_weights(e, h, i, block, seed=h + t)
    weights, ids = routing(t, e, k, seed=t + 1)
    out = moe_fp8.experts(x, *w, weights, ids, block)
    assert out.dtype == dtype and out.shape == x.shape
    assert_relative(out, reference.fp8_experts(x, *w, weights, ids, block), REL_TOL[dtype])


@pytest.mark.parametrize("h, i", [(256, 128), (320, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_real_block(h, i, dtype, nan_empty):
    # 128 x 128 blocks, as real checkpoints; (320, 192): partial blocks in H and I, and an I that 128 does not
    # divide (the gate and up halves each start a fresh row block). 73 tokens: 146 pairs, over gemv.MAX_PAIRS,
    # so the grouped GEMMs (the gemv kernels at these blocks: test_moe_gemv_triton).
    t = 73
    block, e, k = (128, 128), 4, 2
    x = rand(t, h, seed=t).to(dtype)
    w = fp8_weights(e, h, i, block, seed=3)
    weights, ids = routing(t, e, k, seed=t + 4)
    out = moe_fp8.experts(x, *w, weights, ids, block)
    assert out.dtype == dtype
    expected = reference.fp8_experts(x, *w, weights, ids, block)
    if dtype != torch.float32:
        assert_relative(out, expected, REL_TOL[dtype])
        return
    # fp32: every token's row to REL_TOL but at most one. An activation that lies on an e4m3 rounding
    # boundary may round to the other neighbour when the gate/up sums differ in their last bit (here the
    # interpreter's tl.dot, numpy's BLAS, sums in another order than the reference's matmul): measured at
    # (65, 320, 192), one element of token 20's activation, 2.7e-4 on its row against ~1e-7 elsewhere, 1.04e-5
    # over the whole tensor; at 73 tokens none (rows at most 1.1e-6). Such a row still stays within an e4m3
    # step of its activation.
    errors = (out - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-12)
    assert (errors >= REL_TOL[dtype]).sum() <= 1, errors
    assert errors.max() < 1e-3, errors


@pytest.mark.parametrize("block_m, block_n, split_k", [(16, 16, 1), (32, 16, 2), (64, 64, 3), (16, 32, 4)])
def test_experts_tile_sizes(block_m, block_n, split_k, nan_empty):
    # Several N tiles, experts spanning several M blocks, the down GEMM's 3 K groups split 2, 3 and 4 ways
    # (some splits get none: zeros); BLOCK_K in the config is ignored (it is bk).
    t, h, i, e, k, block = 33, 48, 40, 5, 3, (16, 16)
    x = rand(t, h, seed=7)
    w = fp8_weights(e, h, i, block, seed=8)
    weights, ids = routing(t, e, k, seed=9)
    config = ExpertsConfig.uniform(block_m, block_n, 64, split_k=split_k)
    out = moe_fp8.fused_experts(x, *w, weights, ids, block, config)
    assert_relative(out, reference.fp8_experts(x, *w, weights, ids, block), REL_TOL[torch.float32])


def test_experts_without_fp8_dot(monkeypatch, nan_empty):
    # Before sm_89 the grouped GEMMs multiply fp16 copies of the e4m3 tiles (exact in fp16): the same sums.
    monkeypatch.setattr(moe_fp8, "has_fp8_dot", lambda device: False)
    t, h, i, e, k, block = 33, 48, 40, 5, 3, (16, 16)
    x = rand(t, h, seed=17)
    w = fp8_weights(e, h, i, block, seed=18)
    weights, ids = routing(t, e, k, seed=19)
    config = ExpertsConfig.uniform(16, 16, 64, split_k=2)
    out = moe_fp8.fused_experts(x, *w, weights, ids, block, config)
    assert_relative(out, reference.fp8_experts(x, *w, weights, ids, block), REL_TOL[torch.float32])


# 3 tokens take the gemv kernels, 73 (146 pairs) the grouped GEMMs.
@pytest.mark.parametrize("t, dtype", [(3, torch.float16), (73, torch.float32)])
def test_experts_with_shared_output(t, dtype, nan_empty):
    # The shared expert (FP8 Fp8Linears) runs outside; the routed slots are column slices of the routing
    # with the shared slot, whose weight scales the shared output in the combine.
    h, i, e, k, block = 48, 40, 6, 2, (16, 16)
    x = rand(t, h, seed=21).to(dtype)
    w = fp8_weights(e, h, i, block, seed=22)
    weights, ids = reference.route(rand(t, e + 1, seed=23), k, True, shared=True)
    shared = rand(t, h, seed=24).to(dtype)
    args = (x, *w, weights[:, :k], ids[:, :k], block, shared, weights[:, k])
    out = moe_fp8.experts(*args)
    assert_relative(out, reference.fp8_experts(*args), REL_TOL[dtype])
    routed = reference.fp8_experts(x, *w, weights[:, :k], ids[:, :k], block)
    expected = routed.float() + weights[:, k:] * shared.float()
    torch.testing.assert_close(reference.fp8_experts(*args).float(), expected, **rounded(dtype))


def rounded(dtype):
    """Tolerance of one rounding to dtype of values of order one."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=eps, atol=eps * 4)


@pytest.mark.parametrize("t", [3, 73])  # the gemv kernels, the grouped GEMMs
def test_experts_strided_inputs(t, nan_empty):
    # x a column slice of a wider tensor, w13 in transposed storage, weights a column slice: strides followed.
    h, i, e, k, block = 48, 40, 6, 2, (16, 16)
    x = rand(t, 2 * h, seed=1)[:, :h]
    w13, s13, w2, s2 = fp8_weights(e, h, i, block, seed=2)
    w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    weights, ids = reference.route(rand(t, e + 1, seed=3), k, True, shared=True)
    args = (x, w13, s13, w2, s2, weights[:, :k], ids[:, :k], block)
    assert_relative(moe_fp8.experts(*args), reference.fp8_experts(*args), REL_TOL[torch.float32])


def test_reference_by_hand():
    # The W8A8 definition written out: per K block, the e4m3 product times x_scale * w_scale, with gate row r
    # on scale row r // bn and up row r on ceil(I/bn) + r // bn; one token, one expert, routing weight 1.
    h, i, e, block = 48, 40, 3, (16, 16)
    bn, bk = block
    w13, s13, w2, s2 = fp8_weights(e, h, i, block, seed=5, device="cpu")
    x = rand(1, h, seed=6)
    expert = 2

    def w8a8(v, q, scale, row_block):  # v [K] fp32, q [N, K] e4m3, scale rows row_block [N] -> [N]
        vq, vs = quantize_fp8_per_token_group(v[None], bk)
        out = torch.zeros(q.shape[0], dtype=torch.float64)
        for kb in range(-(-v.shape[0] // bk)):
            cols = slice(kb * bk, (kb + 1) * bk)
            part = q[:, cols].double() @ vq[0, cols].double()
            out += part * vs[0, kb].double() * scale[row_block, kb].double()
        return out

    rows = torch.arange(i) // bn
    gate = w8a8(x[0], w13[expert, :i], s13[expert], rows)
    up = w8a8(x[0], w13[expert, i:], s13[expert], -(-i // bn) + rows)
    act = (F.silu(gate) * up).float()
    expected = w8a8(act, w2[expert], s2[expert], torch.arange(h) // bn).float()
    weights, ids = torch.ones(1, 1), torch.full((1, 1), expert)
    out = reference.fp8_experts(x, w13, s13, w2, s2, weights, ids, block)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_close_to_unquantised_experts(dtype):
    # Against `reference.experts` on the dequantised weights (an independent path: no activation rounding).
    # e4m3 keeps 3 mantissa bits: a rounded activation is off by up to 2**-4 relative, ~2.5% rms, and a dot
    # product of such errors moves by about as much relative to its norm. x's rounding moves gate and up by
    # ~2.5% each, so act by ~3.5%, and act's own rounding adds ~2.5% in quadrature: ~4.5%. Measured 4.4%
    # (fp32) and 4.1% (bf16); the gate and up scale blocks swapped give 116%.
    t, h, i, e, k, block = 65, 256, 192, 6, 2, (128, 128)
    x = rand(t, h, seed=31).to(dtype)
    w13, s13, w2, s2 = fp8_weights(e, h, i, block, seed=32, device="cpu")
    weights, ids = routing(t, e, k, seed=33, device="cpu")
    out = reference.fp8_experts(x, w13, s13, w2, s2, weights, ids, block)
    half = -(-i // block[0])
    gate = dequantize_block_fp8(w13[:, :i], s13[:, :half], block, torch.float32)
    up = dequantize_block_fp8(w13[:, i:], s13[:, half:], block, torch.float32)
    down = dequantize_block_fp8(w2, s2, block, torch.float32)
    exact = reference.experts(x.float(), torch.cat([gate, up], dim=1), down, weights, ids)
    error = ((out.float() - exact).norm() / exact.norm()).item()
    assert 0.02 < error < 0.07, f"relative error {error:.4f}"


def test_scale_layout_is_the_stacked_block_scale_when_bn_divides_i():
    # Qwen's FP8 releases store gate_proj and up_proj with their own scales; stacked, they are the [2I, H]
    # block scale when 128 divides I (512 in Qwen3.5-35B-A3B).
    w13, _ = expert_weights(2, 48, 32, (16, 16), seed=41)
    q, s = quantize_gate_up(w13, (16, 16))
    ref_q, ref_s = quantize_block_fp8_weight(w13, (16, 16))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


def test_falls_back_to_reference():
    h, i, e, k = 48, 40, 4, 2
    t = gemv.MAX_PAIRS // k + 1  # past the small-batch path (which takes any block): the grouped GEMMs
    x = rand(t, h, seed=51)
    weights, ids = routing(t, e, k, seed=52)
    w = fp8_weights(e, h, i, (16, 24), seed=53)  # bk 24: not a power of two, no BLOCK_K for it
    out = moe_fp8.experts(x, *w, weights, ids, (16, 24))
    assert torch.equal(out, reference.fp8_experts(x, *w, weights, ids, (16, 24)))
    w = fp8_weights(e, h, i, (16, 16), seed=54)
    empty = moe_fp8.experts(x[:0], *w, weights[:0], ids[:0], (16, 16))
    assert empty.shape == (0, h)


def test_registered_with_dispatch(monkeypatch):
    assert dispatch.implementation("moe_experts_fp8", "triton") is moe_fp8.experts
    assert dispatch.implementation("moe_experts_fp8", "torch") is reference.fp8_experts
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    t, h, i, e, k, block = 9, 48, 40, 4, 2, (16, 16)
    x = rand(t, h, seed=61)
    w = fp8_weights(e, h, i, block, seed=62)
    weights, ids = routing(t, e, k, seed=63)
    out = kernels.moe_experts_fp8(x, *w, weights, ids, block)
    assert_relative(out, reference.fp8_experts(x, *w, weights, ids, block), REL_TOL[torch.float32])


def test_tiles_keyed_by_fp8(monkeypatch):
    # A tuned table is looked up under dtype float8_e4m3fn (bf16 tunings do not apply); BLOCK_K is the scale
    # group whatever the table or the shape rules say.
    tuned = ExpertsConfig.uniform(32, 64, 64, num_stages=2)
    keys = []
    monkeypatch.setattr(moe_fp8, "tuned_config", lambda t, key, device: keys.append(key) or tuned)
    w2 = torch.empty(256, 2048, 512, dtype=torch.float8_e4m3fn, device="meta")
    x = torch.empty(16, 2048, dtype=torch.bfloat16)
    config = moe_fp8.choose(16, x, w2, 8, 128)
    assert keys == ["E=256,H=2048,I=512,k=8,dtype=float8_e4m3fn"]
    assert config == ExpertsConfig.uniform(32, 64, 128, num_stages=2)


# Qwen3.5-35B-A3B: hidden 2048, 256 experts of intermediate 512, top 8, 128 x 128 blocks.
H, I, E, K, BLOCK = 2048, 512, 256, 8, (128, 128)


@pytest.fixture(scope="module")
def real_weights():
    return fp8_weights(E, H, I, BLOCK, seed=1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 16, 64, 256])
def test_experts_real_shapes_gpu(t, real_weights):
    x = rand(t, H, seed=t).to(torch.bfloat16)
    weights, ids = reference.route(rand(t, E, seed=t + 1), K, renormalize=True)
    out = moe_fp8.experts(x, *real_weights, weights, ids, BLOCK)
    assert out.dtype == torch.bfloat16
    assert_relative(
        out, reference.fp8_experts(x, *real_weights, weights, ids, BLOCK), REL_TOL[torch.bfloat16]
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64])
def test_experts_with_shared_output_real_shapes_gpu(t, real_weights):
    x = rand(t, H, seed=t).to(torch.bfloat16)
    weights, ids = reference.route(rand(t, E + 1, seed=t + 2), K, True, shared=True)
    shared = rand(t, H, seed=t + 3).to(torch.bfloat16)
    args = (x, *real_weights, weights[:, :K], ids[:, :K], BLOCK, shared, weights[:, K])
    assert_relative(moe_fp8.experts(*args), reference.fp8_experts(*args), REL_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
def test_experts_replay_in_cuda_graph_gpu(real_weights):
    # Shapes decide everything (no host sync): captured once, replayed on new tokens and routing.
    t = 16
    x = rand(t, H, seed=3).to(torch.bfloat16)
    weights, ids = reference.route(rand(t, E, seed=4), K, renormalize=True)
    graph, out = captured(lambda: moe_fp8.experts(x, *real_weights, weights, ids, BLOCK))
    new_weights, new_ids = reference.route(rand(t, E, seed=6), K, renormalize=True)
    x.copy_(rand(t, H, seed=5))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, moe_fp8.experts(x, *real_weights, weights, ids, BLOCK), rtol=0, atol=0)
