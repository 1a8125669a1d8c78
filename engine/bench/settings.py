"""What a run is sized and set to: the workloads' sizes, the serving settings, the constants they share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
WARMUP_STEPS = 3  # decode steps run but not timed: first-use allocations, kernel compiles, graph captures
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; `QUICK` shrinks them so a full run takes minutes on the reference path."""

    single_prompt: int = 512
    single_new: int = 256
    batches: tuple[int, ...] = (16, 64, 256)
    batch_prompt: int = 512
    batch_steps: int = 64
    prefill_seqs: int = 8
    prefill_len: int = 4096
    docs: int = 512
    doc_prompt: int = 2048
    doc_new: int = 256
    long_prompt: int = 131072
    long_steps: int = 16
    verify_prompt: int = 512
    verify_steps: int = 32


QUICK = Sizes(
    single_prompt=128,
    single_new=32,
    batch_prompt=64,
    batch_steps=8,
    prefill_seqs=2,
    prefill_len=1024,
    docs=32,
    doc_prompt=512,
    doc_new=32,
    long_prompt=16384,
    long_steps=4,
    verify_prompt=64,
    verify_steps=8,
)


@dataclass(frozen=True)
class Settings:
    """Serving settings shared by the workloads."""

    max_seconds: float
    kv_cache_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int  # of workload (d)
    seed: int
