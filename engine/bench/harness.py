"""Driving an engine core step by step: the `Bench` every workload gets, and one decode measurement."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.async_core import build_core
from engine.bench.device import sync, wall_time
from engine.bench.settings import WARMUP_STEPS, Settings, Sizes
from engine.bench.traffic import ParamCounts, roofline, step_bytes
from engine.cache import kv_cache_dtype, state_dtype
from engine.config import ModelConfig
from engine.core import EngineCore
from engine.model.model import CausalLM
from engine.options import EngineOptions
from engine.planner import plan_for, step_tokens
from engine.runner import Drafter
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.spec_policy import SpeculationMode

if TYPE_CHECKING:  # the grammar library loads only when a constrained workload runs
    from engine.grammar import GrammarState


@dataclass
class Bench:
    """What every workload needs: the model, the run's sizes and settings, the device measurements."""

    model: CausalLM | None  # None once freed for (g)
    config: ModelConfig
    counts: ParamCounts
    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    settings: Settings
    bandwidth: float  # bytes/s
    matmul: float  # FLOP/s

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (`--kv-cache-dtype`): the model's, or e4m3."""
        return kv_cache_dtype(self.settings.kv_cache_dtype, self.dtype)

    @property
    def state_dtype(self) -> torch.dtype:
        """The DeltaNet recurrent states' dtype (`--state-dtype`): the config's `mamba_ssm_dtype`, or bf16."""
        return state_dtype(self.settings.state_dtype, self.config)

    def options(self, **flat: object) -> EngineOptions:
        """The run's engine options (its batch budget, block size, no shared prefixes), with `flat` set."""
        base = {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_num_batched_tokens": self.settings.max_num_batched_tokens,
            "long_prefill_chunk": self.settings.long_prefill_chunk,
            "block_size": self.settings.block_size,
            "draft_head": self.settings.draft_head,
            "draft_vocab": self.settings.draft_vocab,
            "max_prefixes": 0,
            "kv_cache_dtype": self.settings.kv_cache_dtype,
            "state_dtype": self.settings.state_dtype,
        }
        return EngineOptions.from_flat(base | flat)

    def step_tokens(self) -> int:
        """The most tokens one of the run's steps computes (a lone prefill's chunk, if larger)."""
        return step_tokens(self.options(), self.device)

    def core(
        self,
        max_num_seqs: int,
        max_len: int,
        k: int = 0,
        drafter: Drafter | None = None,
        asynchronous: bool | None = None,
        adaptive: bool = False,
    ) -> EngineCore:
        """A fresh engine core whose pools fit `max_num_seqs` sequences of `max_len` positions (at most the
        cache budget); with `k` drafts per step from `drafter`, or from the MTP head when it is None (with
        `adaptive`, at most k, chosen per step by the speculation policy); asynchronous scheduling as
        `build_core` decides unless `asynchronous` says."""
        options = self.options(
            max_num_seqs=max_num_seqs,
            max_model_len=max_len,
            kv_cache_memory=self.settings.kv_cache_bytes,
            num_speculative_tokens=k,
            async_scheduling=asynchronous,
            graph_capture_len=0,  # single-shape workloads: each captures what its untimed warm-up runs
        )
        # The core gives the MTP head its KV cache whenever k > 0, even when a drafter stands in for it.
        num_mtp = len(self.model.mtp.layers) if self.model.mtp is not None and k else 0
        _, plan = plan_for(
            self.config, self.dtype, self.device, options, max_model_len=max_len, num_mtp_layers=num_mtp
        )
        return build_core(self.model, plan, options, drafter, SpeculationMode(k, adaptive and k > 0))

    def prompts(self, n: int, length: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.settings.seed)
        return torch.randint(0, self.config.vocab_size, (n, length), generator=g).tolist()

    def add(
        self,
        core: EngineCore,
        n: int,
        prompt_len: int,
        max_tokens: int,
        max_len: int,
        grammar: Callable[[], GrammarState] | None = None,
    ) -> list[Sequence]:
        """Queue `n` greedy requests of random tokens that ignore EOS; `grammar` makes each one's constraint
        state (workload (k))."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seqs = [
            Sequence(
                i,
                ids,
                params,
                None,
                set(),
                None,
                max_len,
                self.device,
                grammar=grammar() if grammar else None,
            )
            for i, ids in enumerate(self.prompts(n, prompt_len))
        ]
        for seq in seqs:
            core.add(seq)
        return seqs

    def deadline(self) -> float:
        return time.perf_counter() + self.settings.max_seconds

    def step(self, core: EngineCore) -> float:
        """Run one step; seconds it took, the device synchronised on both sides."""
        return wall_time(core.step, self.device)

    def prefill(
        self,
        core: EngineCore,
        seqs: list[Sequence],
        deadline: float,
        trace: list[tuple[int, float]] | None = None,
    ) -> tuple[float, int, bool]:
        """Step until every sequence has its first token: (seconds, steps, whether it got there). `trace`
        gets (positions computed in all, seconds so far) after each step."""
        spent, steps = 0.0, 0
        while any(not s.output_ids for s in seqs):
            if time.perf_counter() > deadline:
                return spent, steps, False
            spent += self.step(core)
            steps += 1
            if trace is not None:
                trace.append((sum(s.num_computed for s in seqs), spent))
        return spent, steps, True

    def decode(self, core: EngineCore, seqs: list[Sequence], steps: int, deadline: float) -> dict[str, Any]:
        """WARMUP_STEPS untimed decode steps, then up to `steps` steps timed as one run: the device is
        synchronised before the first and after the last only, so that with asynchronous scheduling the
        host's work between steps overlaps the device's, as when serving. ms_per_step is the run's mean.
        Tokens are counted when read; with asynchronous scheduling the run reads the tokens of the step
        before its first and not those of its last, the same count at a steady batch."""
        warmup = 0
        while warmup < WARMUP_STEPS and not all(s.finished for s in seqs) and time.perf_counter() < deadline:
            core.step()
            warmup += 1
        live = [s for s in seqs if not s.finished]
        batch = len(live)
        context = statistics.fmean(s.num_computed for s in live) if live else None
        sync(self.device)
        phases = dict(getattr(core, "host_phases", {}))  # asynchronous cores time the host's parts of a step
        start, before, done = time.perf_counter(), core.generated_tokens, 0
        while done < steps and live and time.perf_counter() < deadline:
            core.step()
            done += 1
            if done % 16 == 0:  # checking every sequence each step would add host time at large batches
                live = [s for s in live if not s.finished]
        sync(self.device)
        spent = time.perf_counter() - start if done else 0.0
        tokens = core.generated_tokens - before
        ended = [s.num_computed for s in seqs if not s.finished]
        if context is not None and ended:
            context = (context + statistics.fmean(ended)) / 2
        after = getattr(core, "host_phases", {})
        host_ms = {name: 1e3 * (after[name] - phases[name]) / done for name in phases} if done else {}
        return {
            "decode_steps": done,
            "warmup_steps": warmup,
            "host_ms_per_step": host_ms or None,  # schedule, launch, read, finish, other (async cores)
            "decode_s": spent,
            "ms_per_step": 1e3 * spent / done if done else None,
            "tokens_per_s": tokens / spent if spent else None,
            "decode_tokens": tokens,
            "batch": batch if done else 0,
            "mean_context": context,
            "capped": done < steps,
            "async_scheduling": core.async_scheduling,
        }

    def warm_up(self, prompt_len: int) -> None:
        """One untimed request (a prefill chunk and a few decode steps): compiles and first-use costs."""
        length = min(prompt_len, self.step_tokens())  # alone: a long prompt's first chunk, compiled
        core = self.core(1, length + 16)
        self.add(core, 1, length, 4, length + 16)
        while core.has_work():
            core.step()


def decode_point(
    b: Bench, batch: int, prompt_len: int, steps: int, grammar: Callable[[], GrammarState] | None = None
) -> dict[str, Any]:
    """`batch` sequences prefilled, then timed decode steps with all of them running (each held to the
    constraint `grammar` makes, if given)."""
    deadline = b.deadline()
    # Sequences prefilled early decode while later ones prefill: leave them room to keep the batch full.
    room = -(-batch * prompt_len // b.settings.max_num_batched_tokens) + 1
    max_tokens = 1 + room + WARMUP_STEPS + steps
    max_len = prompt_len + max_tokens + 8
    core = b.core(batch, max_len)
    seqs = b.add(core, batch, prompt_len, max_tokens, max_len, grammar)
    prefill_s, prefill_steps, done = b.prefill(core, seqs, deadline)
    point: dict[str, Any] = {
        "batch": batch,
        "prompt_len": prompt_len,
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "prefill_tokens_per_s": core.prompt_tokens / prefill_s if prefill_s else None,
    }
    if not done:
        return point | {"capped": True, "note": f"time cap reached during prefill ({prefill_s:.1f} s)"}
    run = b.decode(core, seqs, steps, deadline)
    point |= run
    if run["decode_steps"]:
        bytes_ = step_bytes(
            b.counts,
            b.config,
            b.dtype,
            seqs=run["batch"],
            context=run["mean_context"],
            kv_dtype=b.kv_dtype,
            state_dtype=b.state_dtype,
        )
        point |= roofline(bytes_, run["batch"], run["tokens_per_s"], b.bandwidth)
    return point
