"""Slot and block allocators, the cache planner, the cache tensors, and the paged-KV layout."""

import copy

import pytest
import torch

from engine.allocator import BlockAllocator, SlotAllocator
from engine.cache import ModelCache, block_bytes, slot_bytes
from engine.config import config_from_dict
from engine.errors import EngineError
from engine.kernels.layout import SHORT_QUERY, SeqLayout
from engine.planner import (
    DEFAULT_CPU_CACHE_BYTES,
    MAX_AUTO_SEQS,
    activation_bytes,
    affordable_seqs,
    memory_budget,
    plan_cache,
)
from tests.engine.factories import BASE

LINEAR, FULL = "linear_attention", "full_attention"


def small_config(**overrides):
    """4 DeltaNet layers and 2 attention layers (different counts, so a swap would show)."""
    raw = {
        **BASE,
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": 6,
        "layer_types": [LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL],
        **overrides,
    }
    return config_from_dict(raw)


# ---- allocators


def test_slot_allocator_hands_out_lowest_first_and_rejects_bad_frees():
    slots = SlotAllocator(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2] and slots.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.allocate()
    slots.free(1)
    assert slots.num_free == 1 and slots.allocate() == 1
    slots.free(2)
    with pytest.raises(RuntimeError, match="not in use"):
        slots.free(2)
    for bad in (-1, 3):
        with pytest.raises(RuntimeError, match="not in use"):
            slots.free(bad)
    assert slots.num_free == 1


def free_blocks(blocks: BlockAllocator) -> list[int]:
    """The blocks an allocation would hand out now (taken from a copy)."""
    return sorted(copy.deepcopy(blocks).allocate(blocks.num_free))


