"""The controlled-acceptance drafter and (f)'s end-to-end speculation on the tiny preset, on the CPU."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from engine.bench.harness import Bench
from engine.bench.presets import PRESETS, random_model
from engine.bench.settings import QUICK, WARMUP_STEPS, Settings
from engine.bench.speculation import (
    TARGETS,
    ControlledDrafter,
    acceptance_for,
    expected_length,
    speculative_points,
)
from engine.bench.traffic import param_counts
from engine.config import config_from_dict


@pytest.mark.parametrize(("k", "length"), [*TARGETS, (1, 1.0), (4, 5.0)])
def test_acceptance_solves_the_truncated_geometric_length(k, length):
    p = acceptance_for(length, k)
    assert 0.0 <= p <= 1.0
    assert expected_length(p, k) == pytest.approx(length, abs=1e-9)


def test_acceptance_refuses_lengths_k_drafts_cannot_reach():
    with pytest.raises(ValueError, match="lies in"):
        acceptance_for(3.5, 2)


def test_drafter_is_right_with_probability_p_and_wrong_ids_are_never_true():
    seq = SimpleNamespace(prompt_ids=[1, 2], output_ids=[])
    truth = {(1, 2): [random.Random(i).randrange(50) for i in range(8)]}
    drafter = ControlledDrafter(truth, 0.7, 50, seed=3)
    right = total = 0
    for _ in range(3000):
        drafts = drafter(seq, 3)
        right += sum(d == t for d, t in zip(drafts, truth[(1, 2)], strict=False))
        total += 3
    # Binomial(9000, 0.7): sd 0.0048; 5 sd.
    assert abs(right / total - 0.7) < 0.025
    lengths = 1 + sum(drafter.leading) / len(drafter.leading)
    assert lengths == pytest.approx(expected_length(0.7, 3), abs=0.08)
    assert ControlledDrafter(truth, 0.0, 50)(seq, 3) != truth[(1, 2)][:3]  # wrong ids differ from the truth


@pytest.fixture(scope="module")
def tiny_bench():
    config = config_from_dict(PRESETS["tiny"](), source="tiny")
    device = torch.device("cpu")
    model = random_model(config, device, torch.float32, seed=0)
    settings = Settings(
        max_seconds=120, kv_cache_bytes=1 << 28, max_num_batched_tokens=256, max_num_seqs=4, seed=0
    )
    return Bench(model, config, param_counts(config), device, torch.float32, QUICK, settings, 1.0, 1.0)


def test_end_to_end_speculation_hits_the_target_lengths_and_equals_plain(tiny_bench):
    new = 160
    points = speculative_points(tiny_bench, 1, 16, new, "e2e")
    plain, *spec = points
    spec, adaptive = spec[: len(TARGETS)], spec[len(TARGETS) :]
    assert "error" not in plain and not plain["capped"]
    assert plain["decode_tokens"] == new - 1 - WARMUP_STEPS  # the first token from the prefill, then untimed
    assert [(p["k"], p["target_accepted_length"]) for p in spec] == list(TARGETS)
    for point in spec:
        assert "error" not in point, point
        assert point["matches_plain"] and not point["capped"]
        assert point["mtp_head_drafts"] and point["speedup_vs_plain"] > 0
        assert point["accepted_drafts"] == point["leading_right_drafts"] > 0  # the real verify kept them
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
        assert "error" not in point and point["adaptive"] and point["matches_plain"], point
    # Always-wrong drafts: after the prior's first steps the policy stops drafting.
    assert wrong["k_chosen"].get(0, 0) > sum(n for k, n in wrong["k_chosen"].items() if k), wrong
    assert right["mean_accepted_length"] > 2.0 and max(right["k_chosen"]) == 3, right


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
        assert point["batch"] == 3 and point["matches_plain"] and point["mean_accepted_length"] > 1
