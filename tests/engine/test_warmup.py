"""The start-up warm-up (`engine.warmup`): which prefill sizes it runs, and that it leaves the engine as if it
had not run (free cache, zero counters, the same greedy tokens)."""

import pytest

from engine import Engine, SamplingParams, async_core
from engine.warmup import token_counts

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, *list(range(100, 180))], [7]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_token_counts_reach_every_power_of_two_and_tuned_count_with_both_divisibilities():
    counts = token_counts(8192, {1024, 4096, 16384, 96})
    for t in (1, 2, 16, 256, 1024, 4096, 8192, 96):
        assert t in counts and (t + 1 in counts or t == 8192)
    assert 16384 not in counts and max(counts) == 8192
    assert counts == sorted(set(counts))
    assert token_counts(1, set()) == [1]
    assert token_counts(20, {5}) == [1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 20]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_warm_engine_is_left_as_a_cold_one(demo_dir, asynchronous):
    # a context shorter than the step budget: the warm-up's larger steps batch several prompts
    options = dict(
        device="cpu", dtype="float32", max_num_batched_tokens=256, max_num_seqs=20, max_model_len=120
    )
    cold = Engine.from_pretrained(demo_dir, **options, async_scheduling=asynchronous)
    warm = Engine.from_pretrained(demo_dir, **options, async_scheduling=asynchronous, warm_up=True)
    core = warm.core
    assert core.steps == core.prompt_tokens == core.generated_tokens == 0 and core.busy_s == 0
    assert core.slots.num_free == core.slots.num_slots and core.blocks.num_used == 0
    assert not core.has_work() and core.scheduler.num_user_running == core.scheduler.num_user_waiting == 0
    expected = [o.token_ids for o in cold.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in warm.generate(PROMPTS, GREEDY)] == expected
    assert warm.stats().prompt_tokens == sum(len(p) for p in PROMPTS)
    cold.close()
    warm.close()


def test_warm_up_runs_where_graphs_are_captured_at_start_or_when_asked(demo_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(async_core, "warm_up", lambda core, *args: calls.append(core))
    options = dict(device="cpu", dtype="float32", max_num_seqs=4)
    Engine.from_pretrained(demo_dir, **options).close()  # no graphs on the cpu: off
    assert calls == []
    engine = Engine.from_pretrained(demo_dir, **options, warm_up=True)
    assert calls == [engine.core]
    engine.close()
