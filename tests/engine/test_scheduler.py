"""Scheduler and prefix cache bookkeeping, driven by a fake runner (no model, no tensors).

Every step is checked against the scheduler's contract: the token and sequence limits, block tables that
cover the step's positions, and slot/block pools whose reference counts match exactly what the running
sequences and the prefix entries hold.
"""

import copy
from collections import Counter

import torch

from engine.allocator import BlockAllocator, SlotAllocator
from engine.prefix import PrefixCache
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import PrefixSpec, Sequence

CPU = torch.device("cpu")
NEXT = 3  # the token the fake runner samples
DRAFT = 5  # the token the fake drafter proposes


def make_seq(index, prompt, *, max_tokens=4, priority=0, arrival=None, prefix=None, max_model_len=1024):
    """A greedy request; `prompt` is token ids or a length, `prefix` the leading ids it shares."""
    if isinstance(prompt, int):
        prompt = [10 + (7 * index + j) % 50 for j in range(prompt)]
    return Sequence(
        index,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        None,
        set(),
        None,
        max_model_len,
        CPU,
        priority=priority,
        arrival=index if arrival is None else arrival,
        prefix=None if prefix is None else PrefixSpec(tuple(prefix)),
    )


def make_scheduler(
    *,
    num_slots=8,
    num_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    k=0,
    max_prefixes=2,
    long_prefill_chunk=0,
):
    return Scheduler(
        SlotAllocator(num_slots),
        BlockAllocator(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_speculative_tokens=k,
        max_prefixes=max_prefixes,
        long_prefill_chunk=long_prefill_chunk,
    )


def holders(sched: Scheduler) -> list:
    return list(sched.running) + [e for e in sched.prefixes.entries.values() if e.ready]


def block_refs(sched: Scheduler) -> Counter:
    """Block -> how many running sequences and prefix entries hold it (step checks the allocator agrees)."""
    return Counter(b for h in holders(sched) for b in h.blocks)


def check_pools(sched: Scheduler) -> None:
    """Slots and block refcounts are exactly what running sequences and prefix entries hold."""
    slots = [h.slot for h in holders(sched)]
    assert None not in slots and len(set(slots)) == len(slots)
    assert sched.slots.num_free == sched.slots.num_slots - len(slots)
    refs = block_refs(sched)
    assert sched.blocks.num_free == sched.blocks.num_blocks - len(refs)
    # Every holder lets go, on a copy: a block counted fewer times than it is held raises "freed twice",
    # one counted more times stays in use.
    drained = copy.deepcopy(sched.blocks)
    drained.free(list(refs.elements()))
    assert drained.num_free == drained.num_blocks, "a block is counted more times than it is held"
    for seq in sched.waiting:
        assert seq.slot is None and seq.blocks == [] and seq.num_computed == 0


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    if out.num_tokens > sched.max_num_batched_tokens:  # only a lone prompt's prefill chunk
        assert len(out.scheduled) == 1 and sched.running == [out.scheduled[0].seq] and not sched.waiting
        assert out.num_tokens <= sched.long_prefill_chunk and out.scheduled[0].num_new > 1
    assert len(out.scheduled) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    seen = set()
    for item in out.scheduled:
        seq = item.seq
        assert id(seq) not in seen and seq in sched.running
        seen.add(id(seq))
        assert item.num_new > 0 and item.context == seq.num_computed
        assert item.context + item.num_new <= seq.target
        lookahead = sched.k if seq.compute_target is None else 0
        assert len(seq.blocks) * sched.blocks.block_size >= item.context + item.num_tokens + lookahead
    check_pools(sched)


def step(sched: Scheduler, *, accept=0, drafts=0):
    """One step with a fake runner: sample NEXT, accept up to `accept` drafts, propose `drafts` more."""
    out = sched.schedule()
    check_step(sched, out)
    accepted = []
    for item in out.scheduled:
        seq, kept = item.seq, 0
        if item.samples:
            kept = min(accept, len(item.drafts))
            for token in [*item.drafts[:kept], NEXT]:
                seq.append(token, None)
                if seq.finished:
                    break
            seq.draft_ids = [] if seq.finished else [DRAFT] * drafts
        accepted.append(kept)
    finished = sched.update(out, accepted)
    assert all(s.compute_target is None and s.finished for s in finished)
    check_pools(sched)
    return out, finished


def run(sched: Scheduler, max_steps=200, **kwargs):
    """Steps until the scheduler is idle; fails instead of looping forever."""
    outs, finished = [], []
    while sched.has_work():
        assert len(outs) < max_steps, "the scheduler did not drain"
        out, done = step(sched, **kwargs)
        outs.append(out)
        finished += done
    return outs, finished


def first_steps(outs):
    """Sequence index -> the step it was first scheduled in."""
    first = {}
    for i, out in enumerate(outs):
        for item in out.scheduled:
            first.setdefault(item.seq.index, i)
    return first


def assert_pools_empty(sched: Scheduler) -> None:
    assert sched.slots.num_free == sched.slots.num_slots
    assert sched.blocks.num_free == sched.blocks.num_blocks


# ---- limits, ordering, chunking


def test_every_step_respects_the_token_budget_and_sequence_limit():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    lengths, max_tokens = [3, 17, 5, 12, 1, 9, 25, 4], [5, 2, 7, 3, 4, 6, 2, 8]
    seqs = [make_seq(i, n, max_tokens=m) for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))]
    for seq in seqs:
        sched.add(seq)
    outs, finished = run(sched)
    assert sorted(s.index for s in finished) == list(range(len(seqs)))
    for seq, m in zip(seqs, max_tokens, strict=True):
        assert seq.finish_reason == "length" and len(seq.output_ids) == m
    # The limits were actually reached, so the checks in check_step had something to hold back.
    assert max(out.num_tokens for out in outs) == 10
    assert max(len(out.scheduled) for out in outs) == 3
    assert_pools_empty(sched)


