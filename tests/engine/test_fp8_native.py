"""`quantization="fp8"`: the dense projections run as w8a8 block-FP8 GEMMs (`Fp8Linear`) and the routed
experts as W8A8 block-FP8 grouped GEMMs (`moe_experts_fp8`), from an FP8 release's weights as stored or from a
bf16/fp32 checkpoint quantised at load (the experts' own loading: tests/engine/test_fp8_experts.py).

How close is close. e4m3 keeps 3 mantissa bits, so rounding a projection's activations moves its output by
2-3% (checked per projection, where the error is made). These tiny random models amplify any perturbation
through their layers: bf16 alone moves their logits 6% (86% equal argmax), rounding their weights to FP8 (what
an FP8 release is) 29% (62%). So end-to-end logits are judged against that yardstick, measured on the same
model, and the wiring is checked tightly by putting the same activation rounding into the unquantised model
(projections end to end, experts block by block).
"""

import logging
import os

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineError, SamplingParams
from engine.kernels import dequantize_block_fp8, dispatch
from engine.kernels.fp8 import reference as fp8_reference
from engine.kernels.moe import reference
from engine.loader import quantization_mode
from engine.model.deltanet import GatedDeltaNet
from engine.model.fp8_linear import FP8_PROJECTIONS, Fp8Linear
from engine.model.moe import SparseMoe
from tests.engine.factories import quantize_block_fp8, save_text_model, write_fp8_copies
from tests.engine.numerics import all_position_logits
from tests.engine.test_fp8 import FP8_SHAPES
from tests.engine.test_parity import PROMPTS

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the FP8 Triton module is imported (last test)

LOAD = dict(device="cpu", dtype="float32", kv_cache_memory=64 << 20)
# 4 layers [l, l, l, f], each with 2 token-mixer projections and the shared expert's 2.
NUM_PROJECTIONS = 16
# FP8_SHAPES: q_proj has 2 * 4 * 40 = 320 rows and the shared expert's gate_proj 200, not multiples of 128, so
# qkv_proj (1 layer) and gate_up_proj (4 layers) are requantised; in_proj_qkv has 256 rows, so in_proj_qkvz
# = [qkv | z] keeps its blocks, as do the single-tensor o_proj, out_proj and down_proj.
REQUANTISED = 5


