"""Adaptive speculation in the engine: each step's k chosen by the policy (ENCLAVE_SPECULATION=adaptive on the
CPU), greedy output still equal to plain decoding token for token, with batching, chunked prefill,
queueing and preemption, while k switches between 0 and more mid-run; and the MTP head's cache kept whole
at k = 0 steps, so that its later drafts equal those of a run that drafted every step."""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

from engine import SamplingParams
from engine.env import reset_engine_env
from engine.model.model import CausalLM
from tests.engine.test_serving import GREEDY, OracleDrafter, alone, engine, prompts_for, tokens


@pytest.fixture(scope="module")
def reference(mtp_dir):
    prompts = prompts_for(mtp_dir)
    return prompts, alone(mtp_dir, prompts)


@pytest.fixture
def adaptive(monkeypatch):
    monkeypatch.setenv("ENCLAVE_SPECULATION", "adaptive")
    reset_engine_env()


def chosen(e) -> dict[int, int]:
    return e.core.runner.policy.chosen


def test_the_mtp_head_adaptively_equals_plain_and_k_falls_to_0(adaptive, mtp_dir, reference):
    prompts, expected = reference
    with engine(mtp_dir) as e:
        assert e.adaptive_speculation and e.num_speculative_tokens == 3
        outs = e.generate(prompts, GREEDY)
        assert tokens(outs) == expected
        # A random head's drafts are wrong: the policy starts from its prior, then stops drafting.
        assert chosen(e).get(0, 0) > 0 and sum(n for k, n in chosen(e).items() if k) > 0, chosen(e)
        assert e.stats().draft_tokens > 0


