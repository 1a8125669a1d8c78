"""Speculation end to end with controlled acceptance: random weights' MTP head accepts almost nothing, so a
drafter decides which drafts are accepted, each leading position with probability p, and the real verify
path, rejection and state commits run at the mean accepted length a real checkpoint gets.

With k drafts each right with probability p, a verify step emits the leading right drafts plus one token:
AL = sum_{i=0..k} p^i tokens per step. The targets are the issue's: 1.8 at k=1, 2.4 at k=2, 3.39 at k=3.
The drafter lets the real MTP head draft first (`after_head`), so each step pays its real drafting cost.

Acceptance is forced, not matched: the drafter proposes random ids, decides as it drafts how many leading
ones are right, and at verification its `force_targets` (the runner's hook, see `engine.runner.Drafter`)
makes the model's greedy targets equal those drafts and differ at the first wrong one. An earlier version
drafted the plain run's greedy continuation instead and let the model's argmax decide; on an H200 in bf16
with the 35B random-weight preset every run measured AL 1.00: a verify step computes its positions in a
(k+1)-row batch whose bf16 rounding differs from the plain 1-row step's, and on random weights (near-uniform
router, near-tie logits) any difference flips a greedy token within a step or two, after which the plain
run's tokens are no longer the speculative run's continuation. Forced acceptance does not depend on the
numerics; the forced runs' tokens are then not the model's, so they are not compared with the plain run's
(`accepted_drafts == leading_right_drafts` checks that the control held). The adaptive point at p = 0
forces nothing (every draft wrong) and reports `matches_plain` as information only: on a bf16 GPU it can
differ from the plain run for the numeric reason above (and, rarely, where the model's argmax happens to
equal a random draft, which the drafter makes wrong).
"""

from __future__ import annotations

import random
import statistics
import time
import weakref
from typing import Any

from engine.bench.device import sync
from engine.bench.harness import Bench
from engine.bench.measure import guarded
from engine.bench.settings import WARMUP_STEPS
from engine.core import EngineCore
from engine.sequence import Sequence
from engine.spec_cost import StepCost
from engine.spec_policy import ADAPTIVE_MAX_K, expected_length


