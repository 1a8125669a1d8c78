"""K splits of the few-token linear summed by each N tile's last split (`linear.triton`): the output matches
F.linear with and without a bias, the tile counters are left zero for the next launch, repeated launches
give equal results, and the separate sum kernel (where no counters can be had) gives the same output."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.linear import triton as linear_triton
from tests.engine.kernels.test_moe_triton import DEVICE, assert_relative, rand
from tests.engine.kernels.test_moe_triton import nan_empty as nan_empty  # a fixture, used by name

TILES = linear_triton.LinearTiles(block_n=4, k_bytes=64, split_k=3)  # 7 K steps of 16 as 3, 3, 1


def case(m, n, k, bias, seed=0):
    x = rand(m, k, seed=seed)
    w = rand(n, k, seed=seed + 1) * k**-0.5
    b = rand(n, seed=seed + 2) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m, n", [(1, 13), (3, 8)])  # a ragged last N tile; several rows
def test_last_split_sums(m, n, bias, nan_empty):
    x, w, b = case(m, n, 100, bias)
    out = linear_triton.run_kernel(x, w, None, b, None, TILES)
    assert_relative(out, F.linear(x, w, b), 1e-5)
    counters = linear_triton._tile_counters(torch.device(DEVICE))
    assert int(counters.abs().sum()) == 0  # every tile's last split reset its counter
    assert torch.equal(out, linear_triton.run_kernel(x, w, None, b, None, TILES))  # fixed sum order


def test_sum_kernel_when_no_counters(monkeypatch, nan_empty):
    x, w, b = case(2, 11, 100, True, seed=3)
    last = linear_triton.run_kernel(x, w, None, b, None, TILES)
    monkeypatch.setattr(linear_triton, "_MAX_COUNTERS", 0)  # more tiles than counters: the sum kernel
    assert linear_triton.tile_counters(x.device, 3) is None
    separate = linear_triton.run_kernel(x, w, None, b, None, TILES)
    assert torch.equal(separate, last)