def random_prompts(count=6, length=40, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def logit_distance(a: Engine, b: Engine, prompts) -> tuple[float, float]:
    """(mean over positions of ||a - b|| / ||b||, fraction of positions with equal argmax) of the logits."""
    errs, agree = [], []
    for ids in prompts:
        x, y = all_position_logits(a, ids), all_position_logits(b, ids)
        errs.append((x - y).norm(dim=-1) / y.norm(dim=-1))
        agree.append((x.argmax(-1) == y.argmax(-1)).float())
    return torch.cat(errs).mean().item(), torch.cat(agree).mean().item()


def fp8_modules(engine: Engine) -> dict[str, Fp8Linear]:
    return {n: m for n, m in engine.model.named_modules() if isinstance(m, Fp8Linear)}


def dequantized(m: Fp8Linear) -> torch.Tensor:
    return dequantize_block_fp8(m.weight, m.weight_scale_inv, m.block, torch.float32)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x through the same per-token, per-128-channel e4m3 rounding as the w8a8 linear, back in x's dtype."""
    q, scale = fp8_reference.quantize_fp8_per_token_group(x, 128)
    return (q.float() * scale.repeat_interleave(128, dim=-1)[..., : x.shape[-1]]).to(x.dtype)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-native")
    save_text_model(root / "bf16", seed=11, **FP8_SHAPES)
    write_fp8_copies(root / "bf16", root / "fp8", root / "dequant")
    return root


@pytest.fixture(scope="module")
def native(dirs):
    return Engine.from_pretrained(dirs / "fp8", quantization="fp8", **LOAD)


@pytest.fixture(scope="module")
def dequant(dirs):
    return Engine.from_pretrained(dirs / "fp8", **LOAD)


def test_fp8_release_keeps_its_blocks(dirs, dequant, caplog):
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        engine = Engine.from_pretrained(dirs / "fp8", quantization="fp8", **LOAD)
    assert f"{NUM_PROJECTIONS - REQUANTISED} as stored, {REQUANTISED} requantised, 0 quantised" in caplog.text
    modules = fp8_modules(engine)
    assert len(modules) == NUM_PROJECTIONS and all(n.endswith(FP8_PROJECTIONS) for n in modules)
    for m in modules.values():
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
        assert m.weight_scale_inv.shape == (-(-m.out_features // 128), -(-m.in_features // 128))
    layer = engine.model.model.layers[0]
    assert layer.mlp.w13.dtype == layer.mlp.w2.dtype == torch.float8_e4m3fn  # routed experts in FP8 too
    ba = layer.linear_attn.in_proj_ba
    assert isinstance(ba, torch.nn.Linear) and ba.weight.dtype != torch.float8_e4m3fn  # as Qwen's releases
    assert type(engine.model.lm_head) is torch.nn.Linear

    for name, m in modules.items():
        ref = dequant.model.get_submodule(name).weight
        if name.endswith(("qkv_proj", "shared_expert.gate_up_proj")):
            # Dequantised and quantised again: within half an e4m3 step (2**-4 relative) of the stored value.
            torch.testing.assert_close(dequantized(m), ref, rtol=2**-4, atol=1e-6)
        else:  # the checkpoint's e4m3 values and scales, untouched
            assert torch.equal(dequantized(m), ref), name


def test_w8a8_error_per_projection(native):
    # Each projection's output against the same e4m3 weights applied to unrounded activations, on the
    # activations it sees in a forward pass: activation rounding alone, measured 2-3% relative.
    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0]))
        for n, m in fp8_modules(native).items()
    ]
    all_position_logits(native, random_prompts(1)[0])
    for h in hooks:
        h.remove()
    for name, m in fp8_modules(native).items():
        x = inputs[name]
        exact = torch.nn.functional.linear(x, dequantized(m))
        assert (m(x) - exact).norm() / exact.norm() < 0.05, name


def moe_blocks(engine: Engine) -> dict[str, SparseMoe]:
    return {n: m for n, m in engine.model.named_modules() if isinstance(m, SparseMoe)}


def test_same_as_unquantised_model_with_rounded_activations(dirs, native):
    # The dense projections' wiring, tightly: the fp32 model with each converted projection's weight set to
    # the FP8 one and its input rounded as the w8a8 linear rounds it, and the FP8 model's own routed experts,
    # computes the same logits, up to fp32 summation order (measured: identical). The experts get their own
    # tight check below: a 1e-7 difference there flips an e4m3 rounding now and then, which these models
    # amplify through their layers (0.5% of logits).
    plain = Engine.from_pretrained(dirs / "fp8", **LOAD)
    for m in plain.model.modules():
        if isinstance(m, GatedDeltaNet):  # the hooks below sit on in_proj_qkvz: run its own GEMM again
            m.in_proj_weight = None
    with torch.no_grad():
        for name, m in fp8_modules(native).items():
            linear = plain.model.get_submodule(name)
            linear.weight.copy_(dequantized(m))
            linear.register_forward_pre_hook(lambda mod, args: (round_activations(args[0]),))
        for name, moe in moe_blocks(native).items():
            target = plain.model.get_submodule(name)
            target.use_fp8_experts_(moe.fp8_block)
            for buffer in ("w13", "w13_scale_inv", "w2", "w2_scale_inv"):
                getattr(target, buffer).copy_(getattr(moe, buffer))
    err, agree = logit_distance(native, plain, random_prompts())
    assert err < 1e-4 and agree == 1.0, (err, agree)


