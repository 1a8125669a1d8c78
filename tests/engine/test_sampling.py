"""Sampling: parameter validation, seeded reproducibility, top-k/top-p support, stop conditions, logprobs."""

import pytest
import torch

from engine import RequestError, SamplingParams
from engine.sampler import batch_filtered_probs, draw_rows, filtered_probs, sample

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs, needle):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    k2 = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(k2).flatten().tolist()) == {1, 3}
    torch.testing.assert_close(k2[[1, 3]], torch.tensor([0.4, 0.3]) / 0.7)
    # top_p 0.6: 0.4 alone is short of it, 0.4 + 0.3 covers it -> {1, 3}; 0.75 needs 0.15 too.
    assert set(torch.nonzero(filtered_probs(logits, SamplingParams(top_p=0.6))).flatten().tolist()) == {1, 3}
    assert set(torch.nonzero(filtered_probs(logits, SamplingParams(top_p=0.75))).flatten().tolist()) == {
        1,
        3,
        4,
    }
    assert set(torch.nonzero(filtered_probs(logits, SamplingParams(top_p=0.01))).flatten().tolist()) == {1}
    both = filtered_probs(logits, SamplingParams(top_k=3, top_p=0.5))
    assert set(torch.nonzero(both).flatten().tolist()) == {1, 3}
    # temperature sharpens: T=0.5 squares the odds
    sharp = filtered_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(sharp, probs**2 / (probs**2).sum())


def test_batched_filter_matches_the_per_row_filter():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[2, :4] = logits[2, 4]  # ties with the k-th logit stay, as in filtered_probs
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=50, top_p=1.0),
    ]
    expected = torch.stack([filtered_probs(row, p) for row, p in zip(logits, params, strict=True)])
    torch.testing.assert_close(batch_filtered_probs(logits, params), expected)
    # Without any top-k/top-p the sort is skipped: plain softmax at each row's temperature.
    plain = [SamplingParams(temperature=t) for t in (0.5, 1.0, 3.0, 1.0, 1.0, 1.0)]
    rows = [filtered_probs(r, p) for r, p in zip(logits, plain, strict=True)]
    torch.testing.assert_close(batch_filtered_probs(logits, plain), torch.stack(rows))


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, top_k=8, seed=s) for s in range(4)]

    def gens():
        return [torch.Generator().manual_seed(100 + s) for s in range(4)]

    batched = draw_rows(logits, params, gens()).tolist()
    alone = [int(draw_rows(logits[i : i + 1], params[i : i + 1], gens()[i : i + 1])[0]) for i in range(4)]
    assert batched == alone
    kept = batch_filtered_probs(logits, params)
    assert all(kept[i, t] > 0 for i, t in enumerate(batched))


def test_sampled_frequencies_follow_the_filtered_distribution():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    gen = torch.Generator().manual_seed(1)
    n = 4000
    draws = [sample(probs.log()[None], [params], [gen]).token_ids[0] for _ in range(n)]
    counts = torch.bincount(torch.tensor(draws), minlength=5).float()
    assert counts[0] == 0 and counts[2] == 0
    expected = torch.tensor([0, 0.4, 0, 0.3, 0.15]) / 0.85 * n
    # 4 standard deviations of a binomial count
    assert ((counts - expected).abs() <= 4 * (expected * (1 - expected / n)).sqrt() + 1).all()


def test_seeded_requests_reproduce_alone_or_batched(demo_engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    batched = demo_engine.generate(PROMPTS, params)
    alone = demo_engine.generate([PROMPTS[1]], params)[0]
    again = demo_engine.generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in again]
    assert alone.token_ids == batched[1].token_ids
    other = demo_engine.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=1.0, seed=99))[0]
    assert other.token_ids != alone.token_ids


def test_engine_sampling_stays_inside_top_k(demo_engine):
    params = SamplingParams(max_tokens=30, temperature=1.5, top_k=3, seed=5, logprobs=5)
    for out in demo_engine.generate(PROMPTS, params):
        for token, top in zip(out.token_ids, out.logprobs, strict=True):
            ranked = sorted(top, key=top.get, reverse=True)
            assert token in ranked[:3]
    # a vanishing top_p keeps only the most likely token: sampling becomes greedy
    greedy = demo_engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    narrow = demo_engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=3))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in narrow]


def test_logprobs_hold_top_k_and_the_chosen_token(demo_engine):
    out = demo_engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=10, temperature=1.0, seed=2, logprobs=3)
    )[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, top in zip(out.token_ids, out.logprobs, strict=True):
        assert token in top and 3 <= len(top) <= 4
        assert all(v <= 0 for v in top.values())
    assert demo_engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0].logprobs is None


def test_stop_string_ends_generation_and_is_cut(demo_engine):
    free = demo_engine.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[
        0
    ]
    text = free.text
    assert free.finish_reason == "length" and len(text) > 12
    stop = text[8:11]
    out = demo_engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop, "\x00never"], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24


def test_stop_token_ids_end_generation(demo_engine):
    free = demo_engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[
        0
    ]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = demo_engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.text == demo_engine.tokenizer.decode(free.token_ids[:first])


def test_eos_ends_generation_unless_ignored(demo_engine):
    free = demo_engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[
        0
    ]
    # Make the fourth generated token an EOS id of this engine, and check it now stops there.
    eos = free.token_ids[3]
    engine = demo_engine
    saved = engine.eos_token_ids
    try:
        engine.eos_token_ids = frozenset({eos})
        out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0))[0]
        ignored = engine.generate(
            PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )[0]
    finally:
        engine.eos_token_ids = saved
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) <= 4
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 12


def test_max_tokens_gives_length(demo_engine):
    outs = demo_engine.generate(PROMPTS, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 7 for o in outs)
    assert [o.prompt_token_count for o in outs] == [len(p) for p in PROMPTS]
