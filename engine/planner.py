"""Size the state-slot pool and the KV block pool from a memory budget, once, before serving.

On CUDA the budget is the free device memory after the weights are loaded, times `gpu_memory_utilization`,
minus an estimate of the activations of the largest step (`step_tokens`: `max_num_batched_tokens`, or a
lone prefill's `long_prefill_chunk`). Elsewhere it is `kv_cache_memory` bytes (default 2 GiB). Slots come
first (every running sequence needs one, plus one per cached prefix and `k` verify scratch slots per
sequence); the rest becomes KV blocks, capped at what `max_num_seqs` sequences of the full context could use.
A block's bytes follow `kv_cache_dtype`: an FP8 block (e4m3 and its scales) is about half a bf16 one, so the
same budget holds about twice the blocks, hence twice the context or twice the sequences. A slot's bytes
follow `state_dtype`: recurrent states in bf16 are half of the fp32 ones (60 MiB a sequence at
Qwen3.5-35B-A3B's geometry), so about twice the sequences fit in STATE_SHARE.

`max_num_seqs` left to the engine is sized from the same budget on CUDA (`affordable_seqs`) and fixed at
`CPU_MAX_NUM_SEQS` elsewhere, so runs on the CPU stay deterministic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.cache import block_bytes, kv_cache_dtype, slot_bytes, state_dtype
from engine.config import ModelConfig
from engine.errors import EngineError
from engine.options import EngineOptions

log = logging.getLogger(__name__)

DEFAULT_CPU_CACHE_BYTES = 2 << 30
MAX_AUTO_SEQS = 1024  # the most sequences an automatically sized engine runs at once
CPU_MAX_NUM_SEQS = 64  # the automatic size off CUDA
STATE_SHARE = 0.5  # of the budget, what automatically sized state slots may take; KV blocks get the rest
# A lone prefill's chunk on CUDA when long_prefill_chunk is unset. On an H200 with Qwen3.5/3.6-35B-A3B an
# 8,192-token step reads all the weights (66 GiB in bf16, ~15 ms) and launches 40 layers of kernels; 32,768
# tokens spread that over 4x the tokens for ~4.3 GB of activations (`activation_bytes`: ~130 KiB a token).
LONG_PREFILL_CHUNK = 32768


@dataclass(frozen=True)
class CachePlan:
    num_slots: int  # slots sequences and prefix entries are given
    num_scratch_slots: int  # per-position states of MTP verify steps
    num_blocks: int
    block_size: int
    slot_bytes: int
    block_bytes: int
    budget_bytes: int

    @property
    def total_slots(self) -> int:
        return self.num_slots + self.num_scratch_slots

    @property
    def nbytes(self) -> int:
        return self.total_slots * self.slot_bytes + self.num_blocks * self.block_bytes


def activation_bytes(config: ModelConfig, dtype: torch.dtype, tokens: int, logit_rows: int) -> int:
    """A generous estimate of one step's transient memory: widest projections, expert buffers, logits."""
    c = config
    widest = max(
        c.linear_conv_dim + c.linear_value_dim,
        c.num_attention_heads * 2 * c.head_dim,
        2 * max(c.moe_intermediate_size * c.num_experts_per_tok, c.intermediate_size),
    )
    per_token = (8 * c.hidden_size + 4 * widest) * dtype.itemsize + c.num_experts * 8
    return tokens * per_token + 3 * logit_rows * c.vocab_size * 4


def step_tokens(options: EngineOptions, device: torch.device) -> int:
    """The most tokens one step computes: `max_num_batched_tokens`, or a lone prefill's chunk when larger
    (`long_prefill_chunk`; unset: LONG_PREFILL_CHUNK on CUDA, off elsewhere so CPU runs keep their steps)."""
    serving = options.serving
    chunk = serving.long_prefill_chunk
    if chunk is None:
        chunk = LONG_PREFILL_CHUNK if device.type == "cuda" else 0
    return max(serving.max_num_batched_tokens, chunk)


