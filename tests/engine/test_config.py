"""config.json of the three supported families, legacy fields, and clear errors."""

import math

import pytest
import torch

from engine.config import config_from_dict, load_config
from engine.errors import ConfigError
from engine.model.rotary import rope_parameters
from tests.engine.factories import save_next_model, save_vl_model

# The shape of the real Qwen3.5-35B-A3B config.json (vision-language release; text part nested).
QWEN35_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "image_token_id": 248056,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "eos_token_id": 248044,
    },
    "vision_config": {"depth": 27},
    "tie_word_embeddings": False,
}


def test_real_qwen35_geometry():
    c = config_from_dict(QWEN35_35B_A3B)
    assert c.num_hidden_layers == 40 and c.full_attention_layers == list(range(3, 40, 4))
    assert c.rope.rotary_dim == 64 and c.rope.theta == 1e7 and c.rope.rope_type == "default"
    assert c.linear_conv_dim == 2 * 16 * 128 + 32 * 128
    assert c.mtp_num_hidden_layers == 1 and c.eos_token_ids == (248044,)
    assert all(c.is_moe_layer(i) for i in range(40))


def test_saved_vision_language_and_next_configs(tmp_path):
    save_vl_model(tmp_path / "vl")
    vl = load_config(tmp_path / "vl")
    assert vl.model_type == "qwen3_5_moe" and vl.hidden_size == 48 and vl.num_hidden_layers == 4
    save_next_model(tmp_path / "next", mlp_only_layers=[0], norm_topk_prob=False)
    nxt = load_config(tmp_path / "next")
    assert nxt.model_type == "qwen3_next" and not nxt.is_moe_layer(0) and nxt.is_moe_layer(1)
    assert not nxt.norm_topk_prob and nxt.intermediate_size == 40


def test_legacy_rope_fields_and_layer_pattern():
    raw = {
        "model_type": "qwen3_next",
        "rope_theta": 5e6,
        "partial_rotary_factor": 0.5,
        "num_hidden_layers": 6,
        "full_attention_interval": 3,
        "head_dim": 64,
    }
    c = config_from_dict(raw)
    assert c.rope.theta == 5e6 and c.rope.rotary_dim == 32
    assert c.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2


def test_yarn_matches_transformers():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
    }
    ours = config_from_dict(
        {"model_type": "qwen3_5_moe_text", "max_position_embeddings": 4096, "rope_parameters": rope}
    )
    inv_freq, scale = rope_parameters(ours)
    theirs = Qwen3_5MoeTextConfig(max_position_embeddings=4096, rope_parameters=rope)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](theirs, torch.device("cpu"))
    torch.testing.assert_close(inv_freq, ref_inv.float())
    assert math.isclose(scale, ref_scale)
    assert ours.max_model_len == 16384


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"model_type": "mistral"}, "'mistral'"),
        ({}, "None"),
        ({"model_type": "qwen3_5_moe"}, "text_config"),
        ({"model_type": "qwen3_next", "num_attention_heads": 6, "num_key_value_heads": 4}, "multiple"),
        ({"model_type": "qwen3_next", "hidden_act": "gelu"}, "gelu"),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 2, "layer_types": ["full_attention"]},
            "layer_types",
        ),
        ({"model_type": "qwen3_next", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"model_type": "qwen3_next", "quantization_config": {"quant_method": "gptq"}}, "gptq"),
        ({"model_type": "qwen3_next", "hidden_size": "big"}, "hidden_size"),
    ],
)
def test_bad_configs_give_one_clear_line(raw, needle):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert needle in str(info.value) and "\n" not in str(info.value)