def test_block_allocator_counts_references():
    blocks = BlockAllocator(4, block_size=4)
    assert [blocks.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    got = blocks.allocate(3)
    assert got == [0, 1, 2] and free_blocks(blocks) == [3]
    assert blocks.num_used == 3 and blocks.num_free == 1
    blocks.share([0, 1])
    blocks.share([0])  # references now 3, 2, 1, 0: each block is free after exactly that many frees
    blocks.free(got)
    assert free_blocks(blocks) == [2, 3] and blocks.num_free == 2
    blocks.free([0, 1])
    assert blocks.num_free == 3 and free_blocks(blocks) == [1, 2, 3]
    blocks.free([0])
    assert blocks.num_free == 4 and blocks.num_used == 0
    # Freed blocks are handed out again.
    assert sorted(blocks.allocate(4)) == [0, 1, 2, 3]


def test_block_allocator_rejects_double_free_sharing_a_free_block_and_overdraw():
    blocks = BlockAllocator(3, block_size=2)
    (b,) = blocks.allocate(1)
    blocks.free([b])
    with pytest.raises(RuntimeError, match="freed twice"):
        blocks.free([b])
    with pytest.raises(RuntimeError, match="cannot be shared"):
        blocks.share([b])
    with pytest.raises(RuntimeError, match="4 KV blocks asked for, 3 free"):
        blocks.allocate(4)
    assert blocks.num_free == 3
    for i in range(3):  # the failed calls left no reference behind
        with pytest.raises(RuntimeError, match="freed twice"):
            blocks.free([i])


# ---- cache tensors


def test_slot_and_block_bytes_by_hand():
    c = small_config()
    # conv: (2*2*8 + 4*12) channels x 3 taps; recurrent: 4 heads x 8 x 12 fp32; 4 DeltaNet layers.
    assert slot_bytes(c, torch.float32) == 4 * (80 * 3 * 4 + 4 * 8 * 12 * 4)
    assert slot_bytes(c, torch.bfloat16) == 4 * (80 * 3 * 2 + 4 * 8 * 12 * 4)  # the state stays fp32
    # k and v: block_size x 2 kv heads x 16; 2 attention layers (+ MTP layers).
    assert block_bytes(c, torch.bfloat16, 4, 0) == 2 * 2 * 4 * 2 * 16 * 2
    assert block_bytes(c, torch.float32, 8, 1) == 3 * 2 * 8 * 2 * 16 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_mtp", [0, 1])
def test_slot_and_block_bytes_match_the_tensors(dtype, num_mtp):
    c = small_config()
    cache = ModelCache(c, 3, 5, 4, "cpu", dtype, num_mtp)
    linear, kv = cache.linear_states(), cache.kv_states()
    assert len(linear) == 4 and len(kv) == 2 + num_mtp
    assert all(s.conv.dtype == dtype and s.recurrent.dtype == torch.float32 for s in linear)
    assert all(s.conv.shape[0] == s.recurrent.shape[0] == 3 for s in linear)
    assert all(p.k.shape == p.v.shape == (5, 4, 2, 16) and p.k.dtype == dtype for p in kv)
    linear_bytes = sum(t.numel() * t.element_size() for s in linear for t in (s.conv, s.recurrent))
    kv_bytes = sum(t.numel() * t.element_size() for p in kv for t in (p.k, p.v))
    assert linear_bytes == 3 * slot_bytes(c, dtype)
    assert kv_bytes == 5 * block_bytes(c, dtype, 4, num_mtp)
    assert cache.nbytes == linear_bytes + kv_bytes
    assert len(cache.tensors()) == 2 * (4 + 2 + num_mtp)


def filled_cache(num_slots=5, num_blocks=6):
    cache = ModelCache(small_config(), num_slots, num_blocks, 4, "cpu", torch.float32, num_mtp_layers=1)
    g = torch.Generator().manual_seed(0)
    for t in cache.tensors():
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def test_copy_slots_copies_every_deltanet_layer_and_nothing_else():
    cache = filled_cache()
    before = [t.clone() for t in cache.tensors()]
    cache.copy_slots([0, 2], [3, 1])
    for s, (conv, rec) in zip(
        cache.linear_states(), zip(before[0:8:2], before[1:8:2], strict=True), strict=True
    ):
        for src, dst in ((0, 3), (2, 1)):
            assert torch.equal(s.conv[dst], conv[src]) and torch.equal(s.recurrent[dst], rec[src])
        for untouched in (0, 2, 4):
            assert torch.equal(s.conv[untouched], conv[untouched])
            assert torch.equal(s.recurrent[untouched], rec[untouched])
    for now, then in zip(cache.tensors()[8:], before[8:], strict=True):
        assert torch.equal(now, then)  # KV, the MTP layer's included, is untouched


def test_copy_blocks_copies_every_attention_layer_with_the_mtp_head():
    cache = filled_cache()
    before = [t.clone() for t in cache.tensors()]
    cache.copy_blocks([5, 1], [0, 4])
    kv_before = before[8:]
    assert len(kv_before) == 2 * 3
    for p, (k, v) in zip(cache.kv_states(), zip(kv_before[0::2], kv_before[1::2], strict=True), strict=True):
        for src, dst in ((5, 0), (1, 4)):
            assert torch.equal(p.k[dst], k[src]) and torch.equal(p.v[dst], v[src])
        for untouched in (1, 2, 3, 5):
            assert torch.equal(p.k[untouched], k[untouched]) and torch.equal(p.v[untouched], v[untouched])
    for now, then in zip(cache.tensors()[:8], before[:8], strict=True):
        assert torch.equal(now, then)


def test_empty_copies_change_nothing():
    cache = filled_cache()
    before = [t.clone() for t in cache.tensors()]
    cache.copy_slots([], [])
    cache.copy_blocks([], [])
    assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), before, strict=True))


# ---- planner


def test_a_large_budget_gives_every_sequence_and_prefix_a_full_context():
    c = small_config()
    plan = plan_cache(
        c,
        torch.bfloat16,
        1 << 30,
        max_num_seqs=3,
        max_model_len=100,
        num_speculative_tokens=2,
        num_mtp_layers=1,
        block_size=16,
        max_prefixes=2,
    )
    assert (plan.num_slots, plan.num_scratch_slots, plan.total_slots) == (5, 6, 11)
    assert plan.num_blocks == (3 + 2) * 7  # ceil((100 + 2*2) / 16) blocks each
    assert plan.slot_bytes == slot_bytes(c, torch.bfloat16)
    assert plan.block_bytes == block_bytes(c, torch.bfloat16, 16, 1)
    assert plan.budget_bytes == 1 << 30 and plan.nbytes < plan.budget_bytes


def test_a_tight_budget_fills_what_is_left_after_the_slots_with_blocks():
    c = small_config()
    per_slot, per_block = slot_bytes(c, torch.float32), block_bytes(c, torch.float32, 4, 0)
    budget = 3 * per_slot + 11 * per_block - 1  # 3 slots, 10 blocks and not quite an 11th
    plan = plan_cache(
        c, torch.float32, budget, max_num_seqs=2, max_model_len=512, block_size=4, max_prefixes=1
    )
    assert (plan.total_slots, plan.num_blocks) == (3, 10)
    assert plan.nbytes <= budget < plan.nbytes + per_block
    cache = ModelCache(c, plan.total_slots, plan.num_blocks, plan.block_size, "cpu", torch.float32)
    assert cache.nbytes == plan.nbytes