def memory_budget(
    device: torch.device,
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    max_num_batched_tokens: int,
    logit_rows: int,
    gpu_memory_utilization: float,
    kv_cache_memory: int | None,
) -> int:
    """Bytes the caches may take."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_CACHE_BYTES
    torch.cuda.empty_cache()  # memory cached by torch's allocator for freed tensors counts as free here
    free, total = torch.cuda.mem_get_info(device)
    reserve = total * (1.0 - gpu_memory_utilization)
    return int(free - reserve - activation_bytes(config, dtype, max_num_batched_tokens, logit_rows))


CUDA_BLOCK_SIZE = 64  # positions per KV block on CUDA unless the `block_size` option says
CPU_BLOCK_SIZE = 16


def block_size_for(option: int | None, device: torch.device) -> int:
    """The `block_size` option, or, unset, CUDA_BLOCK_SIZE on CUDA (the packed prefill attention kernel
    reads a 64-key tile from one page: 1.44-1.59x flash SDPA at 8,192-32,768 tokens against 1.23-1.38x with
    16-position pages, decode unchanged; docs/PERFORMANCE.md) and CPU_BLOCK_SIZE elsewhere."""
    if option is not None:
        return option
    return CUDA_BLOCK_SIZE if device.type == "cuda" else CPU_BLOCK_SIZE


def plan_for(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    options: EngineOptions,
    *,
    max_model_len: int,
    num_mtp_layers: int = 0,
    verify_seqs: int | None = None,
) -> tuple[int, CachePlan]:
    """`max_num_seqs` (the option's, or sized from the budget: `affordable_seqs` on CUDA, CPU_MAX_NUM_SEQS
    elsewhere) and the cache plan for the options' serving and cache settings. `verify_seqs`: the most
    sequences a step verifies drafts for (adaptive speculation), whose k scratch slots each are all the plan
    sets aside for verifying; None: every sequence."""
    serving, cache = options.serving, options.cache
    k = options.speculation.num_speculative_tokens or 0  # unset: `Engine` resolves it first
    max_num_seqs = serving.max_num_seqs
    if max_num_seqs is None and device.type != "cuda":
        max_num_seqs = CPU_MAX_NUM_SEQS
    budget = memory_budget(
        device,
        config,
        dtype,
        max_num_batched_tokens=step_tokens(options, device),
        logit_rows=(max_num_seqs or MAX_AUTO_SEQS) * (1 + k),
        gpu_memory_utilization=cache.gpu_memory_utilization,
        kv_cache_memory=cache.kv_cache_memory,
    )
    sizes = dict(
        max_model_len=max_model_len,
        num_speculative_tokens=k,
        num_mtp_layers=num_mtp_layers,
        block_size=block_size_for(cache.block_size, device),
        max_prefixes=cache.max_prefixes,
        kv_dtype=kv_cache_dtype(cache.kv_cache_dtype, dtype),
        state_dtype=state_dtype(cache.state_dtype, config),
        verify_seqs=verify_seqs,
    )
    if max_num_seqs is None:
        max_num_seqs = affordable_seqs(config, dtype, budget, **sizes)
        log.info("max_num_seqs %d, sized from a cache budget of %.1f GiB", max_num_seqs, budget / 2**30)
    return max_num_seqs, plan_cache(config, dtype, budget, max_num_seqs=max_num_seqs, **sizes)


def plan_cache(
    config: ModelConfig,
    dtype: torch.dtype,
    budget_bytes: int,
    *,
    max_num_seqs: int,
    max_model_len: int,
    num_speculative_tokens: int = 0,
    num_mtp_layers: int = 0,
    block_size: int = 16,
    max_prefixes: int = 4,
    kv_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    verify_seqs: int | None = None,
) -> CachePlan:
    """Slots and KV blocks (of `kv_dtype`, default `dtype`) for `max_num_seqs` sequences in the budget;
    verify scratch slots for `verify_seqs` of them (None: all)."""
    per_slot = slot_bytes(config, dtype, state_dtype)
    per_block = block_bytes(config, kv_dtype or dtype, block_size, num_mtp_layers)
    slots = max_num_seqs + max_prefixes
    scratch = min(max_num_seqs, verify_seqs or max_num_seqs) * num_speculative_tokens
    left = budget_bytes - (slots + scratch) * per_slot
    # A sequence may hold 2k positions past its end: k drafts being verified and k being proposed.
    per_seq = -(-(max_model_len + 2 * num_speculative_tokens) // block_size)
    wanted = (max_num_seqs + max_prefixes) * per_seq
    blocks = min(wanted, left // per_block if per_block else wanted)
    if blocks < 2:
        need = (slots + scratch) * per_slot + 2 * per_block
        raise EngineError(
            f"the cache budget of {budget_bytes / 2**20:.1f} MiB cannot hold {slots + scratch} state slots "
            f"and KV blocks (needs at least {need / 2**20:.1f} MiB); lower max_num_seqs or raise the budget"
        )
    return CachePlan(slots, scratch, int(blocks), block_size, per_slot, per_block, budget_bytes)


def affordable_seqs(
    config: ModelConfig,
    dtype: torch.dtype,
    budget_bytes: int,
    *,
    max_model_len: int,
    num_speculative_tokens: int = 0,
    num_mtp_layers: int = 0,
    block_size: int = 16,
    max_prefixes: int = 4,
    cap: int = MAX_AUTO_SEQS,
    kv_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    verify_seqs: int | None = None,
) -> int:
    """`max_num_seqs` sized from the budget: as many sequences as fit with their state and verify scratch
    slots in STATE_SHARE of it, or more when the rest still holds each of them at `max_model_len` positions
    (short contexts); fewer when the KV blocks left would not hold one sequence of `max_model_len` positions
    (a 1M-token context's 20 GiB) and fewer slots let them; at most `cap`, at least 1 (`plan_cache` then
    says when even that does not fit)."""
    one_slot = slot_bytes(config, dtype, state_dtype)
    # Verify scratch: k slots per sequence, or (adaptive speculation) for `verify_seqs` sequences at most.
    per_slot = one_slot * (1 + (0 if verify_seqs else num_speculative_tokens))
    per_block = block_bytes(config, kv_dtype or dtype, block_size, num_mtp_layers)
    per_seq_kv = -(-(max_model_len + 2 * num_speculative_tokens) // block_size) * per_block
    scratch = (verify_seqs or 0) * num_speculative_tokens * one_slot
    left = budget_bytes - max_prefixes * one_slot - scratch
    by_share = int(STATE_SHARE * left) // per_slot if per_slot else cap
    at_full_length = left // (per_slot + per_seq_kv) if per_slot + per_seq_kv else cap
    one_long = (left - per_seq_kv) // per_slot if per_slot else cap  # seqs leaving one full context's KV
    wanted = max(by_share, at_full_length)
    return max(1, min(cap, wanted, one_long) if one_long >= 1 else min(cap, wanted))