@pytest.mark.parametrize("right", [0, 3])
def test_adaptive_k_follows_the_drafts_acceptance(adaptive, mtp_dir, right):
    prompts = prompts_for(mtp_dir, count=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = alone(mtp_dir, prompts, params)
    truth = {tuple(p): out for p, out in zip(prompts, expected, strict=True)}
    vocab = engine(mtp_dir).config.vocab_size
    with engine(mtp_dir, drafter=OracleDrafter(truth, right, vocab)) as e:
        assert tokens(e.generate(prompts, params)) == expected
        picks = chosen(e)
    if right:  # every draft kept: the most drafts nearly every step
        assert picks.get(3, 0) > sum(n for k, n in picks.items() if k != 3), picks
    else:  # every draft wrong: k = 0 after the first steps
        assert picks.get(0, 0) > sum(n for k, n in picks.items() if k), picks


class SwitchingDrafter(OracleDrafter):
    """Right while a request's output is shorter than `until`, wrong after: k rises, then falls to 0."""

    def __init__(self, truth, until: int, vocab: int) -> None:
        super().__init__(truth, 4, vocab)
        self.until = until

    def __call__(self, seq, count):
        self.right = 4 if len(seq.output_ids) < self.until else 0
        return super().__call__(seq, count)


def test_switching_k_with_chunking_queueing_and_preemption_equals_plain(adaptive, mtp_dir, reference):
    prompts, expected = reference
    truth = {tuple(p): out for p, out in zip(prompts, expected, strict=True)}
    vocab = engine(mtp_dir).config.vocab_size
    probe = engine(mtp_dir, num_speculative_tokens=3)
    budget = (4 + 12) * probe.plan.slot_bytes + 16 * (probe.plan.block_bytes // 2)
    options = dict(max_num_seqs=4, max_prefixes=0, kv_cache_memory=budget, block_size=8)
    drafter = SwitchingDrafter(truth, 7, vocab)
    with engine(mtp_dir, max_num_batched_tokens=16, drafter=drafter, **options) as e:
        outs = e.generate(prompts, GREEDY)
        assert tokens(outs) == expected
        assert e.stats().num_preemptions > 0
        picks = chosen(e)
        assert picks.get(0, 0) > 0 and max(picks) >= 2, picks
        kept = [n for o in outs for n in o.metrics.accepted_lengths]
        assert max(kept) >= 2 and 0 in kept


class Scripted:
    """Stands in for the policy: k from a fixed cycle, whatever the acceptance."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = itertools.cycle(ks)
        self.chosen: dict[int, int] = {}

    def observe(self, seq, offered, kept) -> None:
        pass

    def choose(self, seqs, context) -> int:
        return next(self.ks)


def head_drafts(e, prompt, params) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """The request's tokens, and the MTP head's drafts by the output length they were proposed at."""
    seen: dict[int, tuple[int, ...]] = {}
    set_drafts = e.core.scheduler.set_drafts

    def record(out, drafts):
        for item, proposed in zip(out.scheduled, drafts, strict=True):
            if proposed is not None:  # the values, read here, of drafts the runner keeps on the device
                values = proposed.ids if proposed.on_device is None else tuple(proposed.on_device.tolist())
                seen[len(item.seq.output_ids)] = values
        set_drafts(out, drafts)

    e.core.scheduler.set_drafts = record
    return e.generate([prompt], params)[0].token_ids, seen


def test_k0_steps_run_asynchronously_and_equal_plain(adaptive, mtp_dir, reference):
    prompts, expected = reference
    with engine(mtp_dir, async_scheduling=True, max_num_batched_tokens=16) as e:
        assert e.core.async_scheduling
        outs = e.generate(prompts, GREEDY)
        assert tokens(outs) == expected
        assert e.core.deferred_steps > 0 and e.stats().draft_tokens > 0  # both kinds of step ran
        assert chosen(e).get(0, 0) > 0


@pytest.mark.parametrize(
    ("fill", "asynchronous", "kv"),
    [(True, False, "auto"), (True, True, "auto"), (True, False, "fp8"), (False, False, "auto")],
)
def test_k0_steps_keep_the_heads_cache_whole(adaptive, mtp_dir, monkeypatch, fill, asynchronous, kv):
    prompt = prompts_for(mtp_dir, count=1, lengths=(21,))[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("ENCLAVE_SPECULATION", "fixed")
    reset_engine_env()
    # Prompt chunks: the head's K/V pair a chunk's end with the next. With an FP8 cache the K/V-only write
    # quantises as the attention's own write does, scales included.
    chunked = dict(max_num_batched_tokens=8, kv_cache_dtype=kv)
    with engine(mtp_dir, num_speculative_tokens=2, **chunked) as fixed:
        assert not fixed.adaptive_speculation
        plain_tokens, every_step = head_drafts(fixed, prompt, params)
    monkeypatch.setenv("ENCLAVE_SPECULATION", "adaptive")
    reset_engine_env()
    if not fill:  # the negative control: k = 0 steps leave holes in the head's cache
        monkeypatch.setattr(CausalLM, "mtp_store_kv", lambda *args: None)
    with engine(mtp_dir, num_speculative_tokens=2, async_scheduling=asynchronous, **chunked) as e:
        e.core.runner.policy = Scripted([2, 0, 0, 2, 0, 0, 0, 2])
        got_tokens, some_steps = head_drafts(e, prompt, params)
        assert (e.core.deferred_steps > 0) == asynchronous  # k = 0 steps' K/V queued on the device
    assert got_tokens == plain_tokens  # verification keeps outputs equal either way
    shared = sorted(set(every_step) & set(some_steps))
    assert len(shared) >= 5
    same = [some_steps[n] == every_step[n] for n in shared]
    if fill:
        assert all(same), (shared, same)
    else:
        assert not all(same)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafting_reads_no_draft_and_the_verify_step_reads_them_with_its_tokens(
    mtp_dir, reference, monkeypatch, temperature
):
    """The head's k drafts stay on the device from one draft step to the next and into the next step's input
    ids: drafting reads nothing (it read once per draft, then once per step), the verify step reads them
    with its tokens in one copy, and greedy outputs still equal plain ones."""
    prompts, expected = reference
    params = SamplingParams(max_tokens=14, temperature=temperature, seed=3, ignore_eos=True)
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted_in(counts: list[int]):
        def counted(self):
            # The runner's own reads (the CPU's reference kernels read routing on the host too).
            counts[-1] += sys._getframe(1).f_code.co_filename.endswith(os.path.join("engine", "runner.py"))
            return tolist(self)

        return counted

    counted = counted_in(reads)

    with engine(mtp_dir, num_speculative_tokens=3) as e:
        draft = e.core.runner.draft

        def drafting(launched, sampled):
            reads.append(0)
            monkeypatch.setattr(torch.Tensor, "tolist", counted)
            try:
                return draft(launched, sampled)
            finally:
                monkeypatch.setattr(torch.Tensor, "tolist", tolist)

        e.core.runner.draft = drafting
        sample = e.core.runner.sample
        sample_reads: list[int] = []

        def sampling(launched):
            sample_reads.append(0)
            monkeypatch.setattr(torch.Tensor, "tolist", counted_in(sample_reads))
            try:
                return sample(launched)
            finally:
                monkeypatch.setattr(torch.Tensor, "tolist", tolist)

        e.core.runner.sample = sampling
        outs = e.generate(prompts, params)
    if temperature == 0:
        assert tokens(outs) == expected
    assert e.stats().draft_tokens > 0
    assert reads and max(reads) == 0, reads
    assert sample_reads and max(sample_reads) == 1, sample_reads


def test_the_warm_up_leaves_the_policy_as_new(adaptive, mtp_dir, reference):
    prompts, expected = reference
    options = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=120)
    with engine(mtp_dir, warm_up=True, **options) as e:
        policy = e.core.runner.policy
        assert policy.chosen == {} and policy.idle_steps == 0  # the synthetic requests' choices forgotten
        assert tokens(e.generate(prompts, GREEDY)) == expected
        assert policy.chosen


def test_a_decoding_batch_past_the_verify_seqs_runs_at_k0_and_equals_plain(
    adaptive, mtp_dir, reference, monkeypatch
):
    """The scratch slots are sized for ADAPTIVE_MAX_SEQS verifying sequences: with more decoding, steps run at
    k = 0, with fewer they may draft; the output is plain decoding's either way."""
    from engine import spec_policy

    monkeypatch.setattr(spec_policy, "ADAPTIVE_MAX_SEQS", 2)
    prompts, expected = reference
    truth = {tuple(p): out for p, out in zip(prompts, expected, strict=True)}
    vocab = engine(mtp_dir).config.vocab_size
    with engine(mtp_dir, drafter=OracleDrafter(truth, 3, vocab)) as e:
        assert e.plan.num_scratch_slots == 2 * e.num_speculative_tokens
        assert e.core.runner.policy.max_seqs == 2
        assert tokens(e.generate(prompts, GREEDY)) == expected  # 8 decoding: every step at k = 0
        assert set(chosen(e)) == {0} and e.stats().draft_tokens == 0
        assert tokens(e.generate(prompts[:2], GREEDY)) == expected[:2]  # 2: they draft
        assert e.stats().draft_tokens > 0
