"""`quantization="fp8"` for the routed experts: what the loader makes of per-expert and fused, FP8 and bf16
expert tensors, the FP8 `SparseMoe` block, and `quantize_model_` (the benchmark's random weights).

The end-to-end numerics (logits against the unquantised model, the wiring checked block by block with the
same activation rounding, greedy generation on the Triton kernels) are in test_fp8_native.py, on the same
kind of tiny checkpoint.
"""

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.config import config_from_dict
from engine.kernels import dequantize_block_fp8
from engine.kernels.fp8.reference import quantize_block_fp8_weight
from engine.kernels.moe import reference
from engine.model.fp8_linear import Fp8Linear, quantize_gate_up, quantize_model_
from engine.model.moe import SparseMoe
from tests.engine.factories import save_text_model, text_config, write_fp8_copies
from tests.engine.numerics import all_position_logits
from tests.engine.test_fp8 import FP8_SHAPES
from tests.engine.test_fp8_native import LOAD, random_prompts

LAYERS, EXPERTS = 4, 8  # the factories' tiny model; FP8_SHAPES: hidden 144, experts of intermediate 136
BLOCK = (128, 128)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_blocks(engine_or_model) -> dict[str, SparseMoe]:
    model = getattr(engine_or_model, "model", engine_or_model)
    return {n: m for n, m in model.named_modules() if isinstance(m, SparseMoe)}


