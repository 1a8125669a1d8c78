"""The step loop's parts on their own: the runner returns tokens and never changes a sequence, the scheduler
appends them, `Launched` is a small frozen record, and `AsyncEngineCore` holds the deferred steps over the
synchronous `EngineCore` (whose outputs it must equal; test_async_scheduling checks that through `Engine`).
"""

import dataclasses

import pytest
import torch

from engine import Engine, SamplingParams
from engine.async_core import AsyncEngineCore, async_wanted, build_core
from engine.core import EngineCore, StepFailed
from engine.planner import plan_for
from engine.scheduler import NOTHING, Drafts, Sampled
from engine.sequence import PENDING, Sequence
from tests.engine.test_scheduler import make_scheduler, make_seq

CPU = torch.device("cpu")
MAX_LEN = 96


@pytest.fixture(scope="module")
def demo(demo_dir):
    with Engine.from_pretrained(demo_dir, device="cpu", dtype="float32", max_num_seqs=4) as e:
        yield e


def core(engine: Engine, **flat) -> EngineCore:
    """A fresh core over the engine's model: up to 4 sequences of MAX_LEN positions, no shared prefixes."""
    options = engine.options.with_flat(
        {"max_num_seqs": 4, "max_model_len": MAX_LEN, "max_prefixes": 0, **flat}
    )
    _, plan = plan_for(engine.config, engine.dtype, engine.device, options, max_model_len=MAX_LEN)
    return build_core(engine.model, plan, options)


def requests(prompts, max_tokens=6, **params) -> list[Sequence]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return [Sequence(i, list(p), sampling, None, set(), None, MAX_LEN, CPU) for i, p in enumerate(prompts)]


PROMPTS = [[3, 17, 29, 41, 5], [7, 8], [100, 200, 300], [11]]


def drain(c: EngineCore, seqs: list[Sequence], max_steps: int = 100) -> list[Sequence]:
    for seq in seqs:
        c.add(seq)
    finished = []
    while c.has_work():
        assert c.steps < max_steps, "the core did not drain"
        finished += c.step()
    return finished


def snapshot(seqs):
    return [(list(s.token_ids), list(s.output_ids), s.num_pending, s.finish_reason) for s in seqs]


# ---- which core


@pytest.mark.parametrize(
    ("flat", "device", "expected"),
    [
        ({}, "cpu", False),  # nothing runs beside the host on the CPU
        ({}, "cuda", True),
        ({"async_scheduling": True}, "cpu", True),
        ({"async_scheduling": False}, "cuda", False),
        ({"async_scheduling": True, "num_speculative_tokens": 2}, "cpu", False),  # drafting needs the tokens
    ],
)
def test_async_wanted_follows_the_option_then_the_device(demo, flat, device, expected):
    assert async_wanted(demo.options.with_flat(flat), torch.device(device)) is expected


def test_the_environment_switch_is_only_a_default(demo, monkeypatch):
    monkeypatch.setenv("ENCLAVE_ASYNC_SCHEDULING", "0")
    assert not async_wanted(demo.options.with_flat({"async_scheduling": None}), torch.device("cuda"))
    assert async_wanted(demo.options.with_flat({"async_scheduling": True}), torch.device("cuda"))


def test_build_core_picks_the_class(demo):
    assert type(core(demo, async_scheduling=True)) is AsyncEngineCore
    assert type(core(demo, async_scheduling=False)) is EngineCore
    assert type(core(demo)) is EngineCore  # auto, on the CPU
    assert AsyncEngineCore.async_scheduling and not EngineCore.async_scheduling


# ---- the runner returns, the scheduler applies


def test_the_runner_returns_tokens_and_changes_no_sequence(demo):
    c = core(demo, async_scheduling=False)
    seqs = requests(PROMPTS)
    for seq in seqs:
        c.add(seq)
    out = c.scheduler.schedule()
    before = snapshot(seqs)
    launched = c.runner.launch(out)
    sampled = c.runner.sample(launched)
    assert snapshot(seqs) == before
    assert len(sampled) == len(out.scheduled) == len(PROMPTS)
    assert all(len(s.tokens) == 1 and s.accepted == 0 and s.logprobs is None for s in sampled)
    assert c.scheduler.apply(out, sampled) == len(PROMPTS)
    assert [s.output_ids for s in seqs] == [list(s.tokens) for s in sampled]


def test_launched_is_a_frozen_record_with_rows_aligned_to_the_items(demo):
    c = core(demo, async_scheduling=False, max_num_batched_tokens=6)
    seqs = requests(PROMPTS)
    for seq in seqs:
        c.add(seq)
    out = c.scheduler.schedule()  # 5 + 1 tokens: the first prompt whole, a chunk of the second
    launched = c.runner.launch(out)
    assert [(i.num_new, i.samples) for i in launched.items] == [(5, True), (1, False)]
    assert launched.token_rows() == [0, None]
    assert launched.tokens.shape == (1,) and launched.mtp_input is None
    # 7: raw_logits, the log-probs of processed rows; 8, 9: next_k and filled, adaptive speculation's;
    # 10: drafted, the verified drafts' values still on the device
    assert len(dataclasses.fields(launched)) <= 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        launched.tokens = None
    assert c.runner.sample(launched)[1] is NOTHING
    assert c.runner.launch(type(out)()) is None  # nothing scheduled: nothing launched


