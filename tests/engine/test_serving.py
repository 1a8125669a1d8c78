"""The serving core's invariants, greedy and token for token, on tiny real-layout checkpoints with MTP heads.

Whatever the batching, chunking, queueing, preemption, prefix sharing or speculation, each request's tokens
equal the ones plain decoding gives it alone (which test_parity ties to transformers).
"""

import random
import threading
import time

import pytest
import torch

from engine import Engine, EngineError, SamplingParams
from tests.engine.factories import save_text_model

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["factory", "demo"])
def ckpt(request, mtp_dir, demo_dir):
    return mtp_dir if request.param == "factory" else demo_dir


def prompts_for(path, count=8, seed=0, lengths=(70, 1, 5, 33, 70, 12, 2, 48)):
    vocab = Engine.from_pretrained(path, device="cpu", dtype="float32").config.vocab_size
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def engine(path, **options):
    return Engine.from_pretrained(path, device="cpu", dtype="float32", **options)


def alone(path, prompts, params=GREEDY):
    e = engine(path)
    outs = [e.generate([p], params)[0].token_ids for p in prompts]
    e.close()
    return outs


def tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(ckpt):
    prompts = prompts_for(ckpt)
    return prompts, alone(ckpt, prompts)


def test_batch_equals_alone(ckpt, reference):
    prompts, expected = reference
    with engine(ckpt) as e:
        assert tokens(e.generate(prompts, GREEDY)) == expected


def test_chunked_prefill_equals_whole(ckpt, reference):
    prompts, expected = reference
    with engine(ckpt, max_num_batched_tokens=16) as e:
        assert tokens(e.generate(prompts, GREEDY)) == expected
        assert e.stats().steps > 70 // 16


def test_queueing_equals_unlimited(ckpt, reference):
    prompts, expected = reference
    with engine(ckpt, max_num_seqs=3) as e:
        assert tokens(e.generate(prompts, GREEDY)) == expected


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_equals_plain(ckpt, reference, k):
    prompts, expected = reference
    with engine(ckpt, num_speculative_tokens=k) as e:
        outs = e.generate(prompts, GREEDY)
        assert tokens(outs) == expected
        stats = e.stats()
        assert stats.draft_tokens > 0  # the MTP head really drafted and the drafts were verified
        assert sum(o.metrics.num_draft_tokens for o in outs) == stats.draft_tokens


def test_speculative_reading_the_raw_hidden_state_equals_plain(ckpt, reference):
    prompts, expected = reference
    with engine(ckpt, num_speculative_tokens=2, mtp_hidden="raw") as e:
        assert tokens(e.generate(prompts, GREEDY)) == expected
    with pytest.raises(EngineError, match="mtp_hidden"):
        engine(ckpt, mtp_hidden="sideways")


def test_speculative_with_chunking_and_queueing(ckpt, reference):
    prompts, expected = reference
    with engine(ckpt, num_speculative_tokens=2, max_num_batched_tokens=16, max_num_seqs=3) as e:
        assert tokens(e.generate(prompts, GREEDY)) == expected


def test_preempted_requests_equal_uninterrupted(ckpt, reference):
    prompts, expected = reference
    # Room for about two sequences' worth of blocks: running ones must be preempted and recomputed.
    probe = engine(ckpt)
    per_block = probe.plan.block_bytes // 2  # blocks of 8 positions instead of 16
    budget = 4 * probe.plan.slot_bytes + 14 * per_block
    with engine(ckpt, max_num_seqs=4, max_prefixes=0, kv_cache_memory=budget, block_size=8) as e:
        assert e.plan.num_blocks == 14
        outs = e.generate(prompts, GREEDY)
        assert tokens(outs) == expected
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        assert e.stats().num_preemptions > 0


