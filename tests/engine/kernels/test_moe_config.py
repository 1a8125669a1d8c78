"""The tuned MoE tile table: file naming by GPU, nearest-token lookup, and the fallback to shape rules."""

import json

import pytest
import torch

from engine.kernels.moe import config, reference
from engine.kernels.moe import triton as moe_triton
from tests.engine.kernels.test_moe_triton import (
    REL_TOL,
    assert_relative,
    expert_weights,
    nan_empty,  # noqa: F401 (fixture)
    rand,
    shared_weights,
)


def test_table_lookup_takes_the_nearest_tuned_token_count_up_to_twice_the_largest(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "device_name", lambda index: "NVIDIA H200")
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
    assert config.tuned_config(100, key, cuda, tmp_path) == large
    assert config.tuned_config(128, key, cuda, tmp_path) == large
    assert config.tuned_config(129, key, cuda, tmp_path) is None  # past twice the largest: shape rules
    assert config.tuned_config(8192, key, cuda, tmp_path) is None
    assert config.tuned_config(1, "E=8,H=64,I=32,k=2,dtype=bfloat16", cuda, tmp_path) is None
    assert config.tuned_config(1, key, torch.device("cpu"), tmp_path) is None


def test_shipped_tables_parse():
    for path in config.CONFIG_DIR.glob("*.json"):
        for entries in config._table(path).values():
            assert all(isinstance(c, config.ExpertsConfig) for c in entries.values())


def shipped_configs() -> list:
    tables = [config._table(path) for path in config.CONFIG_DIR.glob("*.json")]
    return sorted({c for table in tables for entries in table.values() for c in entries.values()}, key=repr)


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("tiles", shipped_configs(), ids=repr)
def test_shipped_tiles_compute_the_reference(tiles):
    """Every tuned entry is a valid tiling: same result as the reference on an odd problem (the sweep that
    chose them timed, it did not check)."""
    t, h, i, e, k = 13, 80, 48, 6, 3
    x = rand(t, h, seed=21)
    w13, w2 = expert_weights(e, h, i, torch.float32, seed=22)
    s13, s2 = shared_weights(h, 40, torch.float32, seed=23)
    weights, ids = reference.route(rand(t, e + 1, seed=24), k, True, shared=True)
    out = moe_triton.fused_experts(x, w13, w2, weights, ids, tiles, s13, s2)
    assert_relative(out, reference.experts(x, w13, w2, weights, ids, s13, s2), REL_TOL[torch.float32])