def test_a_budget_too_small_for_the_slots_is_refused():
    c = small_config()
    per_slot, per_block = slot_bytes(c, torch.float32), block_bytes(c, torch.float32, 16, 0)
    enough = 4 * per_slot + 2 * per_block
    plan = plan_cache(c, torch.float32, enough, max_num_seqs=2, max_model_len=64, max_prefixes=2)
    assert plan.num_blocks == 2
    with pytest.raises(EngineError, match="cannot hold 4 state slots"):
        plan_cache(c, torch.float32, enough - 1, max_num_seqs=2, max_model_len=64, max_prefixes=2)
    with pytest.raises(EngineError, match="lower max_num_seqs"):
        plan_cache(c, torch.float32, 1000, max_num_seqs=64, max_model_len=64)


@pytest.mark.parametrize("k", [0, 2])
def test_automatic_max_num_seqs_gives_state_slots_half_the_budget_at_long_contexts(k):
    c = small_config()
    per_slot, per_block = slot_bytes(c, torch.float32), block_bytes(c, torch.float32, 16, 0)
    budget = 1000 * per_slot + 3 * per_slot // 4  # half of it: 500 slots and a bit
    n = affordable_seqs(
        c, torch.float32, budget, max_model_len=1 << 20, num_speculative_tokens=k, max_prefixes=0
    )
    assert n == 500 // (1 + k)  # each sequence's verify scratch slots count against it
    plan = plan_cache(
        c,
        torch.float32,
        budget,
        max_num_seqs=n,
        max_model_len=1 << 20,
        num_speculative_tokens=k,
        max_prefixes=0,
    )
    assert plan.total_slots * per_slot <= budget / 2 and 0 <= budget - plan.nbytes < per_block  # the rest: KV


