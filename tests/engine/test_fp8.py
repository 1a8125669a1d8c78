"""Block-FP8 checkpoints (e4m3 weights, a weight_scale_inv per 128x128 block) load and dequantise exactly."""

import torch
from safetensors import safe_open

from engine import Engine, SamplingParams
from tests.engine.factories import save_text_model, write_fp8_copies
from tests.engine.test_parity import PROMPTS, check_against_reference

# Sizes above and off multiples of 128, so edge blocks are partial.
FP8_SHAPES = dict(
    hidden_size=144,
    moe_intermediate_size=136,
    shared_expert_intermediate_size=200,
    head_dim=40,
    linear_key_head_dim=24,
    linear_value_head_dim=40,
)


def test_fp8_checkpoint_matches_dequantised_reference(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    save_text_model(tmp_path / "bf16", seed=11, **FP8_SHAPES)
    write_fp8_copies(tmp_path / "bf16", tmp_path / "fp8", tmp_path / "dequant")
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 2)
        assert f.get_tensor("model.layers.0.linear_attn.in_proj_a.weight").dtype != torch.float8_e4m3fn

    ref = Qwen3_5MoeForCausalLM.from_pretrained(
        tmp_path / "dequant", dtype=torch.float32, experts_implementation="eager", attn_implementation="eager"
    ).eval()
    engine = Engine.from_pretrained(tmp_path / "fp8", device="cpu", dtype="float32")
    assert engine.config.quantization is not None
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, logprobs=5))
    check_against_reference(ref, outs, PROMPTS, engine.config.vocab_size)

    # The quantisation is real: the FP8 model's weights differ from the unquantised ones.
    original = Engine.from_pretrained(tmp_path / "bf16", device="cpu", dtype="float32")
    a = engine.model.model.layers[0].mlp.w13
    b = original.model.model.layers[0].mlp.w13
    assert 0 < (a - b).abs().max() < 0.1 * b.abs().max()
