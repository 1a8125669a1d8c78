"""Adaptive speculation: how many drafts the next step verifies, from each request's running acceptance and
the step-cost model (`engine/spec_cost.py`); 0 when speculating does not pay.

Each request keeps a running estimate of its per-position acceptance a (an EWMA of kept drafts over drafts
tried, pulled toward a prior until it has evidence: all requests' recent acceptance, 0.6 before any). With
k drafts a verify step emits sum_{i=0..k} a^i of its tokens; the policy picks the k that emits the most
tokens per second for the step's batch, and k = 0 unless some k > 0 beats it by `MARGIN`. A step at k = 0
teaches nothing about acceptance, so after `PROBE_FIRST` such steps in a row one step probes at k = 1 (the
wait doubles after each probe that does not pay, up to `PROBE_MAX`). Where the mode comes from:
`speculation_mode`.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from engine.cache import slot_bytes
from engine.env import engine_env
from engine.model.model import CausalLM
from engine.options import SpeculationOptions
from engine.spec_cost import ModelBytes, StepCost, device_costs

ADAPTIVE_MAX_K = 3  # most drafts per step when the options leave k to the policy
# Most sequences one adaptive step verifies drafts for. Each needs k scratch state slots (61 MiB each at the
# full geometry), so sizing them for every sequence would cut the batch by 1 + k; sized for these, adaptive
# speculation leaves max_num_seqs as without it, and a larger decoding batch runs at k = 0.
ADAPTIVE_MAX_SEQS = 32
PRIOR = 0.6  # per-position acceptance assumed before a request's first verify step
PRIOR_WEIGHT = 2.0  # ... worth this many drafts tried
DECAY = 0.9  # weight of the evidence so far at each new verify step: about the last 10 steps count
GLOBAL_DECAY = 0.99  # ... of all requests' evidence, a new request's prior: about the last 100 verify steps
MARGIN = 0.03  # speculate only when the model predicts at least 3% more tokens per second
PROBE_FIRST, PROBE_MAX = 32, 1024  # steps at k = 0 before a probe at k = 1, and the most after backing off


@dataclass(frozen=True)
class SpeculationMode:
    """Most drafts per step (0: no speculation) and whether the policy chooses fewer per step."""

    k: int
    adaptive: bool
    verify_seqs: int | None = None  # most sequences a step verifies drafts for; None: every sequence


def speculation_mode(
    options: SpeculationOptions, has_drafter: bool, device: torch.device, model: CausalLM | None = None
) -> SpeculationMode:
    """From the option `num_speculative_tokens` n and ENCLAVE_SPECULATION (`engine_env().speculation`).
    Unset n: adaptive up to ADAPTIVE_MAX_K on CUDA when the checkpoint has an MTP head (or a drafter stands
    in) and, given the `model`, `speculation_pays` on this device; else off. A number n forces a fixed
    k = n (0: off), unless ENCLAVE_SPECULATION=adaptive, which chooses per step up to n (on any device,
    whether or not it can pay)."""
    n, policy = options.num_speculative_tokens, engine_env().speculation
    if n == 0 or (n is None and not has_drafter):
        return SpeculationMode(0, False)
    if policy == "auto" and n is None and device.type == "cuda":
        if model is not None and not speculation_pays(model, device, ADAPTIVE_MAX_K):
            return SpeculationMode(0, False)
        return SpeculationMode(ADAPTIVE_MAX_K, True, ADAPTIVE_MAX_SEQS)
    if policy == "adaptive":
        return SpeculationMode(n or ADAPTIVE_MAX_K, True, ADAPTIVE_MAX_SEQS)
    return SpeculationMode(n or 0, False)


def speculation_pays(model: CausalLM, device: torch.device, max_k: int, context: float = 1024.0) -> bool:
    """Whether some k <= max_k beats plain steps at batch 1 even with every draft right, by the cost model
    and this device's row of `spec_costs.json`. When not, the adaptive default would only add its k = 0
    steps' MTP cache fill to every step (measured on the H200: 0.57x plain with the head drafting on the
    host), so the default is off."""
    dtype = model.model.embed_tokens.weight.dtype
    costs = ModelBytes.of(model, dtype.itemsize, slot_bytes(model.config, dtype))
    return SpeculationPolicy(StepCost(costs, device_costs(device)), max_k).best_k([1.0], context) > 0


def expected_length(a: float, k: int) -> float:
    """Tokens a verify step emits when each of k drafts is right with probability a: sum_{i=0..k} a^i."""
    return sum(a**i for i in range(k + 1))


class Acceptance:
    """A running per-position acceptance: kept drafts over drafts tried (a draft is tried when all before it
    were kept), each decayed by `decay` per verify step, with a prior's pseudo-counts."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self.kept = 0.0
        self.tried = 0.0

    def observe(self, offered: int, kept: int) -> None:
        self.kept = self.decay * self.kept + kept
        self.tried = self.decay * self.tried + kept + (kept < offered)

    def rate(self, prior: float = PRIOR) -> float:
        return (self.kept + prior * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)