def rounded_experts(x, w13, w2, weights, ids):
    """The routed experts with unquantised weights, token by token, with x and act rounded as the W8A8 FP8
    experts round them."""
    xr, out, inter = round_activations(x), torch.zeros_like(x), w2.shape[-1]
    for t, s in torch.cartesian_prod(torch.arange(ids.shape[0]), torch.arange(ids.shape[1])).tolist():
        h = w13[ids[t, s]] @ xr[t]
        act = round_activations((F.silu(h[:inter]) * h[inter:])[None])[0]
        out[t] += weights[t, s] * (w2[ids[t, s]] @ act)
    return out


def test_fp8_experts_per_block(native, dequant):
    # The experts' wiring, tightly: each MoE block of the FP8 model, on the input it sees in a forward pass,
    # against the dequantised model's experts (the checkpoint's FP8 weights through the plain loader) computed
    # token by token with the same activation rounding, plus the shared expert's share. fp32 summation order
    # only: measured under 1e-6 on every token's row. Those 1e-7 differences can put an activation on the
    # other side of an e4m3 rounding step: with one torch thread (a pytest-xdist worker of `make test`), one
    # token of the last block, 2.9e-4 on its row. At most one such token per block, within 1e-3.
    seen = {}  # name -> (input, output)

    def keep(name):
        def hook(module, args, out):
            seen[name] = (args[0], out)

        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in moe_blocks(native).items()]
    all_position_logits(native, random_prompts(1)[0])
    for h in hooks:
        h.remove()
    assert len(seen) == 4
    for name, moe in moe_blocks(native).items():
        assert moe.w13.dtype == torch.float8_e4m3fn
        (x, out), k, plain = seen[name], moe.top_k, dequant.model.get_submodule(name)
        with torch.no_grad():
            weights, ids = reference.route(F.linear(x, moe.router_weight()), k, True, shared=True)
            routed = rounded_experts(x, plain.w13, plain.w2, weights[:, :k], ids[:, :k])
            expected = routed + weights[:, k:] * moe.shared_expert(x)
        rows = (out - expected).norm(dim=1) / expected.norm(dim=1)
        assert (rows >= 1e-5).sum() <= 1 and rows.max() < 1e-3, (name, rows.max().item())


def test_fp8_release_logits_close_to_dequantised(dirs, native, dequant):
    # Measured on this model: w8a8 (projections and experts) vs the dequantised weights 0.30 mean relative
    # logit error, 64% equal argmax (projections alone: 0.29, 67%); the FP8 weights vs the original fp32 (the
    # release's own error) 0.29 and 62%. Activation rounding may cost up to 1.5x the weights' own rounding.
    original = Engine.from_pretrained(dirs / "bf16", **LOAD)
    prompts = random_prompts()
    err, agree = logit_distance(native, dequant, prompts)
    release_err, release_agree = logit_distance(dequant, original, prompts)
    measured = f"w8a8 {err:.3f} ({agree:.0%}), release {release_err:.3f} ({release_agree:.0%})"
    assert err <= 1.5 * release_err and agree >= release_agree - 0.15, measured


def test_bf16_checkpoint_quantised_at_load(dirs, dequant):
    original = Engine.from_pretrained(dirs / "bf16", **LOAD)
    engine = Engine.from_pretrained(dirs / "bf16", quantization="fp8", **LOAD)
    modules = fp8_modules(engine)
    assert len(modules) == NUM_PROJECTIONS
    for name, m in modules.items():
        # The fused fp32 weight quantised in one go, exactly as the test factory writes FP8 checkpoints.
        q, scale = quantize_block_fp8(original.model.get_submodule(name).weight)
        assert torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(m.weight_scale_inv, scale), name
    # Weights and activations rounded (projections and experts): measured 0.37 mean relative logit error and
    # 56% equal argmax against the original (projections alone: 0.36, 56%), beside 0.29 and 62% for the
    # weights alone (the FP8 release); at most 1.5x that error.
    prompts = random_prompts()
    err, agree = logit_distance(engine, original, prompts)
    weights_err, weights_agree = logit_distance(dequant, original, prompts)
    measured = f"w8a8 {err:.3f} ({agree:.0%}), weights alone {weights_err:.3f} ({weights_agree:.0%})"
    assert err <= 1.5 * weights_err and agree >= weights_agree - 0.15, measured


