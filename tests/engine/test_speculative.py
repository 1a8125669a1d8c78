"""Speculative decoding: greedy draft acceptance, and rejection sampling that keeps every emitted token ~ p.

The statistical tests use a fixed seed, so they are deterministic; the chi-square thresholds are the upper
0.001 quantiles, so a correct implementation would fail them for only about 1 seed in 1000. The negative
controls show the same check rejects samples that are not distributed as p (the test has power).
"""

import pytest
import torch

from engine.speculative import accept_greedy, accept_sampled

# Upper 0.001 quantiles of the chi-square distribution, by degrees of freedom (scipy is not installed).
CHI2_CRITICAL_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}

# V = 6. Position 0: token 5 has q > 0 but p = 0; token 2 has p > 0 but q = 0. Acceptance rate 0.55.
P0 = [0.30, 0.25, 0.20, 0.15, 0.10, 0.00]
Q0 = [0.05, 0.40, 0.00, 0.25, 0.10, 0.20]
# Position 1: token 0 has q > 0 but p = 0; token 3 has p > 0 but q = 0. Acceptance rate 0.60.
P1 = [0.00, 0.10, 0.40, 0.10, 0.25, 0.15]
Q1 = [0.30, 0.10, 0.10, 0.00, 0.30, 0.20]
# Bonus position (after both drafts are kept).
P2 = [0.10, 0.05, 0.15, 0.20, 0.20, 0.30]


# ---------------------------------------------------------------------------------------------- helpers


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab).double()


def _chi_square(counts: torch.Tensor, probs: list[float]) -> tuple[float, int]:
    """Pearson statistic over the cells where probs > 0; degrees of freedom = support size - 1."""
    expected_p = torch.tensor(probs, dtype=torch.float64)
    support = expected_p > 0
    expected = counts.sum() * expected_p[support]
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    return stat, int(support.sum()) - 1


def _assert_distributed_as(tokens: list[int], probs: list[float]) -> None:
    counts = _counts(tokens, len(probs))
    outside = [t for t, p in enumerate(probs) if p == 0 and counts[t] > 0]
    assert not outside, f"tokens with zero target probability were emitted: {outside}"
    stat, df = _chi_square(counts, probs)
    assert stat < CHI2_CRITICAL_0001[df], (
        f"chi2={stat:.2f} >= {CHI2_CRITICAL_0001[df]} (df={df}, n={int(counts.sum())})"
    )


def _run(p_rows: list[list[float]], q_rows: list[list[float]], trials: int, seed: int):
    """Draws drafts x_j ~ q_j independently, then calls accept_sampled once per trial.

    Returns (drafts [trials, d], emitted lists).
    """
    generator = torch.Generator().manual_seed(seed)
    target = torch.tensor(p_rows, dtype=torch.float32)
    draft = torch.tensor(q_rows, dtype=torch.float32)
    drafts = torch.multinomial(draft, trials, replacement=True, generator=generator).T.tolist()
    emitted = [accept_sampled(target, draft, row, generator) for row in drafts]
    return drafts, emitted


def _accepted_rate_tolerance(rate: float, n: int, sigmas: float = 4.0) -> float:
    return sigmas * (rate * (1 - rate) / n) ** 0.5


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_full_acceptance_emits_every_draft_and_the_bonus():
    assert accept_greedy([7, 3, 9, 4], [7, 3, 9]) == [7, 3, 9, 4]


def test_greedy_zero_acceptance_emits_only_the_target_at_the_first_position():
    assert accept_greedy([5, 3, 9, 4], [7, 3, 9]) == [5]


def test_greedy_partial_acceptance_stops_at_the_first_mismatch():
    # Draft 2 mismatches; draft 3 matches its target but comes after the mismatch, so it is not kept.
    assert accept_greedy([7, 3, 8, 4, 1], [7, 3, 9, 4]) == [7, 3, 8]


def test_greedy_without_drafts_emits_the_single_target():
    assert accept_greedy([6], []) == [6]


# -------------------------------------------------------------------------------------------- sampled


