"""Asynchronous scheduling: step N+1 is planned and launched before step N's tokens are read.

Forced on the CPU (`async_scheduling=True`), where it runs the same code as on CUDA: placeholders for the
unread tokens, their values fed device to device into the next step, stop checks when they are read, the
wasted step of a request that stopped. Whatever the batching, every output (tokens, text, finish and stop
reasons, log-probs) must equal the synchronous engine's, which test_serving ties to decoding alone.
"""

import random
import threading

import pytest
import torch

from engine import Engine, SamplingParams
from engine.sequence import PENDING
from tests.engine.factories import save_text_model

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def factory_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async-ckpt")
    save_text_model(path, seed=2)
    return path


@pytest.fixture(scope="module", params=["factory", "demo"])
def ckpt(request, factory_dir, demo_dir):
    return factory_dir if request.param == "factory" else demo_dir


def engine(path, asynchronous: bool, **options):
    return Engine.from_pretrained(
        path, device="cpu", dtype="float32", async_scheduling=asynchronous, **options
    )


def prompts_for(path, count=8, seed=0, lengths=(70, 1, 5, 33, 70, 12, 2, 48)):
    vocab = engine(path, False).config.vocab_size
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def summary(out):
    return (out.token_ids, out.text, out.finish_reason, out.stop_reason, out.logprobs)


def both(path, prompts, params, **options):
    """Outputs of the synchronous and the asynchronous engine, and how many steps the latter deferred."""
    with engine(path, False, **options) as e:
        sync = [summary(o) for o in e.generate(prompts, params)]
        assert e.core.deferred_steps == 0
        counts = (e.stats().prompt_tokens, e.stats().generated_tokens)
    with engine(path, True, **options) as e:
        asyn = [summary(o) for o in e.generate(prompts, params)]
        deferred = e.core.deferred_steps
        stats = e.stats()
        assert (stats.prompt_tokens, stats.generated_tokens) == counts  # discarded tokens not counted
        assert stats.num_running == stats.num_waiting == 0
        assert e.core.slots.num_free == e.core.slots.num_slots  # nothing leaked by the early-stopped
        assert e.core.blocks.num_free == e.core.blocks.num_blocks
    return sync, asyn, deferred


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 16}, {"max_num_seqs": 3}],
    ids=["batch", "chunked", "queued"],
)
def test_async_equals_sync(ckpt, options):
    sync, asyn, deferred = both(ckpt, prompts_for(ckpt), GREEDY, max_prefixes=0, **options)
    assert asyn == sync
    assert deferred > 0


def test_async_with_preemption(ckpt):
    prompts = prompts_for(ckpt)
    probe = engine(ckpt, False)
    budget = 4 * probe.plan.slot_bytes + 14 * (probe.plan.block_bytes // 2)
    options = dict(max_num_seqs=4, max_prefixes=0, kv_cache_memory=budget, block_size=8)
    with engine(ckpt, True, **options) as e:
        assert e.plan.num_blocks == 14
        asyn = e.generate(prompts, GREEDY)
        assert e.stats().num_preemptions > 0  # sequences with an unread token were preempted too
    with engine(ckpt, False, **options) as e:
        assert [summary(o) for o in asyn] == [summary(o) for o in e.generate(prompts, GREEDY)]


def test_stops_read_late_end_the_request_there(demo_dir):
    """A stop id or string met on a token read after the next step was launched: that step's token for the
    request is discarded, and max_tokens ends requests without a wasted step."""
    prompts = prompts_for(demo_dir, count=6)
    with engine(demo_dir, False) as e:
        plain = e.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stops = [o.token_ids[5 + i] for i, o in enumerate(plain)]  # a stop at a different place in each
    cases = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=stops),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["e", " a"]),
        SamplingParams(max_tokens=24, temperature=0),  # the tokenizer's EOS
    ]
    for params in cases:
        sync, asyn, _ = both(demo_dir, prompts, params)
        assert asyn == sync
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop_token_ids=stops, ignore_eos=True)
    sync, asyn, _ = both(demo_dir, prompts, sampled)
    assert asyn == sync
    sync, _, _ = both(demo_dir, prompts, cases[0])
    assert any(reason == "stop" for _, _, reason, _, _ in sync)  # the stops were met
    for max_tokens in (1, 2, 3, 7):
        sync, asyn, _ = both(demo_dir, prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        assert asyn == sync


def test_sampled_and_logprob_requests(demo_dir):
    """Seeded draws are the same (the step order and generators are), and requests asking for log-probs get
    the same reports with their steps deferred."""
    prompts = prompts_for(demo_dir, count=6)
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(6)
    ]
    params[2] = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=5, temperature=0.5, seed=4, logprobs=2, ignore_eos=True)
    sync, asyn, _ = both(demo_dir, prompts, params)
    assert asyn == sync
    assert sync[2][4] is not None and len(sync[2][4]) == 4
    # Every decode step defers, those with the log-prob requests included.
    with engine(demo_dir, True) as e:
        e.generate(prompts, params)
        assert e.core.deferred_steps >= e.core.steps - 2


def test_a_lone_request_outgrowing_the_cache(demo_dir):
    """The scheduler ends a lone request the cache cannot hold ("length"); with a token still unread, it
    waits for that token first, so the output is the synchronous one."""
    probe = engine(demo_dir, False)
    budget = probe.plan.slot_bytes + 4 * probe.plan.block_bytes
    options = dict(max_num_seqs=1, max_prefixes=0, kv_cache_memory=budget)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    sync, asyn, _ = both(demo_dir, [[3, 17, 29]], params, **options)
    assert asyn == sync
    assert sync[0][2] == "length" and len(sync[0][0]) < 200


