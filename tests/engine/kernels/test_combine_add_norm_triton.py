"""The MoE combine fused into the residual add + RMSNorm after it (`combine_add_rms_norm` and `_fp8`): bit for
bit the combine followed by the add + norm it replaces, over odd shapes; the experts' deferred output
(`PendingCombine`) equal to the tensor they return otherwise; a tiny model's logits equal with the fused op on
and off; held back from CUDA. On the CPU under Triton's interpreter (conftest), fp32 and fp16; the `gpu`
tests run Qwen3.5-35B-A3B's shapes in bf16. Buffers start as NaN (`nan_empty`), so anything left unwritten
shows up.
"""

import pytest
import torch

from engine import kernels
from engine.bench.presets import random_model
from engine.config import config_from_dict
from engine.env import reset_engine_env
from engine.kernels import PendingCombine, dispatch
from engine.kernels.moe import pending as pending_mod
from engine.kernels.moe import reference as moe_ref
from engine.kernels.moe.combine import launch
from engine.kernels.norm import in_turn, in_turn_fp8
from engine.kernels.norm import reference as norm_ref
from engine.kernels.norm import triton as norm_triton
from engine.kernels.norm.combine_triton import combine_add_rms_norm, combine_add_rms_norm_fp8
from engine.model.fp8_linear import quantize_model_
from tests.engine.factories import single_cache, text_config
from tests.engine.kernels.cases import captured, crossed
from tests.engine.kernels.test_moe_triton import nan_empty as nan_empty  # a fixture, used by name

EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def case(t, h, slots, parts, extra, dtype, seed=0, device=DEVICE, part_dtype=None):
    """(pending, residual, weight) as the experts and the model make them: part [P, T*S, H] in fp32 (K
    splits, the GEMV) or, unsplit, in the model dtype; the shared gate a strided column of the routing
    weights; the residual a column slice of a wider tensor."""
    part_dtype = part_dtype or (torch.float32 if parts > 1 else dtype)
    part = rand(parts, t * slots, h, seed=seed, dtype=part_dtype, device=device) / parts
    shared_out = rand(t, h, seed=seed + 1, dtype=dtype, device=device) if extra else None
    shared_gate = rand(t, slots + 1, seed=seed + 2, device=device).sigmoid()[:, slots] if extra else None
    pending = PendingCombine(part, t, slots, dtype, shared_out, shared_gate)
    residual = (rand(t, h + 5, seed=seed + 3, device=device) * 2).to(dtype)[:, 3 : 3 + h]
    weight = rand(h, seed=seed + 4, dtype=dtype, device=device) * 0.2
    return pending, residual, weight


def composition(pending, residual, weight, group=None):
    """Today's two launches: the combine kernel, then the Triton add + norm (`_fp8` with a group)."""
    x = launch(pending)
    if group is None:
        return norm_triton.add_rms_norm(x, residual, weight, EPS)
    return norm_triton.add_rms_norm_fp8(x, residual, weight, EPS, group)