def test_sampled_tokens_are_distributed_as_the_target():
    trials = 30_000
    drafts, emitted = _run([P0, P1, P2], [Q0, Q1], trials, seed=1234)

    assert all(1 <= len(out) <= 3 for out in emitted)
    # Every kept draft is the draft itself; a rejection ends the list.
    for row, out in zip(drafts, emitted, strict=True):
        assert out[: len(out) - 1] == row[: len(out) - 1]

    # Position 0: every trial emits one token ~ p_0 (df = 5 - 1 = 4).
    _assert_distributed_as([out[0] for out in emitted], P0)

    # The first draft's acceptance rate is sum_x min(p_0(x), q_0(x)) = 0.55.
    rate0 = sum(min(p, q) for p, q in zip(P0, Q0, strict=True))
    accepted0 = sum(len(out) >= 2 for out in emitted)
    assert abs(accepted0 / trials - rate0) < _accepted_rate_tolerance(rate0, trials)

    # Position 1, emitted whenever draft 0 was kept: ~ p_1 (df = 5 - 1 = 4); acceptance rate 0.60.
    second = [out[1] for out in emitted if len(out) >= 2]
    assert len(second) == accepted0
    _assert_distributed_as(second, P1)
    rate1 = sum(min(p, q) for p, q in zip(P1, Q1, strict=True))
    accepted1 = sum(len(out) == 3 for out in emitted)
    assert abs(accepted1 / accepted0 - rate1) < _accepted_rate_tolerance(rate1, accepted0)

    # The bonus token after both drafts were kept: ~ p_2 (df = 6 - 1 = 5).
    _assert_distributed_as([out[2] for out in emitted if len(out) == 3], P2)


def test_negative_control_always_accepting_the_draft_is_detected():
    """Tokens drawn from q_0 (every draft kept) must fail the same chi-square check against p_0."""
    generator = torch.Generator().manual_seed(1234)
    naive = torch.multinomial(torch.tensor(Q0), 30_000, replacement=True, generator=generator).tolist()
    stat, df = _chi_square(_counts(naive, len(P0)), P0)
    assert df == 4
    assert stat > CHI2_CRITICAL_0001[df]
    with pytest.raises(AssertionError):
        _assert_distributed_as(naive, P0)


def test_negative_control_resampling_from_p_instead_of_the_residual_is_detected():
    """A subtler, realistic bug: on rejection, draw from p rather than max(0, p - q). The check catches it."""
    generator = torch.Generator().manual_seed(1234)
    target, draft = torch.tensor(P0), torch.tensor(Q0)
    tokens = []
    for x in torch.multinomial(draft, 30_000, replacement=True, generator=generator).tolist():
        u = float(torch.rand((), generator=generator))
        if u * float(draft[x]) < float(target[x]):
            tokens.append(x)
        else:
            tokens.append(int(torch.multinomial(target, 1, generator=generator)))
    stat, df = _chi_square(_counts(tokens, len(P0)), P0)
    assert stat > CHI2_CRITICAL_0001[df]


def test_draft_equal_to_target_is_always_accepted():
    trials = 5_000
    drafts, emitted = _run([P0, P1, P2], [P0, P1], trials, seed=99)
    assert all(out[:2] == row for row, out in zip(drafts, emitted, strict=True))
    assert all(len(out) == 3 for out in emitted)
    _assert_distributed_as([out[0] for out in emitted], P0)
    _assert_distributed_as([out[2] for out in emitted], P2)


def test_zero_residual_falls_back_to_the_target():
    """p == q and a draft outside the support (q = 0): rejected, residual is all zero, must sample from p."""
    generator = torch.Generator().manual_seed(7)
    target = torch.tensor([P0, P2])
    tokens = []
    for _ in range(10_000):
        out = accept_sampled(target, target[:1].clone(), [5], generator)  # P0[5] == 0
        assert len(out) == 1
        tokens.append(out[0])
    _assert_distributed_as(tokens, P0)


@pytest.mark.parametrize(
    ("point", "expected_rate"),
    [(1, 0.25), (5, 0.0)],  # a token p_0 likes, and one p_0 gives zero probability
)
def test_point_mass_draft_still_emits_tokens_distributed_as_the_target(point, expected_rate):
    trials = 12_000
    one_hot = [1.0 if t == point else 0.0 for t in range(len(P0))]
    drafts, emitted = _run([P0, P2], [one_hot], trials, seed=2024 + point)
    assert all(row == [point] for row in drafts)
    _assert_distributed_as([out[0] for out in emitted], P0)
    accepted = sum(len(out) == 2 for out in emitted)
    if expected_rate == 0.0:
        assert accepted == 0
    else:
        assert abs(accepted / trials - expected_rate) < _accepted_rate_tolerance(expected_rate, trials)


def test_no_drafts_samples_the_bonus_from_the_target():
    generator = torch.Generator().manual_seed(3)
    target, draft = torch.tensor([P1]), torch.empty(0, len(P1))
    tokens = [accept_sampled(target, draft, [], generator) for _ in range(10_000)]
    assert all(len(out) == 1 for out in tokens)
    _assert_distributed_as([out[0] for out in tokens], P1)


def test_same_seed_gives_the_same_tokens():
    first = _run([P0, P1, P2], [Q0, Q1], 500, seed=5)
    second = _run([P0, P1, P2], [Q0, Q1], 500, seed=5)
    assert first == second