def test_running_decodes_are_scheduled_before_waiting_prefills():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(0, 3, max_tokens=10)
    sched.add(a)
    step(sched)
    b, c = make_seq(1, 20), make_seq(2, 5)
    sched.add(b)
    sched.add(c)
    out, _ = step(sched)
    got = [(i.seq, i.context, i.num_new, i.samples) for i in out.scheduled]
    assert got == [(a, 3, 1, True), (b, 0, 7, False)]
    assert c.slot is None and c in sched.waiting
    # Next step the running prefill also goes before the waiting request, which gets nothing.
    out, _ = step(sched)
    got = [(i.seq, i.context, i.num_new) for i in out.scheduled]
    assert got == [(a, 4, 1), (b, 7, 7)]
    assert c.slot is None and c in sched.waiting


def test_a_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(0, 21, max_tokens=2)
    sched.add(seq)
    outs, finished = run(sched)
    got = [(i.context, i.num_new, i.samples) for o in outs for i in o.scheduled]
    assert got == [(0, 8, False), (8, 8, False), (16, 5, True), (21, 1, True)]
    assert seq.metrics.cached_prefix_tokens == 0
    assert finished == [seq] and seq.output_ids == [NEXT, NEXT]


def test_a_lone_long_prompt_takes_larger_chunks():
    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_chunk=32, num_blocks=64)
    seq = make_seq(0, 75, max_tokens=3)
    sched.add(seq)
    outs, finished = run(sched)
    got = [(i.context, i.num_new) for o in outs for i in o.scheduled]
    assert got == [(0, 32), (32, 32), (64, 11), (75, 1), (76, 1)]
    assert finished == [seq] and seq.output_ids == [NEXT] * 3


def test_larger_chunks_are_off_at_or_below_the_step_budget():
    for chunk in (0, 8):
        sched = make_scheduler(max_num_batched_tokens=8, long_prefill_chunk=chunk)
        sched.add(make_seq(0, 21, max_tokens=1))
        outs, _ = run(sched)
        assert [i.num_new for o in outs for i in o.scheduled] == [8, 8, 5]


