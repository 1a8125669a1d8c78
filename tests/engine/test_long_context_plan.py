"""The planner admits one 1,048,576-token sequence of Qwen3.6-35B-A3B with a bf16 cache on one H200.

The arithmetic (bf16, block_size 64 as on CUDA, Qwen3.6's geometry with YaRN to 1M):

- weights: 35.5 B parameters (the MTP head included) x 2 bytes = 66.1 GiB;
- KV: 10 full-attention layers x (K + V) x 2 KV heads x 256 x 2 bytes = 20 KiB a position (22 KiB with the
  MTP layer's cache when speculating), so 1,048,576 positions = 16,384 blocks of 64 = 20 GiB (22 GiB);
- a state slot: 30 DeltaNet layers x (32 x 128 x 128 fp32 recurrent state + 8,192 x 3 bf16 conv) = 61.4 MiB;
- the H200 reports 143,771 MiB (140.4 GiB); less the weights, ~2 GiB of CUDA context and workspace, 10%
  held back (gpu_memory_utilization 0.9) and the activations of the largest step (a 32,768-token lone
  prefill chunk plus 1,024 fp32 logit rows per draft position: `activation_bytes`, ~7-13 GiB), ~45-51 GiB
  remain for the caches;
- automatic max_num_seqs gives state slots about half of that (~425 sequences without speculation, ~126
  with k=2 and their verify scratch slots) and the rest, more than 20 GiB, to KV blocks: room for the one
  1M-token sequence beside many short ones.
"""

from unittest import mock

import pytest
import torch

from engine.allocator import BlockAllocator, SlotAllocator
from engine.bench.presets import QWEN35_35B_A3B
from engine.bench.traffic import param_counts
from engine.cache import block_bytes, slot_bytes
from engine.config import config_from_dict
from engine.options import EngineOptions
from engine.planner import activation_bytes, affordable_seqs, plan_for, step_tokens
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.engine.test_yarn import QWEN36_YARN

ONE_M = 1 << 20
GIB = 1 << 30
H200 = 143771 << 20  # bytes nvidia-smi reports on an H200
CONTEXT = 2 * GIB  # CUDA context, cuBLAS workspace, torch's allocator slack after loading


def qwen36_1m():
    return config_from_dict(QWEN35_35B_A3B | {"rope_parameters": dict(QWEN36_YARN)})


def h200_plan(total: int, k: int):
    """What `plan_for` makes on a device of `total` bytes holding Qwen3.6's bf16 weights."""
    config = qwen36_1m()
    weights = param_counts(config).total * torch.bfloat16.itemsize
    free = total - weights - CONTEXT
    options = EngineOptions.from_flat({"num_speculative_tokens": k})
    cuda = torch.device("cuda")
    with (
        mock.patch("torch.cuda.mem_get_info", return_value=(free, total)),
        mock.patch("torch.cuda.empty_cache"),
    ):
        max_num_seqs, plan = plan_for(
            config,
            torch.bfloat16,
            cuda,
            options,
            max_model_len=config.max_model_len,
            num_mtp_layers=int(k > 0),
        )
    return config, options, max_num_seqs, plan, weights


@pytest.mark.parametrize("total", [139 * GIB, H200], ids=["139GiB", "143771MiB"])
@pytest.mark.parametrize("k", [0, 2])
def test_a_1m_token_sequence_fits_an_h200_in_bf16(total, k):
    config, options, max_num_seqs, plan, weights = h200_plan(total, k)
    assert config.max_model_len == ONE_M
    assert 66 * GIB < weights < 67 * GIB
    assert plan.block_bytes == (22 if k else 20) * 1024 * plan.block_size
    # The caches fit what was left after the weights, the held-back share and the activations.
    assert plan.nbytes <= plan.budget_bytes < total * 0.9 - weights - CONTEXT
    # One sequence of the whole window (plus 2k positions of drafts) has its blocks, beside others' slots.
    assert plan.num_blocks * plan.block_size >= ONE_M + 2 * k
    assert plan.num_slots == max_num_seqs + options.cache.max_prefixes
    assert max_num_seqs >= 100  # the 1M window does not starve batch serving (425 / 126 at this writing)