def test_speculative_preemption(ckpt, reference):
    prompts, expected = reference
    probe = engine(ckpt, num_speculative_tokens=2)
    budget = (4 + 8) * probe.plan.slot_bytes + 16 * (probe.plan.block_bytes // 2)
    options = dict(max_num_seqs=4, max_prefixes=0, kv_cache_memory=budget, block_size=8)
    with engine(ckpt, num_speculative_tokens=2, **options) as e:
        assert e.plan.num_blocks == 16
        outs = e.generate(prompts, GREEDY)
        assert tokens(outs) == expected
        assert e.stats().num_preemptions > 0


@pytest.mark.parametrize("k", [0, 2])
def test_shared_prefix_equals_no_prefix(ckpt, k):
    vocab = engine(ckpt).config.vocab_size
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, vocab, (37,), generator=g).tolist()
    rests = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 9, 20, 3, 16)]
    prompts = [prefix + r for r in rests] + [prefix]  # the prompt may also be exactly the prefix
    expected = alone(ckpt, prompts)
    with engine(ckpt, num_speculative_tokens=k, max_num_seqs=3) as e:
        futures = [e.submit(p, GREEDY, prefix=prefix) for p in prompts]
        outs = [f.result() for f in futures]
        assert tokens(outs) == expected
        cached = [o.metrics.cached_prefix_tokens for o in outs]
        assert all(c == len(prefix) - 1 for c in cached)  # every request started from the cached prefix
        assert e.stats().prefix_entries == 1
        # A second wave reuses the entry; computed prompt tokens are then only the per-request rest.
        before = e.stats().prompt_tokens
        assert tokens(f.result() for f in [e.submit(p, GREEDY, prefix=prefix) for p in prompts]) == expected
        assert e.stats().prompt_tokens - before == sum(len(r) + 1 for r in rests) + 1


def test_prefix_that_is_not_a_token_prefix_is_ignored(demo_dir):
    with engine(demo_dir) as e:
        out = e.submit([5, 6, 7, 8], GREEDY, prefix=[5, 6, 9]).result()
        assert out.metrics.cached_prefix_tokens == 0
        assert out.token_ids == e.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids


