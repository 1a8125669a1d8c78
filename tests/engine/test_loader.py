"""Checkpoint loading: sharded files, and one clear line for every kind of bad checkpoint."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import CheckpointError, ConfigError, Engine, SamplingParams
from tests.engine.factories import save_text_model, save_vl_model

PROMPTS = [[3, 4, 5, 6], [9, 8]]


def one_line(exc: Exception) -> str:
    message = str(exc)
    assert message and "\n" not in message
    return message


def rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def checkpoint(tmp_path):
    save_text_model(tmp_path / "m", seed=4)
    return tmp_path / "m"


def greedy(path):
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]


def test_sharded_checkpoint_loads_like_single_file(checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    shutil.copy(checkpoint / "config.json", sharded / "config.json")
    assert greedy(sharded) == greedy(checkpoint)

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(sharded, device="cpu")
    assert "model-00002-of-00002.safetensors" in one_line(info.value)


def test_missing_tensor_is_named(checkpoint):
    rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.gate.weight"))
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert "missing tensor model.layers.1.mlp.gate.weight" in one_line(info.value)


def test_missing_expert_tensor_in_vision_language_layout_uses_its_name(tmp_path):
    save_vl_model(tmp_path, seed=1)
    name = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(tmp_path, device="cpu")
    assert name in one_line(info.value)


def test_wrong_shape_is_named(checkpoint):
    name = "model.layers.3.self_attn.k_proj.weight"
    rewrite(checkpoint, lambda t: t.__setitem__(name, torch.zeros(5, 48)))
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    message = one_line(info.value)
    assert name in message and "[5, 48]" in message and "model.safetensors" in message


def test_unsupported_dtype_is_named(checkpoint):
    name = "model.layers.0.linear_attn.out_proj.weight"
    rewrite(checkpoint, lambda t: t.__setitem__(name, torch.zeros(t[name].shape, dtype=torch.int8)))
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert name in one_line(info.value) and "I8" in str(info.value)


def test_fp8_weight_without_scale(checkpoint):
    name = "model.layers.0.linear_attn.out_proj.weight"
    rewrite(checkpoint, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert f"{name}_scale_inv" in one_line(info.value)


def test_truncated_safetensors(checkpoint):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    message = one_line(info.value)
    assert "model.safetensors" in message and "truncated" in message


def test_not_a_safetensors_file(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert "corrupt" in one_line(info.value)


def test_no_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert "no model.safetensors" in one_line(info.value)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ConfigError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert "no config.json" in one_line(info.value)


def test_unknown_model_type(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "llama"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert "'llama'" in one_line(info.value)


def test_config_that_is_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError) as info:
        Engine.from_pretrained(checkpoint, device="cpu")
    assert "config.json" in one_line(info.value)


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError) as info:
        Engine.from_pretrained(tmp_path / "nowhere", device="cpu")
    assert "nowhere" in one_line(info.value)


def test_sharded_save_pretrained_checkpoint(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    from tests.engine.factories import text_config

    model = Qwen3_5MoeForCausalLM(text_config()).eval()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_size="100KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    assert greedy(tmp_path / "many") == greedy(tmp_path / "one")