def acceptance_for(length: float, k: int) -> float:
    """The per-position probability p whose expected accepted length with k drafts is `length` (1..k+1)."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"a mean accepted length with {k} drafts lies in [1, {k + 1}], got {length}")
    low, high = 0.0, 1.0
    for _ in range(60):  # bisection: expected_length grows with p
        mid = (low + high) / 2
        low, high = (mid, high) if expected_length(mid, k) < length else (low, mid)
    return (low + high) / 2


TARGETS: tuple[tuple[int, float], ...] = ((1, 1.8), (2, 2.4), (3, 3.39))  # (k, mean accepted length)
# Adaptive speculation (k chosen per step, at most ADAPTIVE_MAX_K) with drafts that are always wrong (AL 1.0:
# it must not be slower than plain) and right as often as at the k = 3 target.
ADAPTIVE: tuple[tuple[str, float], ...] = (("AL 1.0", 0.0), ("AL 3.39 at k=3", acceptance_for(3.39, 3)))


class ControlledDrafter:
    """Drafts seeded random ids in [0, vocab) and decides, as it drafts, which are right: each position with
    probability `p`, seeded, the first wrong one ending the run. `leading` records, per call, how many leading
    drafts are right. The runner calls `force_targets` when it verifies a greedy sequence's drafts, and the
    engine then accepts exactly the leading right ones among those verified (`forced` records, per verify
    step, how many that was: fewer than `leading` where the scheduler trimmed the drafts)."""

    after_head = True  # the runner lets the MTP head draft first, for its cost

    def __init__(self, p: float, vocab: int, seed: int = 0) -> None:
        self.p, self.vocab = p, vocab
        self.rng = random.Random(seed)
        self.leading: list[int] = []
        self.forced: list[int] = []
        self.unforced = 0  # verify steps of drafts it did not propose (left to the model): none expected
        # Per sequence, its last drafts and how many leading ones are right, until they are verified.
        self.pending: weakref.WeakKeyDictionary[Sequence, tuple[tuple[int, ...], int]]
        self.pending = weakref.WeakKeyDictionary()

    def __call__(self, seq: Sequence, count: int) -> list[int]:
        drafts = [self.rng.randrange(self.vocab) for _ in range(count)]
        leading = 0
        while leading < count and self.rng.random() < self.p:
            leading += 1
        self.leading.append(leading)
        self.pending[seq] = (tuple(drafts), leading)
        return drafts

    def force_targets(self, seq: Sequence, drafts: list[int], targets: list[int]) -> list[int]:
        """The runner's hook (`engine.runner.Drafter`): targets (the model's argmax at the len(drafts)+1
        verified positions) made to equal the leading right drafts and to differ at the first wrong one, so
        that greedy acceptance keeps exactly those. Drafts it did not propose (none pending, or not a prefix
        of the last ones) are left to the model."""
        drafted, leading = self.pending.pop(seq, ((), 0))
        if not drafts or tuple(drafts) != drafted[: len(drafts)]:
            self.unforced += 1
            return targets
        right = min(leading, len(drafts))  # the scheduler may have verified fewer than were drafted
        targets = list(targets)
        targets[:right] = drafts[:right]
        if right < len(drafts) and targets[right] == drafts[right]:  # the model agrees with a wrong draft
            targets[right] = (drafts[right] + 1) % self.vocab
        self.forced.append(right)
        return targets


def accepted_length(seqs: list[Sequence]) -> float | None:
    """Measured tokens per verify step: one more than the mean drafts kept."""
    kept = [n for s in seqs for n in s.metrics.accepted_lengths]
    return 1.0 + statistics.fmean(kept) if kept else None


def run_to_end(b: Bench, core: EngineCore, seqs: list[Sequence], deadline: float) -> dict[str, Any]:
    """Prefill, WARMUP_STEPS untimed decode steps (first-use compiles and captures), then decode every
    request to its end, timed as one run."""
    spent, _, done = b.prefill(core, seqs, deadline)
    if not done:
        return {"capped": True, "note": f"time cap reached during prefill ({spent:.1f} s)"}
    for _ in range(WARMUP_STEPS):
        if core.has_work():
            core.step()
    sync(b.device)
    start, before, steps = time.perf_counter(), core.generated_tokens, 0
    while core.has_work() and time.perf_counter() < deadline:
        core.step()
        steps += 1
    sync(b.device)
    decode_s = time.perf_counter() - start
    tokens = core.generated_tokens - before
    return {
        "decode_steps": steps,
        "decode_s": decode_s,
        "decode_tokens": tokens,
        "tokens_per_s": tokens / decode_s if decode_s else None,
        "ms_per_step": 1e3 * decode_s / steps if steps else None,
        "capped": core.has_work(),
        "async_scheduling": core.async_scheduling,
    }


def speculative_points(b: Bench, batch: int, prompt_len: int, new: int, label: str) -> list[dict[str, Any]]:
    """`batch` greedy requests decoded to `new` tokens plainly (as served: asynchronous where it can be),
    then with a controlled drafter at each target AL; tok/s, measured AL, speed-up, and whether the engine
    accepted exactly the drafts the drafter forced."""
    new = max(new, 4 * WARMUP_STEPS)  # speculative runs cover more tokens in their untimed steps
    max_len = prompt_len + new + 8
    state: dict[str, Any] = {}

    def plain() -> dict[str, Any]:
        core = b.core(batch, max_len)
        seqs = b.add(core, batch, prompt_len, new, max_len)
        point = {"batch": batch, "k": 0} | run_to_end(b, core, seqs, b.deadline())
        state["outputs"] = {tuple(s.prompt_ids): list(s.output_ids) for s in seqs}
        state["tokens_per_s"] = point.get("tokens_per_s")
        if point.get("tokens_per_s"):
            point["note"] = f"{point['tokens_per_s']:.1f} tok/s, {point['ms_per_step']:.2f} ms/step"
        return point

    def speculative(k: int, target: float | None, p: float | None = None) -> dict[str, Any]:
        if not state.get("tokens_per_s"):
            return {"skipped": "the plain run did not finish"}
        adaptive = target is None
        p = acceptance_for(target, k) if p is None else p
        drafter = ControlledDrafter(p, b.config.vocab_size, b.settings.seed)
        core = b.core(batch, max_len + k, k, drafter, adaptive=adaptive)
        seqs = b.add(core, batch, prompt_len, new, max_len + k)
        point = {"batch": batch, "k": k, "p": p, "adaptive": adaptive}
        point["target_accepted_length"] = expected_length(p, k) if adaptive else target
        point |= run_to_end(b, core, seqs, b.deadline())
        policy = core.runner.policy
        point["k_chosen"] = dict(sorted(policy.chosen.items())) if policy is not None else None
        point["mean_accepted_length"] = accepted_length(seqs)
        # The control held: the engine kept exactly the leading right drafts among those it verified.
        point["accepted_drafts"] = sum(n for s in seqs for n in s.metrics.accepted_lengths)
        point["leading_right_drafts"] = sum(drafter.forced)
        point["unforced_verify_steps"] = drafter.unforced
        control = point["accepted_drafts"] == point["leading_right_drafts"] and not drafter.unforced
        if p == 0.0:  # nothing forced: the model's own tokens (information only, see the module docstring)
            point["matches_plain"] = all(state["outputs"][tuple(s.prompt_ids)] == s.output_ids for s in seqs)
        point["mtp_head_drafts"] = b.model.mtp is not None  # its drafting cost is in the step time
        if point.get("tokens_per_s"):
            point["speedup_vs_plain"] = point["tokens_per_s"] / state["tokens_per_s"]
            length = point["mean_accepted_length"]
            point["note"] = (
                (f"AL {length:.2f}" if length else "no verify step")
                + ("" if adaptive else f" (target {target})")
                + (f", k chosen {point['k_chosen']}" if adaptive else "")
                + f"; {point['tokens_per_s']:.1f} tok/s, {point['speedup_vs_plain']:.2f}x plain"
            )
        if not control:
            lost = (
                f"control lost: {point['accepted_drafts']} drafts accepted, {point['leading_right_drafts']}"
                f" forced right, {drafter.unforced} verify steps not forced"
            )
            point["note"] = f"{point['note']}; {lost}" if point.get("note") else lost
        return point

    points = [guarded(f"{label} plain", plain)]
    for k, target in TARGETS:
        points.append(guarded(f"{label} AL {target} k={k}", lambda k=k, t=target: speculative(k, t)))
    for name, p in ADAPTIVE:
        points.append(guarded(f"{label} adaptive {name}", lambda p=p: speculative(ADAPTIVE_MAX_K, None, p)))
    return points


def fit_costs(points: list[dict[str, Any]], cost: StepCost) -> dict[str, float] | None:
    """A `spec_costs.json` row from (f)'s batch-1 rows: the plain step's time less its bytes' is `step_s`;
    a verify step's time beyond that and its bytes, averaged over k, is `verify_s`; an MTP step's time
    beyond its verify step and the head's bytes, per draft, is `draft_s`. None without those rows."""
    rows = {p["label"]: p for p in points if p.get("ms_per_step")}
    plain = rows.get("plain decode step")
    if plain is None:
        return None
    bw = cost.device.bytes_per_s
    context = plain.get("mean_context") or 0.0
    step_s = max(0.0, plain["ms_per_step"] / 1e3 - cost.step_bytes(1, 0, context, speculating=False) / bw)
    verify, draft = [], []
    for k in (1, 2, 3):
        v, m = rows.get(f"verify k={k}"), rows.get(f"MTP step k={k}")
        if v is None:
            continue
        main = cost.step_bytes(1, k, v.get("mean_context") or context, speculating=False)
        verify.append(v["ms_per_step"] / 1e3 - step_s - main / bw)
        if m is not None:
            head = cost.step_bytes(1, k, context) - cost.step_bytes(1, k, context, speculating=False)
            draft.append((m["ms_per_step"] - v["ms_per_step"]) / 1e3 / k - head / bw / k)
    if not verify:
        return None
    return {
        "bytes_per_s": bw,
        "step_s": step_s,
        "verify_s": max(0.0, statistics.fmean(verify)),
        "draft_s": max(0.0, statistics.fmean(draft)) if draft else 0.0,
    }