class OracleDrafter:
    """Drafts the true greedy continuation for the first `right` positions of each round, then wrong ids."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], right: int, vocab: int) -> None:
        self.truth, self.right, self.vocab = truth, right, vocab

    def __call__(self, seq, count):
        future = self.truth[tuple(seq.prompt_ids)][len(seq.output_ids) :]
        drafts = []
        for j in range(count):
            true = future[j] if j < len(future) else 0
            drafts.append(true if j < self.right else (true + 1) % self.vocab)
        return drafts


@pytest.mark.parametrize(("k", "right"), [(3, 3), (3, 0), (3, 1), (4, 2), (2, 5)])
def test_acceptance_full_zero_partial(mtp_dir, k, right):
    prompts = prompts_for(mtp_dir, count=4)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = alone(mtp_dir, prompts, params)
    truth = {tuple(p): out for p, out in zip(prompts, expected, strict=True)}
    vocab = engine(mtp_dir).config.vocab_size
    e = engine(mtp_dir, num_speculative_tokens=k, drafter=OracleDrafter(truth, right, vocab))
    outs = e.generate(prompts, params)
    assert tokens(outs) == expected
    for out in outs:
        lengths = out.metrics.accepted_lengths
        assert lengths, "no verify step ran"
        # Every verify step keeps exactly min(right, drafts offered) drafts: all but possibly the last
        # (fewer drafts are offered near max_tokens) keep min(right, k).
        assert all(n == min(right, k) for n in lengths[:-1]), lengths
        assert len(out.token_ids) == 20
    if right >= k:  # full acceptance: k + 1 tokens per step
        assert max(len(o.metrics.accepted_lengths) for o in outs) <= -(-19 // (k + 1)) + 1


def test_stops_and_max_tokens_inside_an_accepted_run(demo_dir):
    prompt = [3, 17, 29, 41, 5]
    plain = engine(demo_dir).generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    truth = {tuple(prompt): plain.token_ids}
    drafter = OracleDrafter(truth, 4, 600)
    spec = engine(demo_dir, num_speculative_tokens=4, drafter=drafter)
    for max_tokens in (1, 2, 5, 7, 11):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        out = spec.generate([prompt], params)[0]
        assert out.token_ids == plain.token_ids[:max_tokens] and out.finish_reason == "length"
    # A stop id met in the middle of a fully accepted run ends there, the stop token kept (as vLLM).
    stop_at = next(i for i in range(6, 24) if plain.token_ids[i] not in plain.token_ids[:i])
    params = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[plain.token_ids[stop_at]]
    )
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids[: stop_at + 1] and out.finish_reason == "stop"
    # A stop string completed inside an accepted run: text is cut at it, like plain decoding.
    stop_text = spec.tokenizer.decode(plain.token_ids[stop_at - 1 : stop_at + 1])
    if stop_text.strip():
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop_text])
        plain_stop = engine(demo_dir).generate([prompt], params)[0]
        spec_stop = spec.generate([prompt], params)[0]
        assert (spec_stop.token_ids, spec_stop.text) == (plain_stop.token_ids, plain_stop.text)
        assert spec_stop.finish_reason == "stop"


def test_sampled_speculation_runs_and_reproduces(demo_dir):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
    prompts = prompts_for(demo_dir, count=4)
    with engine(demo_dir, num_speculative_tokens=3) as e:
        first = tokens(e.generate(prompts, params))
        assert tokens(e.generate(prompts, params)) == first  # seeded: same draws, same verdicts
        assert all(len(t) == 16 for t in first)
        assert e.stats().draft_tokens > 0


def test_speculation_needs_an_mtp_head(tmp_path):
    save_text_model(tmp_path, seed=2)
    with pytest.raises(EngineError, match="MTP head"):
        engine(tmp_path, num_speculative_tokens=2)
    with pytest.raises(EngineError, match="num_speculative_tokens"):
        engine(tmp_path, num_speculative_tokens=9)


def test_stress_many_threads(demo_dir):
    """500 requests from 16 threads with random lengths, limits, stops and arrival times."""
    e = engine(demo_dir, max_num_seqs=24, max_num_batched_tokens=256, num_speculative_tokens=2)
    pool_ptrs = [t.data_ptr() for t in e.core.cache.tensors()]
    rng = random.Random(7)
    vocab = 600
    prefix = [rng.randrange(vocab) for _ in range(20)]
    jobs = []
    for i in range(500):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        use_prefix = i % 5 == 0
        if use_prefix:
            prompt = prefix + prompt
        stops = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            stop_token_ids=stops,
            stop=["zq"] if i % 7 == 0 else None,
            ignore_eos=i % 3 == 0,
        )
        jobs.append((prompt, params, prefix if use_prefix else None, rng.random() * 0.01))
    results: list = [None] * len(jobs)
    errors: list = []

    def feed(worker: int) -> None:
        try:
            futures = []
            for index in range(worker, len(jobs), 16):
                prompt, params, pre, delay = jobs[index]
                time.sleep(delay)
                futures.append((index, e.submit(prompt, params, prefix=pre, priority=index % 3)))
            for index, f in futures:
                results[index] = f.result(timeout=600)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    eos = e.eos_token_ids
    for (prompt, params, _, _), out in zip(jobs, results, strict=True):
        assert out.prompt_token_ids == prompt
        n = len(out.token_ids)
        assert 1 <= n <= params.max_tokens
        if out.finish_reason == "length":
            assert n == params.max_tokens
        else:
            last = out.token_ids[-1]
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
            assert last in stop_ids or (out.text is not None and params.stop_strings)
            assert not any(t in stop_ids for t in out.token_ids[:-1])
    stats = e.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.prefix_entries == 1
    # Only the prefix entry holds anything; evicting it empties both pools.
    assert stats.slots_used == 1
    assert e.core.scheduler.prefixes.evict_one()
    assert e.core.slots.num_free == e.core.slots.num_slots
    assert e.core.blocks.num_free == e.core.blocks.num_blocks
    # The pools were sized once by the planner and never grew.
    assert [t.data_ptr() for t in e.core.cache.tensors()] == pool_ptrs
    assert e.core.cache.nbytes == e.plan.nbytes <= e.plan.budget_bytes
    e.close()


def test_submit_validates_at_once_and_close_fails_pending(demo_dir):
    e = engine(demo_dir)
    with pytest.raises(Exception, match="outside the vocabulary"):
        e.submit([10_000], GREEDY)
    with pytest.raises(Exception, match="priority"):
        e.submit([1, 2], GREEDY, priority="high")
    out = e.submit([1, 2, 3], GREEDY).result()
    assert out.metrics.time_to_first_token is not None and out.metrics.generated_tokens == 14
    e.close()
    with pytest.raises(EngineError, match="closed"):
        e.submit([1], GREEDY)