def test_no_larger_chunk_while_another_request_waits_or_decodes():
    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_chunk=32, max_num_seqs=1)
    a, b = make_seq(0, 40, max_tokens=2), make_seq(1, 40, max_tokens=2)
    sched.add(a)
    sched.add(b)  # waits for a's slot (max_num_seqs 1): a keeps to the step budget
    out, _ = step(sched)
    assert [(i.seq, i.num_new) for i in out.scheduled] == [(a, 8)]

    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_chunk=32)
    short, long = make_seq(0, 3, max_tokens=6), make_seq(1, 40, max_tokens=2)
    sched.add(short)
    step(sched)  # short's prompt: it decodes from now on
    sched.add(long)
    for _ in range(4):
        out, _ = step(sched)
        assert out.num_tokens <= 8 and short in [i.seq for i in out.scheduled]


def test_a_request_arriving_mid_prefill_ends_the_larger_chunks():
    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_chunk=32)
    a = make_seq(0, 100, max_tokens=2)
    sched.add(a)
    out, _ = step(sched)
    assert [i.num_new for i in out.scheduled] == [32]
    b = make_seq(1, 4, max_tokens=2)
    sched.add(b)
    out, _ = step(sched)
    assert [(i.seq, i.num_new) for i in out.scheduled] == [(a, 8)]  # b waits behind a's chunk, as before
    outs, finished = run(sched)
    assert sorted(s.index for s in finished) == [0, 1]
    assert max(o.num_tokens for o in outs) <= 8


def test_priority_orders_admission_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    specs = [(0, 1, 0), (1, 0, 2), (2, 0, 1), (3, 2, 3), (4, 1, 4)]  # (index, priority, arrival)
    for index, priority, arrival in specs:
        sched.add(make_seq(index, 3, max_tokens=2, priority=priority, arrival=arrival))
    outs, _ = run(sched)
    first = first_steps(outs)
    assert sorted(first, key=first.get) == [2, 1, 0, 4, 3]


def test_admission_waits_for_a_free_slot():
    sched = make_scheduler(num_slots=2, max_num_seqs=4)
    a, b, c = make_seq(0, 4, max_tokens=2), make_seq(1, 4, max_tokens=5), make_seq(2, 4, max_tokens=3)
    for seq in (a, b, c):
        sched.add(seq)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [a, b]
    assert c.slot is None and c.blocks == [] and sched.slots.num_free == 0
    out, finished = step(sched)
    assert finished == [a] and c not in [i.seq for i in out.scheduled]
    out, _ = step(sched)
    assert [(i.seq, i.context) for i in out.scheduled] == [(b, 5), (c, 0)]
    run(sched)
    assert c.finished and len(c.output_ids) == 3
    assert_pools_empty(sched)


def test_admission_waits_for_blocks_without_allocating():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a = make_seq(0, 10, max_tokens=2)  # 3 of the 4 blocks
    b = make_seq(1, 8, max_tokens=2)  # needs 2
    c = make_seq(2, 1, max_tokens=2)  # would fit, but comes after b
    for seq in (a, b, c):
        sched.add(seq)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [a]
    assert sched.blocks.num_free == 1 and sched.slots.num_free == sched.slots.num_slots - 1
    assert b.slot is None and b.blocks == [] and c.slot is None
    out, finished = step(sched)
    assert [i.seq for i in out.scheduled] == [a] and finished == [a]
    out, _ = step(sched)
    assert [(i.seq, i.num_new) for i in out.scheduled] == [(b, 8), (c, 1)]
    run(sched)
    assert b.finished and c.finished and len(b.output_ids) == 2
    assert_pools_empty(sched)


# ---- preemption and running out of room


