"""The dense block-FP8 GEMM's tiles: a tuned table entry by nearest token count (`fp8.config`), the shape
rules otherwise, and an explicit config giving the W8A8 reference's output."""

import json

import pytest
import torch

from engine.kernels.fp8 import config as fp8_config
from engine.kernels.fp8 import reference as fp8_reference
from engine.kernels.fp8 import triton as fp8_triton
from engine.kernels.fp8.config import GemmConfig
from engine.kernels.linear import triton as linear_triton
from tests.engine.kernels.test_moe_triton import DEVICE
from tests.engine.kernels.test_moe_triton import nan_empty as nan_empty  # a fixture, used by name

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setattr(fp8_config, "device_name", lambda index: "Test GPU 9")
    entries = {"16": GemmConfig(16, 32, 4, 3).__dict__, "512": GemmConfig(64, 128, 8, 4).__dict__}
    (tmp_path / "Test_GPU_9.json").write_text(json.dumps({fp8_config.table_key(2048, 4096): entries}))
    fp8_config._table.cache_clear()
    yield tmp_path
    fp8_config._table.cache_clear()


def test_nearest_tuned_count_in_ratio(table):
    def pick(m, n=2048, k=4096):
        return fp8_config.tuned_config(m, n, k, CUDA, table)

    assert pick(8) == pick(16) == pick(64) == GemmConfig(16, 32, 4, 3)  # 64 / 16 < 512 / 64
    assert pick(7) is None  # below half the smallest tuned count: the rules
    assert pick(128) == pick(1024) == GemmConfig(64, 128, 8, 4)
    assert pick(1025) is None  # beyond twice the largest tuned count: the rules
    assert pick(16, n=4096) is None  # another shape
    assert fp8_config.tuned_config(16, 2048, 4096, torch.device("cpu"), table) is None


def test_rules_without_a_table():
    assert fp8_triton.gemm_config(8, 2048, 4096, torch.device("cpu")) == GemmConfig(16, 64, 4, 4)
    assert fp8_triton.gemm_config(5000, 2048, 4096, torch.device("cpu")) == GemmConfig(128, 128, 8, 3)


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 4, 3), GemmConfig(32, 64, 4, 4)])
def test_explicit_config_matches_reference(config, nan_empty):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 96, generator=g).to(DEVICE)
    w, scale = fp8_reference.quantize_block_fp8_weight(torch.randn(40, 96, generator=g).to(DEVICE), (16, 32))
    out = fp8_triton.fp8_block_gemm(x, w, scale, None, (16, 32), config=config)
    expected = fp8_reference.fp8_block_linear(x, w, scale, None, (16, 32))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# K splits: 96 channels in 32-channel blocks are 3 K blocks: 2 splits of 2 + 1 blocks, 3 of one each, and 5
# asked for (more than there are blocks) become 3. A bias, 20 rows over two 16-row tiles.
@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_split_k_matches_reference(split_k, nan_empty):
    g = torch.Generator().manual_seed(split_k)
    x = torch.randn(20, 96, generator=g).to(DEVICE)
    w, scale = fp8_reference.quantize_block_fp8_weight(torch.randn(40, 96, generator=g).to(DEVICE), (16, 32))
    bias = torch.randn(40, generator=g).to(DEVICE)
    config = GemmConfig(16, 16, 4, 3, split_k)
    out = fp8_triton.fp8_block_gemm(x, w, scale, bias, (16, 32), config=config)
    expected = fp8_reference.fp8_block_linear(x, w, scale, bias, (16, 32))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    counters = linear_triton.tile_counters(torch.device(DEVICE), 1)
    assert int(counters.abs().sum()) == 0  # every tile's last split reset its counter
    assert torch.equal(out, fp8_triton.fp8_block_gemm(x, w, scale, bias, (16, 32), config=config))


def test_split_k_without_counters_runs_unsplit(monkeypatch, nan_empty):
    # inside a first graph capture no counters can be had: the launch walks K whole instead
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 96, generator=g).to(DEVICE)
    w, scale = fp8_reference.quantize_block_fp8_weight(torch.randn(24, 96, generator=g).to(DEVICE), (16, 32))
    unsplit = fp8_triton.fp8_block_gemm(x, w, scale, None, (16, 32), config=GemmConfig(16, 16, 4, 3))
    monkeypatch.setattr(linear_triton, "tile_counters", lambda device, tiles: None)
    out = fp8_triton.fp8_block_gemm(x, w, scale, None, (16, 32), config=GemmConfig(16, 16, 4, 3, 3))
    assert torch.equal(out, unsplit)