def test_apply_runs_the_stop_checks_and_records_drafts_kept():
    sched = make_scheduler(k=2)
    a, b, c = make_seq(0, 3, max_tokens=2), make_seq(1, 3), make_seq(2, 70)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    assert [i.samples for i in out.scheduled] == [True, True, False]
    b.draft_ids = [5, 6]
    lps = ({9: -0.5}, {8: -1.0})
    got = [Sampled((9, 8, 7)), Sampled((4, 6), lps, accepted=1), NOTHING]
    # `a` ends at max_tokens after two of its three tokens; `c`, a prefill chunk, gets nothing.
    assert sched.apply(out, got) == 4
    assert a.output_ids == [9, 8] and a.finish_reason == "length"
    assert b.output_ids == [4, 6] and b.logprobs == list(lps) and b.draft_ids == []
    assert c.output_ids == [] and c.draft_ids == []
    sched.set_drafts(out, [None, Drafts((1, 2)), None])
    assert b.draft_ids == [1, 2] and b.draft_probs is None and a.draft_ids == []


def test_apply_records_acceptance_of_scheduled_drafts():
    sched = make_scheduler(k=2)
    seq = make_seq(0, 3, max_tokens=10)
    sched.add(seq)
    out = sched.schedule()
    sched.apply(out, [Sampled((4,))])
    sched.set_drafts(out, [Drafts((5, 6))])
    sched.update(out, [0])
    out = sched.schedule()
    assert out.scheduled[0].drafts == (5, 6)
    sched.apply(out, [Sampled((5, 7), accepted=1)])
    assert seq.metrics.accepted_lengths == [1] and seq.metrics.num_draft_tokens == 2
    assert seq.output_ids == [4, 5, 7]


# ---- the asynchronous core


def test_async_core_equals_the_synchronous_one(demo):
    sync = requests(PROMPTS, max_tokens=7)
    drain(core(demo, async_scheduling=False), sync)
    c = core(demo, async_scheduling=True)
    asyn = requests(PROMPTS, max_tokens=7)
    finished = drain(c, asyn)
    assert [s.output_ids for s in asyn] == [s.output_ids for s in sync]
    assert sorted(s.index for s in finished) == list(range(len(PROMPTS)))
    assert c.deferred_steps > 0 and c.generated_tokens == 7 * len(PROMPTS)
    assert c.slots.num_free == c.slots.num_slots and c.blocks.num_free == c.blocks.num_blocks


def test_a_deferred_step_leaves_one_placeholder_read_a_call_later(demo):
    c = core(demo, async_scheduling=True)
    seqs = requests(PROMPTS)
    for seq in seqs:
        c.add(seq)
    assert c.step() == []  # the prefill, deferred: its tokens stay on the device
    assert [s.output_ids for s in seqs] == [[PENDING]] * len(seqs) and c.has_work()
    assert c.generated_tokens == 0 and c.deferred_steps == 1
    c.step()  # the first decode launched with the placeholders as inputs, then the prefill's tokens read
    assert all(s.output_ids[0] != PENDING and s.output_ids[1:] == [PENDING] for s in seqs)
    assert c.generated_tokens == len(seqs)


def test_logprob_requests_are_deferred_and_read_with_their_tokens(demo):
    """Log-probs are worked out on the device when a step is deferred and read with its tokens: the steps
    defer, and each token's report equals the synchronous core's."""
    c = core(demo, async_scheduling=True)
    seqs = requests(PROMPTS, logprobs=2)
    drain(c, seqs)
    plain = requests(PROMPTS, logprobs=2)
    drain(core(demo, async_scheduling=False), plain)
    assert c.deferred_steps > 0 and all(len(s.logprobs) == 6 for s in seqs)
    for got, want in zip(seqs, plain, strict=True):
        assert got.output_ids == want.output_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.keys() == b.keys() and len(a) >= 2
            assert all(abs(a[t] - b[t]) < 1e-6 for t in a)


def test_a_failed_read_fails_the_step_launched_on_its_tokens(demo, monkeypatch):
    c = core(demo, async_scheduling=True)
    seqs = requests(PROMPTS)
    for seq in seqs:
        c.add(seq)
    c.step()

    def broken(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(c.runner, "read", broken)
    with pytest.raises(StepFailed) as info:
        c.step()
    assert info.value.seqs == seqs  # each once, though in both steps
    assert str(info.value.cause) == "device lost"
    assert not c.scheduler.has_work() and not c.has_work()
    assert c.slots.num_free == c.slots.num_slots and c.blocks.num_free == c.blocks.num_blocks