def test_preemption_takes_the_least_urgent_running_sequence():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a = make_seq(0, 8, max_tokens=3, priority=0)  # 2 blocks, grows into a third next step
    b = make_seq(1, 4, max_tokens=3, priority=2)
    c = make_seq(2, 3, max_tokens=3, priority=1)
    for seq in (a, b, c):
        sched.add(seq)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [a, c, b] and sched.blocks.num_free == 0
    b_blocks = list(b.blocks)
    out, _ = step(sched)
    assert out.preempted == [b] and sched.num_preemptions == 1
    assert [i.seq for i in out.scheduled] == [a, c]
    assert b.slot is None and b.blocks == [] and b.num_computed == 0 and b.num_preemptions == 1
    assert b in sched.waiting and b not in sched.running
    assert b_blocks[0] in a.blocks  # the block went to the sequence that needed it
    assert b.output_ids == [NEXT]  # what it generated is kept and recomputed
    _, finished = run(sched)
    assert set(finished) == {a, b, c}
    assert b.output_ids == [NEXT] * 3 and b.to_output().metrics.num_preemptions == 1
    assert_pools_empty(sched)


def test_a_preempted_sequence_is_recomputed_from_its_tokens():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make_seq(0, 8, max_tokens=3, priority=0)
    b = make_seq(1, 4, max_tokens=3, priority=1)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)  # b preempted after one token
    assert b.num_preemptions == 1
    outs, _ = run(sched)
    b_items = [i for o in outs for i in o.scheduled if i.seq is b]
    assert (b_items[0].context, b_items[0].num_new, b_items[0].samples) == (0, 5, True)


def test_a_lone_sequence_that_outgrows_the_pool_ends_with_length():
    sched = make_scheduler(num_blocks=2, block_size=4)  # 8 positions in all
    seq = make_seq(0, 4, max_tokens=100)
    sched.add(seq)
    outs, finished = run(sched, max_steps=20)
    assert finished == [seq] and seq.finish_reason == "length"
    assert outs[-1].finished == [seq] and not outs[-1].scheduled
    assert len(seq.output_ids) == 5  # positions 0..7 computed, the 9th does not fit
    assert_pools_empty(sched)


# ---- speculative drafts


def test_drafts_are_scheduled_as_extra_tokens_and_trimmed_by_the_budget():
    sched = make_scheduler(k=2, max_num_batched_tokens=4)
    a, b = make_seq(0, 1, max_tokens=20), make_seq(1, 1, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched, drafts=2)
    assert a.draft_ids == [DRAFT, DRAFT] and b.draft_ids == [DRAFT, DRAFT]
    out, _ = step(sched, accept=2, drafts=2)
    items = {i.seq.index: i for i in out.scheduled}
    assert (items[0].num_new, items[0].drafts, items[0].num_tokens) == (1, (DRAFT, DRAFT), 3)
    assert (items[1].num_new, items[1].drafts, items[1].samples) == (1, (), True)  # budget left: 1
    assert out.num_tokens == 4
    # Accepted drafts advance the cache; the fake runner appended them plus one sampled token.
    assert a.num_computed == 1 + 1 + 2 and a.num_tokens == a.num_computed + 1
    assert b.num_computed == 2 and b.num_tokens == 3


def test_a_budget_of_two_keeps_one_draft_and_rejected_drafts_are_recomputed():
    sched = make_scheduler(k=3, max_num_batched_tokens=2)
    seq = make_seq(0, 1, max_tokens=20)
    sched.add(seq)
    step(sched, drafts=3)
    out, _ = step(sched, accept=0, drafts=3)
    assert out.scheduled[0].drafts == (DRAFT,)
    assert seq.num_computed == 2 and seq.num_tokens == 3  # none accepted: only the sampled token
    out, _ = step(sched, accept=1, drafts=3)
    assert out.scheduled[0].context == 2 and seq.num_computed == 4 and seq.num_tokens == 5


# ---- shared prefixes

PREFIX = tuple(range(100, 110))  # P = 10: the entry caches 9 positions, 2 full blocks of 4 and a partial


