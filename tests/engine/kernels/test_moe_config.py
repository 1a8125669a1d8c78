"""The tuned MoE tile table: file naming by GPU, nearest-token lookup, and the fallback to shape rules."""

import json

import torch

from engine.kernels.moe import config


def test_table_lookup_takes_the_nearest_tuned_token_count(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "_device_name", lambda index: "NVIDIA H200")
    key = config.table_key(256, 2048, 512, 8, torch.bfloat16)
    assert key == "E=256,H=2048,I=512,k=8,dtype=bfloat16"
    small = config.ExpertsConfig(16, config.GemmTiles(16, 256, 4, 3), config.GemmTiles(64, 128), split_k=2)
    large = config.ExpertsConfig.uniform(16, 32, 128)
    path = config.table_path("NVIDIA H200", tmp_path)
    assert path.name == "NVIDIA_H200.json"
    path.write_text(json.dumps({key: {"1": small.to_dict(), "64": large.to_dict()}}))
    cuda = torch.device("cuda", 0)
    assert config.tuned_config(1, key, cuda, tmp_path) == small
    assert config.tuned_config(20, key, cuda, tmp_path) == small  # 19 from 1, 44 from 64
    assert config.tuned_config(200, key, cuda, tmp_path) == large
    assert config.tuned_config(1, "E=8,H=64,I=32,k=2,dtype=bfloat16", cuda, tmp_path) is None
    assert config.tuned_config(1, key, torch.device("cpu"), tmp_path) is None


def test_shipped_tables_parse():
    for path in config.CONFIG_DIR.glob("*.json"):
        for entries in config._table(path).values():
            assert all(isinstance(c, config.ExpertsConfig) for c in entries.values())