def assert_equal(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()


def assert_same_fp8(xq, expected):
    assert xq.group == expected.group and xq.q.dtype == torch.float8_e4m3fn
    assert torch.equal(xq.scale, expected.scale)
    assert torch.equal(xq.q.view(torch.uint8), expected.q.view(torch.uint8))


# Token counts 1, 3, 17 (one program, or several row tiles at H 200: BR = 16) beside widths no tile divides;
# 1, 2 and 9 slots (Qwen3.5: 8 routed + the shared expert), 1-3 K splits, with and without a shared expert
# run outside, fp32 and fp16, each pair of values meeting in some case (cases.crossed).
@pytest.mark.parametrize(
    "t, h, slots, parts, extra, dtype",
    crossed([1, 3, 17], [7, 33, 200], [1, 2, 9], [1, 2, 3], [False, True], DTYPES),
)
def test_fused_equals_the_combine_then_the_norm(t, h, slots, parts, extra, dtype, nan_empty):
    pending, residual, weight = case(t, h, slots, parts, extra, dtype, seed=t + h + slots)
    normed, total = combine_add_rms_norm(pending, residual, weight, EPS)
    ref_normed, ref_total = composition(pending, residual, weight)
    assert_equal(total, ref_total)
    assert_equal(normed, ref_normed)


def test_one_part_in_fp32_with_fp16_activations(nan_empty):
    # The GEMV path's part is fp32 whatever the model dtype; the grouped GEMMs' unsplit part is the model's.
    pending, residual, weight = case(5, 40, 9, 1, True, torch.float16, seed=3, part_dtype=torch.float32)
    for got, expected in zip(
        combine_add_rms_norm(pending, residual, weight, EPS),
        composition(pending, residual, weight),
        strict=True,
    ):
        assert_equal(got, expected)


@pytest.mark.parametrize("t, h, group, dtype", crossed([1, 3, 17], [33, 200, 256], [16, 128], DTYPES))
def test_fp8_variant_equals_the_combine_then_the_fp8_norm(t, h, group, dtype, nan_empty):
    slots, parts = (9, 1) if t == 1 else (3, 2)
    pending, residual, weight = case(t, h, slots, parts, t != 3, dtype, seed=t + h + group)
    normed, total, xq = combine_add_rms_norm_fp8(pending, residual, weight, EPS, group)
    ref_normed, ref_total, ref_xq = composition(pending, residual, weight, group)
    assert_equal(total, ref_total)
    assert_equal(normed, ref_normed)
    assert_same_fp8(xq, ref_xq)


def test_torch_side_is_the_composition_of_the_references(monkeypatch):
    """ENCLAVE_KERNELS=torch: the op runs the combine's reference (equal to its kernel bit for bit on a CPU)
    and the reference add + norm."""
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    dispatch.reset_usage()
    pending, residual, weight = case(3, 33, 9, 2, True, torch.float32, seed=5)
    assert torch.equal(pending_mod.reference(pending), launch(pending))
    normed, total = kernels.combine_add_rms_norm(pending, residual, weight, EPS)
    ref_normed, ref_total = norm_ref.add_rms_norm(pending_mod.reference(pending), residual, weight, EPS)
    assert torch.equal(normed, ref_normed) and torch.equal(total, ref_total)
    used = dispatch.usage()
    assert used["combine_add_rms_norm"] == used["moe_combine"] == used["add_rms_norm"] == "torch"
    normed, total, xq = kernels.combine_add_rms_norm_fp8(pending, residual, weight, EPS, 16)
    ref = norm_ref.add_rms_norm_fp8(pending_mod.reference(pending), residual, weight, EPS, 16)
    assert torch.equal(normed, ref[0]) and torch.equal(total, ref[1])
    assert_same_fp8(xq, ref[2])


def test_on_cuda_it_runs_the_fused_kernel(monkeypatch):
    """Graduated (its gpu tests passed on an H100, 2026-12-05): under `auto` a CUDA tensor takes the fused
    kernel; ENCLAVE_KERNELS=torch the composition."""
    ops = ("combine_add_rms_norm", "combine_add_rms_norm_fp8")
    assert not set(ops) & dispatch._HELD_BACK
    cuda_like = torch.zeros(2)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setenv("ENCLAVE_KERNELS", "auto")
    reset_engine_env()
    assert dispatch.pick(ops[0], cuda_like) is combine_add_rms_norm
    assert dispatch.pick(ops[1], cuda_like) is combine_add_rms_norm_fp8
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    reset_engine_env()
    assert dispatch.pick(ops[0], cuda_like) is in_turn and dispatch.pick(ops[1], cuda_like) is in_turn_fp8
    monkeypatch.undo()
    reset_engine_env()


def test_inputs_no_model_makes_run_in_turn(monkeypatch, caplog):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    dispatch.reset_usage()
    pending, residual, weight = case(3, 24, 2, 1, False, torch.float32, seed=6)
    # a residual of another dtype: the composition (whose add + norm takes the reference in turn)
    got = kernels.combine_add_rms_norm(pending, residual.double(), weight, EPS)
    expected = norm_ref.add_rms_norm(launch(pending), residual.double(), weight, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert dispatch.usage()["combine_add_rms_norm"] == "torch"
    assert "residual's shape or dtype differs from the combine's output" in caplog.text
    # an FP8 group the tile cannot split into (24): the composition, whose FP8 norm falls back too
    normed, total, xq = kernels.combine_add_rms_norm_fp8(pending, residual, weight, EPS, 24)
    ref = norm_ref.add_rms_norm_fp8(launch(pending), residual, weight, EPS, 24)
    assert torch.equal(total, ref[1]) and torch.equal(normed, ref[0])
    assert_same_fp8(xq, ref[2])
    assert dispatch.usage()["combine_add_rms_norm_fp8"] == "torch"
    # no tokens: empty outputs, nothing launched
    empty = PendingCombine(torch.empty(1, 0, 24), 0, 3, torch.float32)
    normed, total, xq = combine_add_rms_norm_fp8(empty, torch.empty(0, 24), weight, EPS, 8)
    assert normed.shape == total.shape == xq.q.shape == (0, 24) and xq.scale.shape == (0, 3)


def experts_case(t, seed=0):
    h, i, e, k = 32, 16, 6, 2
    w13 = rand(e, 2 * i, h, seed=seed) * h**-0.5
    w2 = rand(e, h, i, seed=seed + 1) * i**-0.5
    shared = (rand(2 * i, h, seed=seed + 2) * h**-0.5, rand(h, i, seed=seed + 3) * i**-0.5)
    weights, ids = moe_ref.route(rand(t, e + 1, seed=seed + 4), k, True, shared=True)
    return rand(t, h, seed=seed + 5), w13, w2, weights, ids, shared


@pytest.mark.parametrize("t", [3, 73])  # 9 pairs: the GEMV kernels; 219 pairs: the grouped GEMMs
def test_deferred_experts_are_their_output_before_its_combine(t, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    x, w13, w2, weights, ids, shared = experts_case(t, seed=t)
    out = kernels.moe_experts(x, w13, w2, weights, ids, *shared)
    pending = kernels.moe_experts(x, w13, w2, weights, ids, *shared, defer=True)
    assert isinstance(pending, PendingCombine) and pending.shape == (t, 32) and pending.slots == 3
    assert not pending_mod.deferring()  # only inside the op's call
    assert torch.equal(pending.tensor(), out)
    # FP8 experts with a shared expert run outside, added by the combine (the GEMV and the grouped GEMMs)
    block = (8, 16)
    w13q, s13 = kernels.quantize_block_fp8_weight(w13, block)
    w2q, s2 = kernels.quantize_block_fp8_weight(w2, block)
    k = ids.shape[1] - 1
    args = (x, w13q, s13, w2q, s2, weights[:, :k], ids[:, :k], block, rand(t, 32, seed=9), weights[:, k])
    pending = kernels.moe_experts_fp8(*args, defer=True)
    assert isinstance(pending, PendingCombine) and pending.shared_out is not None
    assert torch.equal(pending.tensor(), kernels.moe_experts_fp8(*args))


def test_the_reference_experts_never_defer(monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    x, w13, w2, weights, ids, shared = experts_case(3)
    out = kernels.moe_experts(x, w13, w2, weights, ids, *shared, defer=True)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(pending_mod.as_tensor(out), out)


def tiny_model(fp8: bool):
    """Two layers (DeltaNet, then gated attention), MoE with a shared expert, one MTP layer; random fp32
    weights, FP8 projections and experts with `fp8` (their norms then quantise: the `_fp8` op)."""
    shapes = dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    shapes |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    shapes |= dict(shared_expert_intermediate_size=16, mtp_num_hidden_layers=1, vocab_size=64)
    config = config_from_dict(text_config(**shapes).to_dict())
    model = random_model(config, torch.device(DEVICE), torch.float32, seed=4)
    if fp8:
        quantize_model_(model, (16, 16))
        model.fuse_projections_()  # the shared expert stacked with the routed experts, as for serving
    return config, model


def forward_steps(config, model):
    """A 2-token prefill, the MTP head's output over it, and a decode step after it: each MoE layer's output
    read by the next layer's input norm, by the model's last add, and by the MTP head's final norm."""
    cache, layout = single_cache(config, 8, DEVICE, torch.float32, num_mtp_layers=1)
    for t in cache.tensors():
        t.fill_(float("nan"))  # what no sequence wrote must not be read
    ids = torch.tensor([3, 17], device=DEVICE)
    with torch.no_grad():
        hidden = model(ids, layout(2), cache)
        normed = model.final_norm(hidden)
        mtp = model.mtp_hidden(torch.roll(ids, -1), normed, layout(2), cache)
        step = model(ids[-1:], layout(1, 2), cache)
        return hidden, model.logits(normed), mtp, model.logits(model.final_norm(step))


@pytest.mark.parametrize("fp8", [False, True])
def test_model_outputs_equal_with_the_fused_op_on_and_off(fp8, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    config, model = tiny_model(fp8)
    dispatch.reset_usage()
    fused = forward_steps(config, model)
    op = "combine_add_rms_norm_fp8" if fp8 else "combine_add_rms_norm"
    assert dispatch.usage()[op] == "triton"
    for name, off in (("combine_add_rms_norm", in_turn), ("combine_add_rms_norm_fp8", in_turn_fp8)):
        monkeypatch.setitem(dispatch._IMPLEMENTATIONS, name, {"torch": off, "triton": off})
    unfused = forward_steps(config, model)
    for got, expected in zip(fused, unfused, strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(got, expected), (got - expected).abs().max()


def test_a_hooked_layer_sees_its_output_as_a_tensor(monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    config, model = tiny_model(False)
    seen = []
    model.model.layers[0].register_forward_hook(lambda m, args, out: seen.append(type(out[0])))
    model.model.layers[1].mlp.register_forward_hook(lambda m, args, out: seen.append(type(out)))
    cache, layout = single_cache(config, 4, DEVICE, torch.float32)
    with torch.no_grad():
        model(torch.tensor([1, 2], device=DEVICE), layout(2), cache)
    assert seen == [torch.Tensor, torch.Tensor]


def test_an_moe_block_defers_only_up_to_its_token_cap(monkeypatch):
    """Prefill-sized steps launch the combine as before (the fused kernel is measured at decode sizes only):
    past DEFER_MAX_TOKENS tokens the block returns a tensor, and the fused op never runs."""
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    monkeypatch.setattr("engine.model.moe.DEFER_MAX_TOKENS", 2)
    config, model = tiny_model(False)
    moe = model.model.layers[0].mlp
    x = torch.randn(3, config.hidden_size, device=DEVICE)
    with torch.no_grad():
        assert isinstance(moe(x[:2], defer=True), PendingCombine)
        assert isinstance(moe(x, defer=True), torch.Tensor)
    cache, layout = single_cache(config, 4, DEVICE, torch.float32)
    dispatch.reset_usage()
    with torch.no_grad():
        model(torch.tensor([1, 2, 3], device=DEVICE), layout(3), cache)
    assert "combine_add_rms_norm" not in dispatch.usage()


# Qwen3.5-35B-A3B: hidden 2048, 8 routed experts + the shared one per token, bf16.
H, SLOTS = 2048, 9


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 8, 64, 256])
@pytest.mark.parametrize("parts, extra", [(1, False), (2, False), (1, True)])
def test_real_shapes_bf16_gpu(t, parts, extra):
    # Bit for bit on the GPU too: the combine's sum and the residual add are elementwise in the same order,
    # and the sum of squares reduces over the same tile in the same layout as the add + norm kernel's (their
    # sm_90 TTGIR gives the reduction's operand the same blocked layout). A difference in `normed` alone
    # would mean the compiler reduced in another order: an ulp, not a wrong sum.
    bf16 = torch.bfloat16
    pending, residual, weight = case(t, H, SLOTS, parts, extra, bf16, seed=t, device="cuda")
    ref_normed, ref_total = composition(pending, residual, weight)
    normed, total = combine_add_rms_norm(pending, residual, weight, EPS)
    assert_equal(total, ref_total)
    assert_equal(normed, ref_normed)
    normed, total, xq = combine_add_rms_norm_fp8(pending, residual, weight, EPS, 128)
    ref_normed, ref_total, ref_xq = composition(pending, residual, weight, 128)
    assert_equal(total, ref_total)
    assert_equal(normed, ref_normed)
    assert_same_fp8(xq, ref_xq)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64])
def test_deferred_experts_and_fused_norm_replay_in_cuda_graph_gpu(t):
    # No host sync: the experts' deferred output and the fused norm captured once, replayed on new tokens.
    from tests.engine.kernels.test_moe_triton import E, I, K, expert_weights, shared_weights

    w13, w2 = expert_weights(E, H, I, torch.bfloat16, seed=1)
    s13, s2 = shared_weights(H, I, torch.bfloat16, seed=2)
    x, residual = (rand(t, H, seed=s, dtype=torch.bfloat16, device="cuda") for s in (3, 4))
    logits = rand(t, E + 1, seed=5, dtype=torch.bfloat16, device="cuda")
    weight = rand(H, seed=6, dtype=torch.bfloat16, device="cuda") * 0.2

    def block():
        weights, ids = kernels.moe_route(logits, K, True, shared=True)
        pending = kernels.moe_experts(x, w13, w2, weights, ids, s13, s2, defer=True)
        assert isinstance(pending, PendingCombine)
        return combine_add_rms_norm(pending, residual, weight, EPS)

    graph, out = captured(block)
    for seed in (7, 8):
        x.copy_(rand(t, H, seed=seed, dtype=torch.bfloat16, device="cuda"))
        logits.copy_(rand(t, E + 1, seed=seed + 10, dtype=torch.bfloat16, device="cuda"))
        graph.replay()
        eager = block()
        for got, expected in zip(out, eager, strict=True):
            assert torch.equal(got, expected)