def dequantized_experts(moe: SparseMoe) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) fp32 of an FP8 block: each half of w13 on its own block grid."""
    inter, half = moe.w2.shape[-1], moe.w13_scale_inv.shape[1] // 2
    gate = dequantize_block_fp8(moe.w13[:, :inter], moe.w13_scale_inv[:, :half], BLOCK, torch.float32)
    up = dequantize_block_fp8(moe.w13[:, inter:], moe.w13_scale_inv[:, half:], BLOCK, torch.float32)
    return torch.cat([gate, up], dim=1), dequantize_block_fp8(moe.w2, moe.w2_scale_inv, BLOCK, torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def write_fused(source, out, fp8: bool) -> None:
    """`source` (a per-expert bf16/fp32 checkpoint) with each layer's experts fused into
    `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], transformers' fused layout; with
    `fp8`, those two quantised on the stacked tensors' 128 x 128 grid (`weight_scale_inv` [E, rows, cols])
    and every other tensor taken from `source`'s FP8 copy (`write_fp8_copies`)."""
    tensors = load_file(str(source / "model.safetensors"))
    if fp8:
        write_fp8_copies(source, out, out.with_name(out.name + "-dequant"))
        rest = load_file(str(out / "model.safetensors"))
    else:
        shutil.copytree(source, out)
        rest = dict(tensors)
    table = {n: t for n, t in rest.items() if ".mlp.experts." not in n}
    for layer in range(LAYERS):
        base = f"model.layers.{layer}.mlp.experts."
        parts = {p: [tensors[f"{base}{e}.{p}.weight"].float() for e in range(EXPERTS)] for p in PROJECTIONS}
        gate_up = torch.cat([torch.stack(parts["gate_proj"]), torch.stack(parts["up_proj"])], dim=1)
        down = torch.stack(parts["down_proj"])
        for name, w in ((base + "gate_up_proj", gate_up), (base + "down_proj", down)):
            if fp8:
                table[name], table[name + "_scale_inv"] = quantize_block_fp8_weight(w, BLOCK)
            else:
                table[name] = w
    save_file(table, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Per-expert bf16 and FP8 checkpoints at intermediate 136 (not a multiple of 128) and 128; fused ones."""
    root = tmp_path_factory.mktemp("fp8-experts")
    for inter in (136, 128):
        src = root / f"bf16-{inter}"
        save_text_model(src, seed=11, **{**FP8_SHAPES, "moe_intermediate_size": inter})
        write_fp8_copies(src, root / f"fp8-{inter}", root / f"dequant-{inter}")
        write_fused(src, root / f"fused-fp8-{inter}", fp8=True)
    write_fused(root / "bf16-136", root / "fused-bf16-136", fp8=False)
    return root


def load(path, caplog, **kwargs) -> Engine:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        return Engine.from_pretrained(path, **LOAD, **kwargs)


def expert_log(stored: int, requantised: int, quantised: int) -> str:
    return f"{stored} as stored, {requantised} requantised, {quantised} quantised at load"


def test_fp8_release_experts_kept_as_stored(dirs, caplog):
    engine = load(dirs / "fp8-136", caplog, quantization="fp8")
    assert expert_log(3 * EXPERTS * LAYERS, 0, 0) in caplog.text  # gate, up, down of every expert
    dequant = Engine.from_pretrained(dirs / "fp8-136", **LOAD)
    blocks = moe_blocks(engine)
    assert len(blocks) == LAYERS
    for name, moe in blocks.items():
        assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn and moe.fp8_block == BLOCK
        # The gate and up halves' 136 rows: 2 row blocks each; hidden 144: 2 column blocks.
        assert moe.w13_scale_inv.shape == (EXPERTS, 4, 2) and moe.w2_scale_inv.shape == (EXPERTS, 2, 2)
        assert not any(n.endswith(("w13", "w2")) for n, _ in moe.named_parameters())
        assert {"w13", "w13_scale_inv", "w2", "w2_scale_inv"} <= set(moe.state_dict())
        w13, w2 = dequantized_experts(moe)  # the checkpoint's blocks, untouched
        plain = dequant.model.get_submodule(name)
        assert torch.equal(w13, plain.w13) and torch.equal(w2, plain.w2), name


def test_bf16_checkpoint_experts_quantised_at_load(dirs, caplog):
    engine = load(dirs / "bf16-136", caplog, quantization="fp8")
    assert expert_log(0, 0, 3 * EXPERTS * LAYERS) in caplog.text
    # Each expert's gate and up quantised on their own grids, as an FP8 release stores them: the same bits.
    release = Engine.from_pretrained(dirs / "fp8-136", quantization="fp8", **LOAD)
    for name, moe in moe_blocks(engine).items():
        other = release.model.get_submodule(name)
        assert same_bits(moe.w13, other.w13) and same_bits(moe.w2, other.w2), name
        assert torch.equal(moe.w13_scale_inv, other.w13_scale_inv), name
        assert torch.equal(moe.w2_scale_inv, other.w2_scale_inv), name


def test_without_quantization_experts_stay_dequantised(dirs):
    engine = Engine.from_pretrained(dirs / "fp8-136", **LOAD)
    for moe in moe_blocks(engine).values():
        assert moe.fp8_block is None and moe.w13.dtype == moe.w2.dtype == torch.float32
        assert isinstance(moe.w13, torch.nn.Parameter)


def test_fused_fp8_experts_kept_when_128_divides_intermediate(dirs, caplog):
    # Intermediate 128: the stacked gate_up_proj's row blocks are the halves' own, so its blocks are kept,
    # and the model is the per-expert FP8 release's exactly: same bits, same logits, same greedy tokens.
    fused = load(dirs / "fused-fp8-128", caplog, quantization="fp8")
    assert expert_log(2 * LAYERS, 0, 0) in caplog.text
    release = Engine.from_pretrained(dirs / "fp8-128", quantization="fp8", **LOAD)
    for name, moe in moe_blocks(fused).items():
        other = release.model.get_submodule(name)
        assert same_bits(moe.w13, other.w13) and torch.equal(moe.w13_scale_inv, other.w13_scale_inv), name
        assert same_bits(moe.w2, other.w2) and torch.equal(moe.w2_scale_inv, other.w2_scale_inv), name
    prompt = random_prompts(1)[0]
    torch.testing.assert_close(all_position_logits(fused, prompt), all_position_logits(release, prompt))


def test_fused_fp8_experts_requantised_otherwise(dirs, caplog):
    # Intermediate 136: a 128-row block of the stacked gate_up_proj holds gate and up rows, so it is
    # dequantised and each half quantised again (within half an e4m3 step, 2**-4 relative, of the stored
    # value); down_proj keeps its blocks.
    engine = load(dirs / "fused-fp8-136", caplog, quantization="fp8")
    assert expert_log(LAYERS, LAYERS, 0) in caplog.text
    dequant = Engine.from_pretrained(dirs / "fused-fp8-136", **LOAD)
    for name, moe in moe_blocks(engine).items():
        w13, w2 = dequantized_experts(moe)
        plain = dequant.model.get_submodule(name)
        torch.testing.assert_close(w13, plain.w13.detach(), rtol=2**-4, atol=1e-6)
        assert torch.equal(w2, plain.w2), name


def test_fused_bf16_experts_quantised_at_load(dirs, caplog):
    engine = load(dirs / "fused-bf16-136", caplog, quantization="fp8")
    assert expert_log(0, 0, 2 * LAYERS) in caplog.text
    per_expert = Engine.from_pretrained(dirs / "bf16-136", quantization="fp8", **LOAD)
    for name, moe in moe_blocks(engine).items():
        other = per_expert.model.get_submodule(name)
        assert same_bits(moe.w13, other.w13) and torch.equal(moe.w13_scale_inv, other.w13_scale_inv), name
        assert same_bits(moe.w2, other.w2) and torch.equal(moe.w2_scale_inv, other.w2_scale_inv), name


def fp8_block(shared: int, seed: int = 0, block=BLOCK, fp8_shared: bool = False) -> SparseMoe:
    """A SparseMoe (hidden 64, 6 experts of 24, top 2) with random weights, its experts then made FP8 with
    `block` scales; with `fp8_shared` its shared expert too (`Fp8Linear`s, as quantization="fp8" loads it)."""
    config = config_from_dict(
        text_config(
            hidden_size=64,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=shared,
        ).to_dict()
    )
    torch.manual_seed(seed)
    moe = SparseMoe(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * (2.0 if p is moe.gate.weight else p.shape[-1] ** -0.5))
        w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
        moe.use_fp8_experts_(block)
        moe.w13[:], moe.w13_scale_inv[:] = quantize_gate_up(w13, block)
        moe.w2[:], moe.w2_scale_inv[:] = quantize_block_fp8_weight(w2, block)
        for name in ("gate_up_proj", "down_proj") if fp8_shared else ():
            linear = getattr(moe.shared_expert, name)
            fp8 = Fp8Linear.like(linear, block)
            fp8.weight, fp8.weight_scale_inv = quantize_block_fp8_weight(linear.weight, block)
            setattr(moe.shared_expert, name, fp8)
    return moe.eval()


def test_fp8_block_without_shared_expert():
    moe = fp8_block(shared=0)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    seen = []
    moe.gate.register_forward_hook(lambda m, args, out: seen.append(out.shape))  # as engine.bench's load
    with torch.no_grad():
        out = moe(x)
        weights, ids = reference.route(moe.gate(x), 2, True)
        buffers = (moe.w13, moe.w13_scale_inv, moe.w2, moe.w2_scale_inv)
        expected = reference.fp8_experts(x, *buffers, weights, ids, BLOCK)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert seen and seen[0] == (9, 6)


def test_fp8_block_with_hooked_router():
    # A hooked router runs as itself (its logits then the shared gate's), the experts still in FP8.
    moe = fp8_block(shared=40, seed=2)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = moe(x)
        seen = []
        moe.gate.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        torch.testing.assert_close(moe(x), plain, rtol=1e-6, atol=1e-6)
    assert seen == [(7, 6)]


def test_quantize_model_quantises_the_experts():
    # The benchmark's path: random weights, quantised in place. Each MoE block then moves by a few percent:
    # the activations' rounding alone moves the experts ~4.5% (test_moe_fp8_triton), the weights' adds about
    # 2.5%; measured 5.6-6.7% over the 5 layers. The router's forward hooks (engine.bench.expert_load) still
    # fire.
    from engine.bench.presets import PRESETS, expert_load, random_model

    config = config_from_dict(PRESETS["tiny"](), source="tiny")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=0)
    blocks = moe_blocks(model)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = {n: m(x) for n, m in blocks.items()}
    quantize_model_(model)
    for name, moe in blocks.items():
        assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn
        with torch.no_grad():
            err = ((moe(x) - before[name]).norm() / before[name].norm()).item()
        assert err < 0.1, (name, err)
    assert not [n for n, _ in model.named_parameters() if n.endswith((".w13", ".w2"))]
    assert expert_load(model)  # hooks on mlp.gate see every layer's routing

    untouched = random_model(config, torch.device("cpu"), torch.float32, seed=0)
    quantize_model_(untouched, experts=False)
    assert all(m.fp8_block is None and m.w13.dtype == torch.float32 for m in moe_blocks(untouched).values())