class SpeculationPolicy:
    """Chooses each step's k (at most `max_k`) from the requests' acceptance and the step's cost; 0 for a
    decoding batch larger than `max_seqs` (the verify scratch slots are sized for that many)."""

    def __init__(self, cost: StepCost, max_k: int, max_seqs: int | None = None) -> None:
        self.cost = cost
        self.max_k = max_k
        self.max_seqs = max_seqs
        self._acceptance: weakref.WeakKeyDictionary[Hashable, Acceptance] = weakref.WeakKeyDictionary()
        # Every request's verify steps together, slowly decayed: a new request's prior (so that with a head
        # whose drafts are wrong, new requests do not each pay a few verify steps to learn it).
        self._overall = Acceptance(GLOBAL_DECAY)
        self.idle_steps = 0  # steps at k = 0 in a row
        self.probe_after = PROBE_FIRST
        self.probing = False  # the last choice was a probe
        self.chosen: dict[int, int] = {}  # how often each k was chosen (for stats and tests)

    def reset(self) -> None:
        """Forget every estimate and count (after the start-up warm-up's synthetic requests)."""
        self._acceptance.clear()
        self._overall = Acceptance(GLOBAL_DECAY)
        self.idle_steps, self.probe_after, self.probing = 0, PROBE_FIRST, False
        self.chosen.clear()

    def observe(self, seq: Hashable, offered: int, kept: int) -> None:
        """A verify step offered `offered` drafts for `seq` and kept `kept`."""
        self._acceptance.setdefault(seq, Acceptance()).observe(offered, kept)
        self._overall.observe(offered, kept)

    def rate(self, seq: Hashable) -> float:
        """`seq`'s estimate, its prior being every request's recent acceptance (PRIOR before any)."""
        prior = self._overall.rate(PRIOR)
        found = self._acceptance.get(seq)
        return found.rate(prior) if found is not None else prior

    def best_k(self, rates: list[float], context: float) -> int:
        """The k with the most tokens per second for a batch with these acceptance rates; 0 unless some
        k > 0 beats plain steps by MARGIN."""
        seqs = len(rates)
        if not seqs or not self.max_k:
            return 0
        plain = seqs / self.cost.seconds(seqs, 0, context)
        best, best_rate = 0, plain * (1 + MARGIN)
        tokens, powers = float(seqs), [1.0] * seqs  # expected tokens at k, the a^k of each request
        for k in range(1, self.max_k + 1):
            powers = [p * a for p, a in zip(powers, rates, strict=True)]
            tokens += sum(powers)  # one pass per k: the host's share of a step at batch 256 stays small
            rate = tokens / self.cost.seconds(seqs, k, context)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def choose(self, seqs: list[Hashable], context: float) -> int:
        """The next step's k for `seqs` (the requests that will decode in it) at mean `context`."""
        if self.max_seqs is not None and len(seqs) > self.max_seqs:  # no scratch slots for them all
            self.chosen[0] = self.chosen.get(0, 0) + 1
            return 0
        k = self.best_k([self.rate(s) for s in seqs], context)
        probe = False
        if k:
            if self.probing:  # the probe showed speculation pays again
                self.probe_after = PROBE_FIRST
            self.idle_steps = 0
        else:
            if self.probing:  # it did not: wait twice as long before the next one
                self.probe_after = min(2 * self.probe_after, PROBE_MAX)
            self.idle_steps += 1
            if self.idle_steps >= self.probe_after and seqs:
                self.idle_steps, k, probe = 0, 1, True
        self.probing = probe
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k
