"""What a run is sized and set to: the workloads' sizes, the serving settings, the constants they share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16  # the KV block size of the bench's own direct model calls (`presets.expert_load`)
WARMUP_STEPS = 3  # decode steps run but not timed: first-use allocations, kernel compiles, graph captures
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 1 << 30


@dataclass(frozen=True)
class Served:
    """A served workload: `requests` random prompts of `prompt_len` tokens, each generating `new` tokens, with
    at most `concurrency` in flight (None: all submitted at once, the engine's scheduler decides)."""

    requests: int
    prompt_len: int
    new: int
    concurrency: int | None = None


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
    long_prompts: tuple[
        int, ...
    ] = ()  # (e)'s prompt lengths when --long-prompt names them (else long_prompt)
    long_steps: int = 16
    verify_prompt: int = 512
    verify_steps: int = 32
    speculative_new: int = 256  # (f)'s end-to-end runs with controlled acceptance; (b --speculative) too
    # (h)-(j): the shapes of vLLM's published H200 runs
    peer_h: Served = Served(1000, 1024, 128, 512)
    peer_i: Served = Served(100, 32000, 100)
    peer_j: Served = Served(1000, 1000, 2000, 200)


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
    speculative_new=32,
    peer_h=Served(48, 128, 16, 16),
    peer_i=Served(6, 2048, 8),
    peer_j=Served(32, 64, 48, 8),
)


@dataclass(frozen=True)
class Settings:
    """Serving settings shared by the workloads."""

    max_seconds: float
    kv_cache_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int  # of workload (d)
    seed: int
    serve_kv_cache_bytes: int | None = None  # of (d), (h)-(j); None: the engine's own budget from free memory
    warm_up: bool | None = None  # the serving engines' warm_up option; None: the engine's default
    long_prefill_chunk: int | None = None  # the engine option; None: the engine's default (32,768 on cuda)
    kv_cache_dtype: str = "auto"  # every workload's engine option (auto: the model's dtype; fp8)
    state_dtype: str = "auto"  # every workload's engine option (auto: the config's mamba_ssm_dtype; bfloat16)
    speculative: bool = False  # (b) also decodes each batch with controlled-acceptance speculation
    block_size: int | None = None  # the engines' KV block size (positions per block); None: the engine's
    draft_head: str = "model"  # the engines' `draft_head` option: the lm_head MTP drafts are scored with
    draft_vocab: int | None = None  # the engines' `draft_vocab` option: drafts score the first N token ids
    fill_pool: str | None = None  # (k)'s mask fill pool (`grammar.FILL_POOLS`); None: the engine's default
    fill_threads: int | None = None  # ... and its threads; None: the engine's default
