"""Tile sizes of the MoE grouped GEMMs, and the choice by batch shape: a tuned table for this GPU when one
exists (`configs/<GPU name>.json`, written by `benchmarks/kernels_moe.py --sweep --write-config`), else
shape rules.

A table maps `table_key(...)` (expert count, hidden and intermediate sizes, routed top-k, dtype) to entries
keyed by token count; a batch takes the entry of the nearest tuned token count, up to twice the largest
(beyond twice the largest tuned count, the shape rules).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("configs")


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ExpertsConfig:
        return cls(
            data["block_m"], GemmTiles(**data["gate_up"]), GemmTiles(**data["down"]), data.get("split_k", 1)
        )


def table_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},k={top_k},dtype={str(dtype).removeprefix('torch.')}"


def table_path(device_name: str, directory: Path = CONFIG_DIR) -> Path:
    return directory / (re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name).strip("_") + ".json")


@functools.cache
def _table(path: Path) -> dict[str, dict[int, ExpertsConfig]]:
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {key: {int(t): ExpertsConfig.from_dict(c) for t, c in rows.items()} for key, rows in raw.items()}


@functools.cache
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def tuned_config(
    num_tokens: int, key: str, device: torch.device, directory: Path = CONFIG_DIR
) -> ExpertsConfig | None:
    """The tuned entry nearest `num_tokens` for `key` on this device's GPU; None without a table, or for more
    than twice the largest tuned token count (the H200 table covers 1 to 16,384 tokens): far from any tuned
    count an entry's tiles can cost much, as decode tiles (BLOCK_M 16) did on prefill chunks of 8,192 tokens
    when the table stopped at 256 (a third of the rate of `choose_config`'s shape rules on an H200)."""
    if device.type != "cuda":
        return None
    entries = _table(table_path(device_name(device.index or 0), directory)).get(key)
    if not entries or num_tokens > 2 * max(entries):
        return None
    return entries[min(entries, key=lambda t: (abs(t - num_tokens), t))]


def tuned_entries(device: torch.device, directory: Path = CONFIG_DIR) -> dict[str, dict[int, ExpertsConfig]]:
    """This GPU's whole table (key -> token count -> tiles); empty off CUDA or without one."""
    if device.type != "cuda":
        return {}
    return _table(table_path(device_name(device.index or 0), directory))


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
