"""The controlled-acceptance drafter and (f)'s end-to-end speculation on the tiny preset, on the CPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.bench.harness import Bench
from engine.bench.presets import PRESETS, random_model
from engine.bench.settings import QUICK, WARMUP_STEPS, Settings
from engine.bench.speculation import (
    TARGETS,
    ControlledDrafter,
    acceptance_for,
    accepted_length,
    expected_length,
    speculative_points,
)
from engine.bench.traffic import param_counts
from engine.config import config_from_dict
from engine.speculative import accept_greedy


@pytest.mark.parametrize(("k", "length"), [*TARGETS, (1, 1.0), (4, 5.0)])
def test_acceptance_solves_the_truncated_geometric_length(k, length):
    p = acceptance_for(length, k)
    assert 0.0 <= p <= 1.0
    assert expected_length(p, k) == pytest.approx(length, abs=1e-9)


def test_acceptance_refuses_lengths_k_drafts_cannot_reach():
    with pytest.raises(ValueError, match="lies in"):
        acceptance_for(3.5, 2)


class _Seq:
    """Stands in for a `Sequence`: the drafter keys its pending verdicts by the (weakly referenced) object."""


def test_drafter_is_right_with_probability_p_and_forces_exactly_the_leading_right_drafts():
    vocab, k = 50, 3
    drafter = ControlledDrafter(0.7, vocab, seed=3)
    model = random.Random(1)
    seq, judged = _Seq(), 0
    for call in range(3000):
        drafts = drafter(seq, k)
        leading = drafter.leading[-1]
        assert len(drafts) == k and all(0 <= d < vocab for d in drafts)
        judged += min(leading + 1, k)  # positions drawn: up to and including the first wrong one
        # The model's argmax: unrelated ids, or (every third call) equal to every draft, wrong ones included.
        agrees = call % 3 == 0
        targets = [*drafts, model.randrange(vocab)] if agrees else [model.randrange(vocab)] * (k + 1)
        forced = drafter.force_targets(seq, drafts, targets)
        tokens = accept_greedy(forced, drafts)
        assert len(tokens) - 1 == leading and tokens[:leading] == drafts[:leading]
        if leading < k:
            assert tokens[leading] != drafts[leading]
            if targets[leading] != drafts[leading]:
                assert tokens[leading] == targets[leading]  # a disagreeing model's token is left as it is
    # Each position right with probability p given those before it were: Binomial(~6600, 0.7), sd 0.0056;
    # 5 sd.
    assert abs(sum(drafter.leading) / judged - 0.7) < 0.03
    lengths = 1 + sum(drafter.leading) / len(drafter.leading)
    assert lengths == pytest.approx(expected_length(0.7, 3), abs=0.08)
    assert drafter.forced == drafter.leading and drafter.unforced == 0


def test_forcing_follows_trimmed_drafts_and_leaves_unknown_ones_to_the_model():
    always, seq = ControlledDrafter(1.0, 50, seed=0), _Seq()
    drafts = always(seq, 3)
    assert always.leading == [3]
    targets = [(d + 7) % 50 for d in drafts[:2]] + [9]
    # The scheduler verified only the first two: both kept, then the model's token.
    assert accept_greedy(always.force_targets(seq, drafts[:2], targets), drafts[:2]) == [*drafts[:2], 9]
    assert always.forced == [2]
    other = [(d + 1) % 50 for d in drafts]  # drafts it did not propose: the model's targets unchanged
    assert always.force_targets(seq, other, [5, 6, 7, 8]) == [5, 6, 7, 8] and always.unforced == 1
    never = ControlledDrafter(0.0, 50, seed=0)
    drafts = never(seq, 2)
    # The model agrees with the (wrong) first draft: made to differ, so nothing is kept.
    tokens = accept_greedy(never.force_targets(seq, drafts, [drafts[0], 3, 4]), drafts)
    assert tokens == [(drafts[0] + 1) % 50] and never.forced == [0]


@pytest.fixture(scope="module")
def tiny_bench():
    config = config_from_dict(PRESETS["tiny"](), source="tiny")
    device = torch.device("cpu")
    model = random_model(config, device, torch.float32, seed=0)
    settings = Settings(
        max_seconds=120, kv_cache_bytes=1 << 28, max_num_batched_tokens=256, max_num_seqs=4, seed=0
    )
    return Bench(model, config, param_counts(config), device, torch.float32, QUICK, settings, 1.0, 1.0)


def test_end_to_end_speculation_forces_the_target_lengths(tiny_bench):
    new = 160
    points = speculative_points(tiny_bench, 1, 16, new, "e2e")
    plain, *spec = points
    spec, adaptive = spec[: len(TARGETS)], spec[len(TARGETS) :]
    assert "error" not in plain and not plain["capped"]
    assert plain["decode_tokens"] == new - 1 - WARMUP_STEPS  # the first token from the prefill, then untimed
    assert [(p["k"], p["target_accepted_length"]) for p in spec] == list(TARGETS)
    for point in spec:
        assert "error" not in point, point
        assert not point["capped"] and "matches_plain" not in point  # forced tokens are not the model's
        assert point["mtp_head_drafts"] and point["speedup_vs_plain"] > 0
        # The real verify path kept exactly the drafts forced right, and every verify step was forced.
        assert point["accepted_drafts"] == point["leading_right_drafts"] > 0, point
        assert point["unforced_verify_steps"] == 0 and "control lost" not in point["note"], point
        k, p = point["k"], point["p"]
        # Per verify step the drafts kept are a geometric run truncated at k; its variance from p.
        mean = expected_length(p, k) - 1
        second = sum(p**i * (2 * i - 1) for i in range(1, k + 1))
        steps = (new - 1) / expected_length(p, k)
        sd = math.sqrt((second - mean**2) / steps)
        # 4 sd, plus the last steps' fewer drafts near max_tokens.
        assert abs(point["mean_accepted_length"] - point["target_accepted_length"]) < 4 * sd + 0.05, point
    wrong, right = adaptive
    for point in adaptive:
        assert "error" not in point and point["adaptive"], point
        assert point["accepted_drafts"] == point["leading_right_drafts"], point
    # Nothing forced at p = 0: the model's own tokens, equal to plain's in fp32 (information in the report).
    assert wrong["matches_plain"] and "matches_plain" not in right
    # Always-wrong drafts: after the prior's first steps the policy stops drafting.
    assert wrong["k_chosen"].get(0, 0) > sum(n for k, n in wrong["k_chosen"].items() if k), wrong
    assert right["mean_accepted_length"] > 2.0 and max(right["k_chosen"]) == 3, right


class _Unforced(ControlledDrafter):
    force_targets = None  # the runner finds no hook: the model's argmax judges the random drafts


def test_without_forcing_the_random_drafts_are_rejected(tiny_bench):
    """What forcing does: the same drafter's random ids, left to the model's argmax, are (almost) never
    accepted, whatever it decided was right; only forcing makes the real verify path run at the target."""
    b, k, new = tiny_bench, 3, 48
    drafter = _Unforced(acceptance_for(3.39, k), b.config.vocab_size, seed=0)
    core = b.core(1, 16 + new + 8 + k, k, drafter)
    seqs = b.add(core, 1, 16, new, 16 + new + 8 + k)
    while core.has_work():
        core.step()
    assert len(seqs[0].output_ids) == new
    assert 1 + sum(drafter.leading) / len(drafter.leading) > 3.0  # what forcing would have kept
    assert accepted_length(seqs) < 1.1 and drafter.forced == []


def test_fit_costs_recovers_the_fixed_costs_of_synthetic_rows(tiny_bench):
    from engine.bench.speculation import fit_costs
    from engine.cache import slot_bytes
    from engine.spec_cost import DeviceCosts, ModelBytes, StepCost

    b = tiny_bench
    model_bytes = ModelBytes.of(b.model, 4, slot_bytes(b.config, torch.float32))
    truth = DeviceCosts(bytes_per_s=1e9, step_s=0.002, verify_s=0.003, draft_s=0.0015)
    cost = StepCost(model_bytes, truth)
    ctx = 100.0
    main = {k: cost.step_bytes(1, k, ctx, speculating=False) / 1e9 for k in range(4)}
    head = {
        k: (cost.step_bytes(1, k, ctx) - cost.step_bytes(1, k, ctx, speculating=False)) / 1e9
        for k in (1, 2, 3)
    }
    points = [{"label": "plain decode step", "ms_per_step": 1e3 * (0.002 + main[0]), "mean_context": ctx}]
    for k in (1, 2, 3):
        verify = 0.002 + 0.003 + main[k]
        points.append({"label": f"verify k={k}", "ms_per_step": 1e3 * verify, "mean_context": ctx})
        points.append({"label": f"MTP step k={k}", "ms_per_step": 1e3 * (verify + k * 0.0015 + head[k])})
    row = fit_costs(points, StepCost(model_bytes, DeviceCosts(bytes_per_s=1e9)))
    assert row == pytest.approx({"bytes_per_s": 1e9, "step_s": 0.002, "verify_s": 0.003, "draft_s": 0.0015})
    assert fit_costs(points[1:], cost) is None  # no plain row: nothing to fit


def test_batch_decode_speculative_rows(tmp_path):
    import json

    from engine import bench

    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "b"]
    assert bench.main([*argv, "--batches", "3", "--speculative", "--json", str(path)]) == 0
    points = {p["label"]: p for p in json.loads(path.read_text())["workloads"]["b"]}
    assert points["batch 3"]["tokens_per_s"] > 0
    assert points["batch 3 e2e plain"]["batch"] == 3
    for k, length in TARGETS:
        point = points[f"batch 3 e2e AL {length} k={k}"]
        assert point["batch"] == 3 and point["mean_accepted_length"] > 1
        assert point["accepted_drafts"] == point["leading_right_drafts"] > 0 and "matches_plain" not in point


def test_decode_reports_the_host_phases_of_an_asynchronous_core(tiny_bench):
    """(b) and (k) report where an asynchronous core's host time goes per timed step; a synchronous core
    has no such counters and reports None."""
    b = tiny_bench
    for asynchronous in (True, False):
        core = b.core(4, 64, asynchronous=asynchronous)
        seqs = b.add(core, 4, 16, 24, 64)
        b.prefill(core, seqs, b.deadline())
        run = b.decode(core, seqs, 6, b.deadline())
        host = run["host_ms_per_step"]
        if not asynchronous:
            assert host is None
            continue
        assert set(host) == {"schedule", "launch", "read", "finish", "other"}
        assert all(v >= 0.0 for v in host.values())
        assert 0.0 < sum(host.values()) <= run["ms_per_step"] * 1.05


def test_documents_take_the_serving_budget(tiny_bench):
    """(d) plans its cache from the serving budget (`serve_kv_cache_bytes`: on CUDA None, the engine's own
    from free memory, as (h)-(j)), not the fixed budget of the single-shape workloads."""
    import dataclasses

    from engine.bench.serving import documents

    b = dataclasses.replace(tiny_bench)
    b.settings = dataclasses.replace(tiny_bench.settings, serve_kv_cache_bytes=3 << 27, max_seconds=60)
    b.sizes = dataclasses.replace(tiny_bench.sizes, docs=4, doc_prompt=24, doc_new=4)
    (point,) = documents(b)
    assert point["completed"] == 4 and point["kv_cache_bytes"] == 3 << 27
