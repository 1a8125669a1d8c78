"""Presence and frequency penalties and logit bias, against a reference built from the engine's raw
log-probabilities one position at a time (penalties and bias shift logits, and so log-probs, equally)."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import Engine, SamplingParams

PROMPTS = ["The quick brown fox", "def main(argv):"]
STEPS = 16
BIAS = 12.0  # on one token: the random model then repeats it, and the penalties (at most 2) can stop it


def raw_logprobs(engine, ids: list[int], token: int) -> dict[int, float]:
    """The 20 most likely next tokens' raw log-probs, plus `token`'s (reported when it is the one chosen)."""
    top = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))[0].logprobs[0]
    forced = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, logit_bias={token: 100})
    return top | engine.generate([ids], forced)[0].logprobs[0]


def reference(engine, prompt: str, token: int, presence: float, frequency: float) -> list[int]:
    ids, out = engine.tokenizer.encode(prompt), []
    for _ in range(STEPS):
        counts = Counter(out)
        scores = {
            t: lp + BIAS * (t == token) - presence * (counts[t] > 0) - frequency * counts[t]
            for t, lp in raw_logprobs(engine, ids + out, token).items()
        }
        out.append(max(scores, key=scores.get))
    return out


def run(engine, prompt: str, token: int, presence: float, frequency: float) -> list[int]:
    params = SamplingParams(
        max_tokens=STEPS,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias={token: BIAS},
    )
    return engine.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 0.0), (1.5, 0.0), (0.0, 0.7), (0.5, 0.5)])
def test_penalties_and_bias_match_the_reference(demo_engine, presence, frequency):
    for prompt in PROMPTS:
        token = demo_engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
        got = run(demo_engine, prompt, token, presence, frequency)
        assert got == reference(demo_engine, prompt, token, presence, frequency)
        if presence or frequency:  # the bias alone repeats the token; the penalty must change that
            assert got != run(demo_engine, prompt, token, 0.0, 0.0)


def test_logit_bias_forces_and_bans(demo_engine):
    plain = demo_engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    banned = plain[0].token_ids[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={banned: -100})
    assert banned not in demo_engine.generate([PROMPTS[0]], params)[0].token_ids
    params = SamplingParams(max_tokens=4, temperature=0.9, seed=3, ignore_eos=True, logit_bias={77: 100})
    assert all(o.token_ids == [77] * 4 for o in demo_engine.generate(PROMPTS, params))


def test_penalised_requests_batch_like_alone(demo_dir):
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    with Engine.from_pretrained(demo_dir, device="cpu", dtype="float32") as e:
        batched = [o.token_ids for o in e.generate(PROMPTS, params)]
        alone = [e.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    assert batched == alone