def test_automatic_max_num_seqs_takes_more_when_every_sequence_fits_at_full_length():
    c = small_config()
    per_slot, per_block = slot_bytes(c, torch.float32), block_bytes(c, torch.float32, 16, 0)
    budget = 300 * (per_slot + per_block) + 2 * per_slot  # 300 sequences of 16 positions, 2 prefixes
    n = affordable_seqs(c, torch.float32, budget, max_model_len=16, max_prefixes=2)
    assert n == 300 > (budget // 2) // per_slot
    plan = plan_cache(c, torch.float32, budget, max_num_seqs=n, max_model_len=16, max_prefixes=2)
    assert plan.num_blocks >= 300  # each of them holds its full context


def test_automatic_max_num_seqs_is_capped_and_at_least_one():
    c = small_config()
    assert affordable_seqs(c, torch.float32, 1 << 40, max_model_len=4096) == MAX_AUTO_SEQS
    assert affordable_seqs(c, torch.float32, 1 << 40, max_model_len=4096, cap=77) == 77
    assert affordable_seqs(c, torch.float32, 10, max_model_len=4096) == 1


def test_activation_bytes_is_linear_in_tokens_plus_three_fp32_logit_rows():
    c = small_config()
    one = activation_bytes(c, torch.bfloat16, 1, 0)
    assert activation_bytes(c, torch.bfloat16, 0, 0) == 0 and one > 8 * c.hidden_size * 2
    assert activation_bytes(c, torch.bfloat16, 100, 0) == 100 * one
    assert activation_bytes(c, torch.float32, 1, 0) > one
    assert activation_bytes(c, torch.bfloat16, 100, 7) - 100 * one == 7 * 3 * c.vocab_size * 4
    more_experts = small_config(num_experts=64)
    assert activation_bytes(more_experts, torch.bfloat16, 1, 0) > one


def test_memory_budget_off_cuda():
    c = small_config()
    kwargs = {"max_num_batched_tokens": 64, "logit_rows": 4, "gpu_memory_utilization": 0.9}
    cpu = torch.device("cpu")
    assert memory_budget(cpu, c, torch.float32, kv_cache_memory=12345, **kwargs) == 12345
    assert memory_budget(cpu, c, torch.float32, kv_cache_memory=None, **kwargs) == DEFAULT_CPU_CACHE_BYTES


# ---- SeqLayout


def test_kv_index_follows_each_block_table():
    layout = SeqLayout((1, 1), (8, 2), (0, 1), ((7, 2, 9), (5,)), 4)
    assert layout.kv_index([0, 3, 4, 7, 8], 0) == [28, 31, 8, 11, 36]
    assert layout.kv_index([0, 2], 1) == [20, 22]


def test_slot_mapping_positions_and_offsets():
    layout = SeqLayout((3, 2, 1), (3, 1, 0), (4, 0, 2), ((7, 2), (5,), (1,)), 4)
    assert layout.slot_mapping("cpu").tolist() == [31, 8, 9, 21, 22, 4]
    assert layout.slot_mapping("cpu").dtype == torch.long
    assert layout.slot_mapping("cpu") is layout.slot_mapping("cpu")  # built once per device
    assert layout.positions("cpu").tolist() == [3, 4, 5, 1, 2, 0]
    assert layout.cu_seqlens == (0, 3, 5, 6)
    assert layout.num_tokens == 6 and layout.num_seqs == 3


def test_short_and_long_sequences_and_kept_states():
    n = SHORT_QUERY
    layout = SeqLayout((n, n + 1, 1), (0, 0, 5), (0, 1, 2), state_out=((), (), (9,)))
    assert layout.short_seqs == (0, 2) and layout.long_seqs == (1,)
    assert [layout.keeps_states(i) for i in range(3)] == [False, False, True]
    assert SeqLayout((1, 1), (3, 4), (0, 1)).short_seqs == (0, 1)  # a decode batch goes through whole
    assert not SeqLayout((1,), (0,), (0,)).keeps_states(0)


def test_a_block_table_that_exactly_fits_is_accepted():
    layout = SeqLayout((2,), (6,), (0,), ((3, 1),), 4)
    assert layout.slot_mapping("cpu").tolist() == [6, 7]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"query_lens": (1, 2), "context_lens": (0,), "slots": (0, 1)}, "one entry per sequence"),
        ({"query_lens": (1, 0), "context_lens": (0, 0), "slots": (0, 1)}, "at least one new token"),
        (
            {
                "query_lens": (1, 1),
                "context_lens": (0, 0),
                "slots": (0, 1),
                "block_tables": ((0,),),
                "block_size": 4,
            },
            "one table per sequence",
        ),
        (
            {"query_lens": (1,), "context_lens": (0,), "slots": (0,), "block_tables": ((0,),)},
            "positive block_size",
        ),
        (
            {
                "query_lens": (3,),
                "context_lens": (2,),
                "slots": (0,),
                "block_tables": ((0,),),
                "block_size": 4,
            },
            "1 blocks cannot hold 5 positions",
        ),
        (
            {"query_lens": (2, 1), "context_lens": (0, 0), "slots": (0, 1), "state_out": ((5,), ())},
            "one slot per new token or none",
        ),
        (
            {"query_lens": (2,), "context_lens": (0,), "slots": (0,), "state_out": ((5, 6, 7),)},
            "one slot per new token or none",
        ),
    ],
)
def test_bad_layouts_are_rejected(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SeqLayout(**kwargs)


def test_kv_index_needs_block_tables():
    layout = SeqLayout((1,), (0,), (0,))
    with pytest.raises(ValueError, match="no block tables"):
        layout.kv_index([0], 0)
    with pytest.raises(ValueError, match="no block tables"):
        layout.slot_mapping("cpu")


@pytest.mark.parametrize(
    ("src", "dst", "launches"),
    [
        # A verify step's commit at batch 1: a strided copy per pool, no index tensors, no gathered temporary.
        ([1], [3], {"aten::copy_": 2, "aten::index": 0, "aten::index_put_": 0}),
        # Several pairs: a gather and a scatter per pool.
        ([1, 0], [3, 2], {"aten::index": 2, "aten::index_put_": 2}),
    ],
)
def test_copying_slots_launches_per_pool_whatever_the_layers(src, dst, launches):
    """Copying slots moves every DeltaNet layer's conv and recurrent state with launches per pool (the
    counts given), not per layer, and leaves the other slots alone."""
    config = small_config()
    cache = ModelCache(config, num_slots=4, num_blocks=2, block_size=4, device="cpu", dtype=torch.float32)
    for state in cache.linear_states():
        state.conv.normal_()
        state.recurrent.normal_()
        assert state.conv._base is cache.conv_pool and state.recurrent._base is cache.recurrent_pool
    before = [(s.conv.clone(), s.recurrent.clone()) for s in cache.linear_states()]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cache.copy_slots(src, dst)
    names = [e.name for e in prof.events()]
    assert {name: names.count(name) for name in launches} == launches, names
    for state, (conv, rec) in zip(cache.linear_states(), before, strict=True):
        for slot in range(4):
            origin = src[dst.index(slot)] if slot in dst else slot
            assert torch.equal(state.conv[slot], conv[origin])
            assert torch.equal(state.recurrent[slot], rec[origin])