def test_a_shared_prefix_is_computed_once_and_shared():
    sched = make_scheduler(num_slots=6, max_prefixes=2)
    u1 = make_seq(0, [*PREFIX, 1, 2, 3], prefix=PREFIX, max_tokens=3)
    sched.add(u1)
    out = sched.schedule()  # the filler is queued ahead of u1 and admitted in the same step
    filler = out.scheduled[0].seq
    assert sched.waiting == [u1] and filler.index == -1
    assert filler.compute_target == len(PREFIX) - 1 and filler.prefix.key == PREFIX
    entry = sched.prefixes.entries[PREFIX]
    assert not entry.ready and entry.filler is filler
    assert [(i.seq, i.context, i.num_new, i.samples) for i in out.scheduled] == [(filler, 0, 9, False)]
    sched.update(out, [0])
    assert entry.ready and filler not in sched.running and filler.slot is None and filler.blocks == []
    assert entry.slot is not None and len(entry.blocks) == 3
    assert u1 in sched.waiting

    out, _ = step(sched)
    (item,) = out.scheduled
    assert (item.seq, item.context, item.num_new, u1.metrics.cached_prefix_tokens) == (u1, 9, 4, 9)
    assert out.slot_copies == [(entry.slot, u1.slot)]
    assert out.block_copies == [(entry.blocks[2], u1.blocks[2])]
    assert u1.blocks[:2] == entry.blocks[:2] and u1.blocks[2] != entry.blocks[2]
    assert [block_refs(sched)[b] for b in entry.blocks] == [2, 2, 1]

    u2 = make_seq(1, [*PREFIX, 4], prefix=PREFIX, max_tokens=3)
    u3 = make_seq(2, [*PREFIX, 5, 6, 7, 8, 9], prefix=PREFIX, max_tokens=3)
    sched.add(u2)
    sched.add(u3)
    out, _ = step(sched)
    items = {i.seq.index: i for i in out.scheduled}
    assert (items[1].context, items[1].num_new, items[2].context, items[2].num_new) == (9, 2, 9, 6)
    assert out.slot_copies == [(entry.slot, u2.slot), (entry.slot, u3.slot)]
    assert out.block_copies == [(entry.blocks[2], u2.blocks[2]), (entry.blocks[2], u3.blocks[2])]
    assert [block_refs(sched)[b] for b in entry.blocks] == [4, 4, 1]
    assert u2.metrics.cached_prefix_tokens == u3.metrics.cached_prefix_tokens == 9

    _, finished = run(sched)
    assert set(finished) == {u1, u2, u3}
    assert all(len(u.output_ids) == 3 for u in (u1, u2, u3))
    assert sched.prefixes.users == {}
    # Only the entry holds anything now.
    assert sched.slots.num_free == sched.slots.num_slots - 1
    assert sched.blocks.num_used == 3 and [block_refs(sched)[b] for b in entry.blocks] == [1, 1, 1]
    assert sched.prefixes.evict_one()
    assert len(sched.prefixes) == 0
    assert_pools_empty(sched)


def test_a_prefix_of_whole_blocks_needs_no_block_copy():
    sched = make_scheduler()
    key = tuple(range(100, 109))  # 8 cached positions: exactly 2 blocks
    u = make_seq(0, [*key, 1, 2], prefix=key, max_tokens=2)
    sched.add(u)
    step(sched)  # the filler
    out, _ = step(sched)
    entry = sched.prefixes.entries[key]
    assert out.block_copies == [] and out.slot_copies == [(entry.slot, u.slot)]
    assert u.blocks[:2] == entry.blocks and len(u.blocks) == 3
    assert (out.scheduled[0].context, out.scheduled[0].num_new) == (8, 3)


def test_a_request_that_is_exactly_the_prefix_computes_its_last_token():
    sched = make_scheduler()
    u = make_seq(0, list(PREFIX), prefix=PREFIX, max_tokens=2)
    sched.add(u)
    outs, finished = run(sched)
    items = [i for o in outs for i in o.scheduled if i.seq is u]
    assert (items[0].context, items[0].num_new, items[0].samples) == (9, 1, True)
    assert finished == [u] and u.output_ids == [NEXT, NEXT]