def test_the_scheduler_admits_and_prefills_1m_tokens_on_that_plan():
    _, options, max_num_seqs, plan, _ = h200_plan(H200, 0)
    sched = Scheduler(
        SlotAllocator(plan.num_slots),
        BlockAllocator(plan.num_blocks, plan.block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=options.serving.max_num_batched_tokens,
        long_prefill_chunk=step_tokens(options, torch.device("cuda")),
    )
    new = 4
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    seq = Sequence(0, [7] * (ONE_M - new), params, None, set(), None, ONE_M, torch.device("cpu"))
    sched.add(seq)
    chunks = []
    while sched.has_work():
        out = sched.schedule()
        assert not out.finished and not out.preempted  # never ended early for want of blocks
        for item in out.scheduled:
            chunks.append(item.num_new)
            if item.samples:
                seq.append(3, None)
        sched.update(out, [0] * len(out.scheduled))
    # 32 lone-prefill chunks of 32,768 tokens (the last one short by `new`), then the decode steps.
    assert chunks[:32] == [32768] * 31 + [32768 - new] and chunks[32:] == [1] * (new - 1)
    assert seq.num_tokens == ONE_M and seq.finish_reason == "length"


def test_automatic_max_num_seqs_leaves_one_full_context_its_blocks():
    # A budget where slots taking half of it would leave too little for one sequence of max_model_len.
    c = qwen36_1m()
    per_slot, per_block = slot_bytes(c, torch.bfloat16), block_bytes(c, torch.bfloat16, 16, 0)
    long_kv = ONE_M // 16 * per_block
    budget = long_kv + long_kv // 2  # 30 GiB: half of it (15 GiB) holds 3/4 of one 1M context
    n = affordable_seqs(c, torch.bfloat16, budget, max_model_len=ONE_M, max_prefixes=0)
    assert n * per_slot <= budget - long_kv < (n + 1) * per_slot
    # Without that rule half the budget would have gone to slots.
    assert n < int(0.5 * budget) // per_slot


def test_the_budget_leaves_room_for_a_lone_prefills_larger_step():
    config = qwen36_1m()
    total, free = H200, 70 * GIB
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    budgets = {}
    for chunk in (None, 1, 65536):
        options = EngineOptions.from_flat({"long_prefill_chunk": chunk, "max_num_seqs": 8})
        with (
            mock.patch("torch.cuda.mem_get_info", return_value=(free, total)),
            mock.patch("torch.cuda.empty_cache"),
        ):
            _, plan = plan_for(config, torch.bfloat16, cuda, options, max_model_len=ONE_M)
        budgets[chunk] = plan.budget_bytes
        if chunk is None:
            assert step_tokens(options, cuda) == 32768 and step_tokens(options, cpu) == 8192
    assert step_tokens(EngineOptions.from_flat({"long_prefill_chunk": 1}), cuda) == 8192  # off
    per_token = activation_bytes(config, torch.bfloat16, 1, 0)
    assert budgets[1] - budgets[None] == (32768 - 8192) * per_token
    assert budgets[None] - budgets[65536] == (65536 - 32768) * per_token


def test_the_block_size_is_64_on_cuda_and_16_elsewhere_unless_set():
    # Unset, CUDA plans take 64-position pages (the packed prefill kernel's one-page key tiles, measured
    # faster than 16 on Hopper) and the CPU keeps 16; the option wins wherever it is set.
    assert h200_plan(H200, 0)[3].block_size == 64
    config = config_from_dict(QWEN35_35B_A3B)
    for block_size, device, want in ((None, "cpu", 16), (32, "cpu", 32)):
        options = EngineOptions.from_flat({"block_size": block_size, "kv_cache_memory": 8 * GIB})
        _, plan = plan_for(config, torch.bfloat16, torch.device(device), options, max_model_len=4096)
        assert plan.block_size == want