def test_unknown_quantization_is_one_line(tmp_path):
    with pytest.raises(EngineError, match="unknown quantization 'bogus'") as info:
        Engine.from_pretrained(tmp_path, quantization="bogus", **LOAD)
    assert "\n" not in str(info.value)
    assert quantization_mode(None) is None and quantization_mode("none") is None
    assert quantization_mode("FP8") == "fp8"


def greedy_matches_full_forward(engine: Engine) -> list[list[int]]:
    """Generate greedily and check each token is the argmax of one full forward over prompt + output."""
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(out.token_ids) == 6
        logits = all_position_logits(engine, prompt + out.token_ids[:-1])[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == out.token_ids
    return [out.token_ids for out in outs]


def test_generation_end_to_end(native):
    # Activations are rounded per token, so decode steps, chunks and batches see what one full forward sees.
    greedy_matches_full_forward(native)


def test_generation_with_triton_fp8_kernels(native, monkeypatch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the model runs on the CPU: needs Triton's interpreter (set where there is no CUDA)")
    from engine.kernels.moe import gemv

    # The wiring of each FP8 Triton path into the model, not the kernels' numerics (tests/engine/kernels): a
    # prompt of 49 tokens prefills through the grouped experts (147 (token, slot) pairs, over gemv.MAX_PAIRS),
    # then the decode step after it through the gemv ones (3 pairs), each deciding one token. The interpreter
    # runs each program in Python, seconds per (pair, layer) in the gemv path, so one prompt and one decode.
    top_k = native.config.num_experts_per_tok
    prompt = PROMPTS[2][: gemv.MAX_PAIRS // top_k + 1]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    reference_tokens = native.generate([prompt], params)[0].token_ids
    fp8_ops = (
        "fp8_block_linear",
        "quantize_fp8_per_token_group",
        "moe_experts_fp8",
        "add_rms_norm_fp8",
        "gated_rms_norm_fp8",
    )
    calls, variants = [], []

    # The FP8 ops through Triton (its interpreter on the CPU), every other op through its reference.
    def pick(op, like):
        calls.append(op)
        return dispatch.implementation(op, "triton" if op in fp8_ops else "torch")

    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "pick", pick)
    monkeypatch.setattr(dispatch, "choose", lambda op, impl: (variants.append((op, impl)), choose(op, impl)))
    assert native.generate([prompt], params)[0].token_ids == reference_tokens
    assert "fp8_block_linear" in calls and "moe_experts_fp8" in calls
    assert "add_rms_norm_fp8" in calls  # the norms quantise x for the FP8 projections and experts
    assert {impl for op, impl in variants if op == "moe_experts_fp8"} == {"triton-grouped", "triton-gemv"}


def test_an_fp8_o_proj_reads_its_input_quantised_by_the_gate(tmp_path, monkeypatch):
    """With scale blocks that divide the head size (8 here, as 128 divides Qwen's 256), the attention output
    gate quantises its output for the FP8 o_proj in the same op (`sigmoid_gate_fp8`): the same numbers as
    o_proj quantising the gated output itself, so the same logits, bit for bit."""
    import engine.model.attention as attention

    save_text_model(tmp_path / "bf16", seed=11, **FP8_SHAPES)
    write_fp8_copies(tmp_path / "bf16", tmp_path / "fp8", tmp_path / "dequant", block=8)
    engine = Engine.from_pretrained(tmp_path / "fp8", quantization="fp8", **LOAD)
    assert engine.config.head_dim % 8 == 0
    calls = []
    fused = attention.kernels.sigmoid_gate_fp8
    monkeypatch.setattr(attention.kernels, "sigmoid_gate_fp8", lambda *a: calls.append(a[2]) or fused(*a))
    fused_logits = all_position_logits(engine, PROMPTS[1])
    assert calls and set(calls) == {8}
    monkeypatch.setattr(attention, "fp8_group", lambda module: None)  # o_proj quantises x itself
    assert torch.equal(all_position_logits(engine, PROMPTS[1]), fused_logits)