def test_placeholders_never_reach_outputs(demo_dir):
    """500 requests from 8 threads, random lengths, limits, stops, sampled or greedy: every output complete
    and consistent, and every pool slot and block returned."""
    e = engine(demo_dir, True, max_num_seqs=16, max_num_batched_tokens=128)
    rng = random.Random(3)
    jobs = []
    for i in range(500):
        prompt = [rng.randrange(600) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 16),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            stop_token_ids=[rng.randrange(600) for _ in range(rng.randint(0, 3))],
            ignore_eos=i % 3 == 0,
        )
        jobs.append((prompt, params))
    results: list = [None] * len(jobs)

    def feed(worker: int) -> None:
        futures = [(i, e.submit(*jobs[i])) for i in range(worker, len(jobs), 8)]
        for i, f in futures:
            results[i] = f.result(timeout=600)

    threads = [threading.Thread(target=feed, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (_, params), out in zip(jobs, results, strict=True):
        assert PENDING not in out.token_ids
        assert 1 <= len(out.token_ids) <= params.max_tokens
        if out.finish_reason == "length":
            assert len(out.token_ids) == params.max_tokens
        else:
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(e.eos_token_ids))
            assert out.token_ids[-1] in stop_ids
            assert not any(t in stop_ids for t in out.token_ids[:-1])
    assert e.core.deferred_steps > 0
    assert not e.core.has_work()
    assert e.core.slots.num_free == e.core.slots.num_slots
    assert e.core.blocks.num_free == e.core.blocks.num_blocks
    e.close()


def test_speculation_stays_synchronous(demo_dir):
    with engine(demo_dir, True, num_speculative_tokens=2) as e:
        e.generate(prompts_for(demo_dir, count=2), GREEDY)
        assert not e.core.async_scheduling and e.core.deferred_steps == 0


def test_penalties_bias_and_grammars_are_deferred_and_equal_sync(demo_dir):
    """Requests whose logits follow their tokens (penalties, bias, a grammar) are deferred too: their next
    step samples only once the deferred tokens are read (the grammar advanced, the counts updated), so every
    output equals the synchronous engine's, constrained ones valid, and most of their steps deferred."""
    from engine.constraints import Constraint
    from tests.engine.test_constrained import CHOICES, PATTERN, RECORD, check

    prompts = prompts_for(demo_dir, count=8)
    constraints = [Constraint.json_schema(RECORD), Constraint.regex(PATTERN), Constraint.choice(CHOICES)]
    params = [SamplingParams(max_tokens=160, temperature=0.0, constraint=c) for c in constraints]
    params += [
        SamplingParams(max_tokens=160, temperature=0.9, seed=3, constraint=constraints[0]),
        SamplingParams(
            max_tokens=20, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True
        ),
        SamplingParams(max_tokens=20, temperature=0.8, seed=1, logit_bias={5: 3.0, 9: -100}, ignore_eos=True),
        GREEDY,
        SamplingParams(max_tokens=9, temperature=0.0, constraint=constraints[1]),
    ]
    sync, asyn, _ = both(demo_dir, prompts, params)
    assert asyn == sync
    for (_, text, reason, _, _), p in zip(asyn, params, strict=True):
        if p.constraint is not None and reason == "stop":
            check(p.constraint, text)
    assert sum(reason == "stop" for _, _, reason, _, _ in asyn[:4]) >= 3  # most grammars completed
    with engine(demo_dir, True) as e:
        e.generate(prompts, params)
        assert e.core.deferred_steps >= e.core.steps - 2  # all but the first prefill and the last


def test_a_grammar_after_its_reasoning_block_is_deferred_and_equal_sync(tmp_path):
    """A reasoning request's grammar starts at `</think>`, a token read late: the masks of the steps after it
    still follow it."""
    from engine.constraints import Constraint
    from tests.engine.test_reasoning import MESSAGES, SCHEMA
    from tests.qwen_like import write_qwen_like_model

    path = write_qwen_like_model(tmp_path)
    with engine(path, False) as e:
        think = e.think
        prompt = e.apply_chat_template(MESSAGES, enable_thinking=True)
    outs = {}
    for asynchronous in (False, True):
        with engine(path, asynchronous) as e:
            params = [
                SamplingParams(
                    max_tokens=40,
                    temperature=0.0,
                    split_reasoning=True,
                    constraint=Constraint.json_schema(SCHEMA),
                    logit_bias={think.end: bias},
                )
                for bias in (0.0, 6.0, 100.0)
            ]
            got = e.generate([prompt] * 3, params)
            outs[asynchronous] = [(o.token_ids, o.text, o.reasoning, o.finish_reason) for o in got]
            if asynchronous:
                assert e.core.deferred_steps > 0
    assert outs[True] == outs[False]
    assert any(o[2] is not None and o[3] == "stop" for o in outs[True])  # a block closed, then an answer


def test_host_phases_add_up_to_the_steps_host_time(demo_dir):
    """The asynchronous core times the host's parts of each step (benchmarks report them per step): every
    part is counted, none twice, so they sum to the steps' busy time; the counters reset with the others."""
    prompts = prompts_for(demo_dir, count=4)
    with engine(demo_dir, True) as e:
        e.generate(prompts, GREEDY)
        core = e.core
        phases = core.host_phases
        assert set(phases) == {"schedule", "launch", "read", "finish", "other"}
        assert all(v >= 0.0 for v in phases.values()) and phases["launch"] > 0.0 and phases["read"] > 0.0
        assert sum(phases.values()) == pytest.approx(core.busy_s, rel=0.05)
        core.reset_counters()
        assert sum(core.host_phases.values()) == 0.0
