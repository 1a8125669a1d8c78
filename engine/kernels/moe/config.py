"""Tile sizes of the MoE grouped GEMMs, and the choice by batch shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's N and K tiles and launch shape."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpertsConfig:
    """BLOCK_M of both grouped GEMMs (it also sets the padding of each expert's rows), each GEMM's tiles, and
    how many programs share the down GEMM's K (fp32 partial sums, added by the combine)."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    split_k: int = 1

    @classmethod
    def uniform(cls, block_m: int, block_n: int, block_k: int, num_stages: int = 3, split_k: int = 1):
        """The same tiles for both GEMMs."""
        tiles = GemmTiles(block_n, block_k, num_stages=num_stages)
        return cls(block_m, tiles, tiles, split_k)


def choose_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> ExpertsConfig:
    """Blocks by the mean rows per routed expert (shapes only, so no host sync); untuned starting points for
    H200 (`python benchmarks/kernels_moe.py --sweep` times the alternatives on the device).

    Decode (a handful of rows per expert) is bound by reading expert weights: short M tiles waste less MMA
    work on padding, and narrow N tiles give more programs to stream weights with.
    """
    rows_per_expert = num_tokens * top_k / num_experts
    wide = dtype == torch.float32  # 4-byte elements: halve K so a stage fits shared memory
    if rows_per_expert <= 16:
        return ExpertsConfig.uniform(16, 32, 64 if wide else 128, num_stages=3 if wide else 4)
    if rows_per_expert <= 64:
        return ExpertsConfig.uniform(32, 64, 32 if wide else 64, num_stages=3 if wide else 4)
    return ExpertsConfig.uniform(64, 64, 32 if wide else 64, num_stages=2 if wide else 3)
