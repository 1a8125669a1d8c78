"""Sampled speculation keeps the target distribution, end to end through the engine: many seeded requests'
first three tokens against the distribution the reference model's logits give them (softmax at temperature
1, top-3), by a chi-square test, without speculation, with the MTP head and with a fixed drafter.

The first token comes from the prefill; the second and third are the two drafts a verify step checks (with
max_tokens 4, two drafts are offered), so both acceptance and the residual draw at both draft positions
shape the joint distribution of (t1, t2, t3). The threshold is the upper 0.001 quantile (a correct engine
fails it for about 1 seed in 1000; the seeds are fixed, so the test is deterministic), and a negative
control shows it rejects a sampler with the classic bug (the residual drawn from p instead of max(0, p - q)).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import engine.runner
from engine import Engine, SamplingParams, spec_policy
from engine.env import reset_engine_env
from tests.engine.factories import add_mtp, save_text_model

TOP_K = 3
DRAWS = 600
PROMPT = [11, 52, 7, 90, 33]
CELLS = list(itertools.product(range(TOP_K), repeat=3))  # ranks of (t1, t2, t3) under the target


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (3.0902: 0.001), by Wilson-Hilferty (within
    about 1% for df >= 3; scipy is not installed)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, and the reference's top-3 distribution at each context the three tokens meet."""
    path = tmp_path_factory.mktemp("mtp-sampling")
    reference = save_text_model(path, seed=2)
    add_mtp(path, seed=9)
    top: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    @torch.no_grad()
    def expand(generated: tuple[int, ...]) -> None:
        logits = reference(input_ids=torch.tensor([PROMPT + list(generated)])).logits[0, -1].double()
        values, ids = logits.topk(TOP_K)
        top[generated] = (ids.tolist(), torch.softmax(values, -1))
        if len(generated) < 2:
            for t in ids.tolist():
                expand((*generated, t))

    expand(())
    return path, top


def cell_probs(top) -> dict[tuple[int, int, int], float]:
    """The target probability of each (t1, t2, t3) by ranks."""
    out = {}
    for r1, r2, r3 in CELLS:
        ids1, p1 = top[()]
        ids2, p2 = top[(ids1[r1],)]
        _, p3 = top[(ids1[r1], ids2[r2])]
        out[(r1, r2, r3)] = float(p1[r1] * p2[r2] * p3[r3])
    return out


def chi_square(outputs: list[list[int]], top) -> tuple[float, int]:
    """Pearson's statistic of the draws' (t1, t2, t3) ranks against the target, cells expecting fewer than 5
    pooled; a token outside the target's top-3 fails at once."""
    probs = cell_probs(top)
    counts = dict.fromkeys(CELLS, 0)
    for tokens in outputs:
        t1, t2, t3 = tokens[:3]
        ids1 = top[()][0]
        ids2 = top[(t1,)][0] if t1 in ids1 else []
        ids3 = top[(t1, t2)][0] if t2 in ids2 else []
        assert t1 in ids1 and t2 in ids2 and t3 in ids3, f"{tokens} leaves the target's support"
        counts[(ids1.index(t1), ids2.index(t2), ids3.index(t3))] += 1
    big = [c for c in CELLS if DRAWS * probs[c] >= 5]
    small = [c for c in CELLS if c not in big]
    observed = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    expected = [DRAWS * probs[c] for c in big] + ([DRAWS * sum(probs[c] for c in small)] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    return stat, len(observed) - 1


class RankDrafter:
    """A fixed drafter (q a point mass): the target's first choice for t2, then its second for t3, so that
    drafts are kept often and rejected often at both positions."""

    def __init__(self, top) -> None:
        self.top = top

    def __call__(self, seq, count):
        out = tuple(seq.output_ids)
        if len(out) != 1 or out not in self.top:
            return [0] * count
        first = self.top[out][0][0]
        return [first, self.top[(*out, first)][0][1]][:count]


def draws(path, **options) -> list[list[int]]:
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, top_k=TOP_K, seed=i, ignore_eos=True)
        for i in range(DRAWS)
    ]
    with Engine.from_pretrained(path, device="cpu", dtype="float32", max_num_seqs=128, **options) as e:
        futures = [e.submit(PROMPT, p) for p in params]
        outs = [f.result() for f in futures]
        stats = e.stats()
        if options.get("num_speculative_tokens"):  # drafts both kept and rejected
            print(f"drafts {stats.draft_tokens}, kept {stats.accepted_tokens}")
            assert 0 < stats.accepted_tokens < stats.draft_tokens
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "how", ["plain", "mtp head", "mtp head, 64 of 96 tokens", "fixed drafter", "adaptive fixed drafter"]
)
def test_sampled_tokens_follow_the_target_distribution(setup, how, monkeypatch):
    path, top = setup
    options = {}
    if how != "plain":
        options["num_speculative_tokens"] = 2
    if how.endswith("of 96 tokens"):  # a limited draft vocabulary: q is 0 past token 63, p is not
        options["draft_vocab"] = 64
    if how.endswith("fixed drafter"):
        options["drafter"] = RankDrafter(top)
    if how.startswith("adaptive"):  # each step's k chosen (1 or 2 here: the drafts are often right)
        monkeypatch.setenv("ENCLAVE_SPECULATION", "adaptive")
        # All 128 decoding requests may verify drafts (the default verifies for ADAPTIVE_MAX_SEQS at most).
        monkeypatch.setattr(spec_policy, "ADAPTIVE_MAX_SEQS", 128)
        reset_engine_env()
    stat, df = chi_square(draws(path, **options), top)
    print(f"{how}: chi2 {stat:.1f}, df {df}, critical {chi_square_critical(df):.1f}")
    assert stat < chi_square_critical(df), (stat, df)


def test_a_sampler_drawing_the_residual_from_p_fails_the_test(setup, monkeypatch):
    path, top = setup

    monkeypatch.setattr(engine.runner, "accept_sampled", _residual_from_p)
    stat, df = chi_square(draws(path, num_speculative_tokens=2, drafter=RankDrafter(top)), top)
    print(f"broken: chi2 {stat:.1f}, df {df}, critical {chi_square_critical(df):.1f}")
    assert stat > chi_square_critical(df), (stat, df)


def _residual_from_p(target_probs, draft_probs, drafts, generator):
    """accept_sampled with the bug: on rejection, a token drawn from p (the draft may come back)."""
    emitted = []
    for j, token in enumerate(drafts):
        p, q = target_probs[j, token], draft_probs[j, token]
        if torch.rand((), generator=generator) * q < p:
            emitted.append(token)
            continue
        emitted.append(int(torch.multinomial(target_probs[j], 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return emitted