def test_a_preempted_prefix_user_restarts_from_the_prefix():
    sched = make_scheduler(num_blocks=5, block_size=4, max_prefixes=1)
    u = make_seq(0, [*PREFIX, 1], prefix=PREFIX, max_tokens=3, priority=1)
    sched.add(u)
    for _ in range(2):  # fill, admit u
        step(sched)
    entry = sched.prefixes.entries[PREFIX]
    a = make_seq(1, 4, max_tokens=3, priority=0)
    sched.add(a)
    step(sched)  # a takes the last free block
    assert sched.blocks.num_free == 0
    out, _ = step(sched)  # a grows into a second block: u, less urgent, gives way
    assert out.preempted == [u] and u.blocks == [] and u.slot is None and u.num_computed == 0
    assert [block_refs(sched)[b] for b in entry.blocks] == [1, 1, 1]  # only the entry holds them now
    outs, finished = run(sched)
    (item,) = [i for o in outs for i in o.scheduled if i.seq is u]
    assert (item.context, item.num_new, item.samples, u.metrics.cached_prefix_tokens) == (9, 4, True, 9)
    readmit = next(o for o in outs if item in o.scheduled)
    assert [src for src, _ in readmit.slot_copies] == [entry.slot]
    assert [src for src, _ in readmit.block_copies] == [entry.blocks[2]]
    assert set(finished) == {u, a} and len(u.output_ids) == 3 and u.num_preemptions == 1


def test_entries_named_by_live_requests_are_not_evicted():
    sched = make_scheduler(max_prefixes=1)
    k1, k2 = tuple(range(100, 106)), tuple(range(200, 206))
    u1 = make_seq(0, [*k1, 1], prefix=k1, max_tokens=12)
    sched.add(u1)
    for _ in range(2):
        step(sched)
    assert sched.prefixes.entries[k1].ready and u1 in sched.running
    # k1 is in use and the cache is full: k2 is computed in full, without a filler.
    u2 = make_seq(1, [*k2, 1], prefix=k2, max_tokens=2)
    sched.add(u2)
    out, _ = step(sched)
    item = next(i for i in out.scheduled if i.seq is u2)
    assert (item.context, item.num_new, u2.metrics.cached_prefix_tokens) == (0, 7, 0)
    assert list(sched.prefixes.entries) == [k1] and sched.waiting == []
    run(sched)
    assert u2.metrics.cached_prefix_tokens == 0 and u1.metrics.cached_prefix_tokens == 5
    # Once idle, k1 gives way to a new prefix.
    u3 = make_seq(2, [*k2, 2], prefix=k2, max_tokens=2)
    sched.add(u3)
    step(sched)
    assert list(sched.prefixes.entries) == [k2] and sched.prefixes.entries[k2].ready and u3 in sched.waiting
    _, finished = run(sched)
    assert finished == [u3] and u3.metrics.cached_prefix_tokens == 5


def test_idle_entries_are_evicted_to_admit_a_request():
    sched = make_scheduler(num_blocks=4, block_size=4)
    u = make_seq(0, [*PREFIX, 1], prefix=PREFIX, max_tokens=1)
    sched.add(u)
    run(sched)
    assert len(sched.prefixes) == 1 and sched.blocks.num_free == 1
    v = make_seq(1, 8, max_tokens=2)  # needs 2 blocks
    sched.add(v)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [v] and len(sched.prefixes) == 0
    run(sched)
    assert_pools_empty(sched)


