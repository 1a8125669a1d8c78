"""Tiles of the dense block-FP8 GEMM (`fp8.triton.fp8_block_gemm`) by token count: a tuned table for this GPU
when one exists (`configs/<GPU name>.json`, written by `benchmarks/fp8_gemm_tiles.py --write-config`), else
the shape rules in `fp8.triton`.

The table maps `table_key(N, K)` (a projection's outputs and inputs) to entries keyed by token count; a batch
takes the entry of the tuned count nearest in ratio, from half the smallest to twice the largest (outside:
the rules). The H200 table holds 2-512 tokens from `benchmarks/fp8_decode_tiles.py` (graph-timed, cold
weights, x quantised by the norm; split K where few N tiles leave SMs idle: out_proj 2.1-2.9x the rules' tiles
at 2-128 rows) and 1,024-16,384 from `benchmarks/fp8_gemm_tiles.py`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels.moe.config import device_name, table_path

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class GemmConfig:
    """One launch of the block-FP8 GEMM: its M and N tiles (K is the scale block), warps, stages, and K splits
    (small batches: more programs streaming the weight, the last split of each tile summing)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


def table_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


@functools.cache
def _table(path: Path) -> dict[str, dict[int, GemmConfig]]:
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {key: {int(m): GemmConfig(**c) for m, c in rows.items()} for key, rows in raw.items()}


def tuned_config(
    m: int, n: int, k: int, device: torch.device, directory: Path = CONFIG_DIR
) -> GemmConfig | None:
    """The tuned entry for M rows of an [N, K] weight on this device's GPU, nearest in ratio to a tuned count;
    None without a table entry for (N, K), or outside half the smallest to twice the largest tuned count."""
    if device.type != "cuda":
        return None
    entries = _table(table_path(device_name(device.index or 0), directory)).get(table_key(n, k))
    if not entries or not min(entries) / 2 <= m <= 2 * max(entries):
        return None
    return entries[min(entries, key=lambda t: (max(t, m) / max(1, min(t, m)), t))]


def tuned_token_counts(device: torch.device, directory: Path = CONFIG_DIR) -> set[int]:
    """Every token count this GPU's table has an entry for, over all projections (the engine's warm-up runs
    each)."""
    if device.type != "cuda":
        return set()
    table = _table(table_path(device_name(device.index or 0), directory))
    return {m for entries in table.values() for m in entries}
