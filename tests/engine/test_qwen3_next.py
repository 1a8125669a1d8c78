"""Qwen3-Next checkpoints (interleaved in_proj_qkvz / in_proj_ba) against transformers' Qwen3Next."""

import pytest

from engine import Engine, SamplingParams
from engine.checkpoint import CheckpointReader
from tests.engine.factories import save_next_model
from tests.engine.test_parity import PROMPTS, check_against_reference

VARIANTS = {
    "default": {},
    "dense-layer-no-topk-renorm": dict(
        num_hidden_layers=5,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        linear_num_value_heads=6,
        linear_num_key_heads=2,
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_qwen3_next_matches_reference(variant, tmp_path):
    ref = save_next_model(tmp_path, seed=5, **VARIANTS[variant])
    names = CheckpointReader(tmp_path).names()
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in names
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    assert engine.config.model_type == "qwen3_next"
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=13, temperature=0.0, logprobs=5))
    check_against_reference(ref, outs, PROMPTS, engine.config.vocab_size)