def test_prefix_cache_evicts_least_recently_used_idle_ready_entries():
    slots, blocks = SlotAllocator(4), BlockAllocator(16, 4)
    cache = PrefixCache(2, slots, blocks)

    def fill(key):
        filler = make_seq(0, list(key), prefix=key).prefix_filler()
        entry = cache.start(key, filler)
        if entry is not None:
            filler.slot, filler.blocks = slots.allocate(), blocks.allocate(3)  # one block too many
            cache.filled(entry)
            assert len(entry.blocks) == 2 and filler.blocks == [] and filler.slot is None
        return entry

    k1, k2, k3, k4, k5 = (tuple(range(10 * i, 10 * i + 6)) for i in range(1, 6))
    e1, e2 = fill(k1), fill(k2)
    assert e1.ready and e2.ready
    assert blocks.num_used == 4 and slots.num_free == 2  # each filler's extra block went back
    cache.get(k1)  # k1 is now more recent than k2
    e3 = fill(k3)
    assert e3 is not None and set(cache.entries) == {k1, k3}
    assert blocks.num_used == 4 and slots.num_free == 2  # k2's slot and blocks were freed
    cache.add_user(k1)  # k1 is least recently used, but named
    assert fill(k4) is not None and set(cache.entries) == {k1, k4}
    cache.add_user(k4)
    assert fill(k5) is None and set(cache.entries) == {k1, k4}  # everything is in use
    cache.remove_user(k1)
    assert fill(k5) is not None and set(cache.entries) == {k4, k5}
    # A filling entry is never evicted.
    pending = cache.start(k1, make_seq(0, list(k1), prefix=k1).prefix_filler())
    assert pending is not None and k5 not in cache.entries  # k5 was idle, k4 named
    cache.remove_user(k4)
    assert cache.evict_one() and not cache.evict_one()  # k4 goes; the filling k1 stays
    assert set(cache.entries) == {k1} and not cache.entries[k1].ready
    assert slots.num_free == 4 and blocks.num_free == 16
    cache.drop(k1)
    assert len(cache) == 0


# ---- aborts


def test_abort_frees_a_running_request_and_releases_a_waiting_ones_prefix():
    sched = make_scheduler(num_slots=2, max_num_seqs=1)
    a = make_seq(0, 6, max_tokens=10)
    b = make_seq(1, [*PREFIX, 1], prefix=PREFIX)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.prefixes.users == {PREFIX: 1} and b in sched.waiting
    sched.abort(b)
    assert sched.prefixes.users == {} and b not in sched.waiting
    sched.abort(a)
    assert not sched.running and a.slot is None and a.blocks == []
    assert sched.waiting == []
    assert_pools_empty(sched)


def test_aborting_a_prefix_filler_does_not_strand_its_requests():
    sched = make_scheduler()
    u = make_seq(0, [*PREFIX, 1, 2], prefix=PREFIX, max_tokens=2)
    sched.add(u)
    out = sched.schedule()
    (filler,) = [i.seq for i in out.scheduled]
    assert filler.compute_target == len(PREFIX) - 1
    for item in out.scheduled:  # what EngineCore.step does when the model raises
        sched.abort(item.seq)
    _, finished = run(sched, max_steps=50)
    assert finished == [u]


def test_a_prefix_filler_that_cannot_fit_is_abandoned_not_reported():
    # 4 blocks of 4; every prompt passes Engine's check (prompt + 1 positions fit the whole pool).
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1, max_num_batched_tokens=4)
    k1, k2 = tuple(range(100, 106)), tuple(range(200, 212))
    sched.add(make_seq(0, [*k1, 1], prefix=k1, max_tokens=1))
    run(sched)
    assert sched.prefixes.entries[k1].ready and sched.blocks.num_used == 2
    u2 = make_seq(1, [*k2, 1], prefix=k2, max_tokens=1, priority=0)
    sched.add(u2)
    step(sched)
    step(sched)  # the k2 filler starts: the only running sequence
    assert [s.compute_target for s in sched.running] == [len(k2) - 1] and u2 in sched.waiting
    u1 = make_seq(2, [*k1, 2], prefix=k1, max_tokens=1, priority=1)  # names k1, so k1 stays
    sched.add(u1)
    _, finished = run(sched, max_steps=50)
    assert set(finished) == {u1, u2}
