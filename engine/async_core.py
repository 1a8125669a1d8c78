"""Asynchronous scheduling: step N+1 is planned and launched before step N's tokens are read, so the host's
work between steps (scheduling, batching, stop checks) runs while the device computes.

A deferred step's sampled tokens stay on the device: each sequence gets a placeholder (`Sequence.reserve`),
counted so the scheduler plans around it, and the next step takes the token itself as input, device to
device. The host reads the tokens one call later, after launching the next step, and resolves the
placeholders (`Sequence.resolve`), running the stop checks then: a request that stopped there wastes the one
step already launched for it, whose token is discarded. Log-probabilities asked for are worked out on the
device when the step is deferred and read with its tokens. Steps whose tokens are needed at once (drafts to
verify or propose) run as in the synchronous core.

Penalties, logit bias and grammar masks depend on the tokens generated so far. A step with such requests
launched behind a deferred one queues only its forward pass (`ModelRunner.launch` leaves its tokens None);
the host then reads the deferred step's tokens (advancing each request's grammar), fills the new step's
masks while the device runs its forward pass, and queues its sampling (`ModelRunner.finish`), so
constrained requests are deferred like the others. Speculating, they are not (the drafts need the tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core import EngineCore
from engine.env import engine_env
from engine.model.model import CausalLM
from engine.options import EngineOptions
from engine.planner import CachePlan
from engine.runner import Drafter, Launched, Readback
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.spec_policy import SpeculationMode, speculation_mode
from engine.warmup import warm_up

HOST_PHASES = ("schedule", "launch", "read", "finish", "other")


def async_wanted(
    options: EngineOptions,
    device: torch.device,
    drafter: Drafter | None = None,
    mode: SpeculationMode | None = None,
) -> bool:
    """The `async_scheduling` option, or, left unset, on CUDA (on the CPU nothing runs beside the host)
    unless ENCLAVE_ASYNC_SCHEDULING=0. Never with a fixed k (`mode`, else the options' own): drafting needs
    the tokens at once; adaptive speculation defers its steps at k = 0 and runs the others synchronously."""
    mode = mode or speculation_mode(options.speculation, drafter is not None, device)
    if not mode.adaptive and (mode.k or drafter is not None):
        return False
    requested = options.serving.async_scheduling
    if requested is not None:
        return requested
    return device.type == "cuda" and engine_env().async_scheduling


def build_core(
    model: CausalLM,
    plan: CachePlan,
    options: EngineOptions,
    drafter: Drafter | None = None,
    mode: SpeculationMode | None = None,
) -> EngineCore:
    """The asynchronous core when `async_wanted`, else the synchronous one; warmed up (`engine.warmup`) when
    the `warm_up` option says so, or, unset, when its decode graphs were captured at start. `mode`: the
    speculation `Engine` worked out (default: the options')."""
    device = model.inv_freq.device
    has_drafter = model.mtp is not None or drafter is not None
    mode = mode or speculation_mode(options.speculation, has_drafter, device, model)
    asynchronous = async_wanted(options, device, drafter, mode)
    core = (AsyncEngineCore if asynchronous else EngineCore)(model, plan, options, drafter, mode)
    wanted = options.kernels.warm_up
    if wanted is None:
        wanted = core.graphs is not None and options.kernels.graph_capture_len > 0
    if wanted:
        longest = options.serving.max_model_len or model.config.max_model_len
        warm_up(core, model.config.vocab_size, longest)
    return core


@dataclass(frozen=True)
class Deferred:
    """A launched step whose tokens the host has not read yet."""

    out: SchedulerOutput
    launched: Launched
    readback: Readback


class AsyncEngineCore(EngineCore):
    """`EngineCore` whose steps are read one call late (see the module docstring): `step` returns the
    requests whose end was read in this call."""

    async_scheduling = True

    def __init__(
        self,
        model: CausalLM,
        plan: CachePlan,
        options: EngineOptions,
        drafter: Drafter | None = None,
        mode: SpeculationMode | None = None,
    ) -> None:
        super().__init__(model, plan, options, drafter, mode)
        self._pending: Deferred | None = None
        # The host's seconds in each part of `step`, summed over steps (benchmarks read them; cheap to keep):
        # schedule; launch (batching, uploads, graph replay or eager launches); read (the previous step's
        # tokens: waits for the device when the host is ahead, then resolves placeholders and advances
        # grammars); finish (penalties, grammar mask fills, sampling queued); the rest (defer, bookkeeping).
        self.host_phases = dict.fromkeys(HOST_PHASES, 0.0)

    def has_work(self) -> bool:
        return super().has_work() or self._pending is not None

    def step(self) -> list[Sequence]:
        """Launch a step (deferring its tokens where it can), then read the previous step's; return the
        requests whose end was read."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.batch_size = len(out.scheduled)
        previous = self._pending
        t_scheduled = time.perf_counter()
        launched = self._launch(out, previous.launched if previous else None, nonblocking=True)
        t_launched = time.perf_counter()
        finished: list[Sequence] = []
        defer = launched is not None and self.runner.deferrable(launched)
        if defer:
            self._reserve(out, launched)
            finished += self.scheduler.update(out, [0] * len(out.scheduled))
            self.deferred_steps += 1
        t_read = time.perf_counter()
        if previous is not None:  # its tokens, read while this step runs
            self._pending = None
            finished += self._read(previous, out)
        t_finish = time.perf_counter()
        if launched is not None and launched.tokens is None:
            # Penalties and grammar masks follow the tokens just read: the host fills the masks now, while
            # the device runs this step's forward pass, then queues the sampling.
            launched = self._finish(out, launched)
        t_finished = time.perf_counter()
        if defer:
            self._pending = Deferred(out, launched, self._readback(out, launched))
        else:
            finished += self._complete(out, launched)
        self._timed(start)
        end = time.perf_counter()
        phases = self.host_phases
        phases["schedule"] += t_scheduled - start
        phases["launch"] += t_launched - t_scheduled
        phases["read"] += t_finish - t_read
        phases["finish"] += t_finished - t_finish
        phases["other"] += (t_read - t_launched) + (end - t_finished)
        return finished

    def reset_counters(self) -> None:
        super().reset_counters()
        self.host_phases = dict.fromkeys(HOST_PHASES, 0.0)

    def _reserve(self, out: SchedulerOutput, launched: Launched) -> None:
        """Give each sequence that samples in a deferred step a placeholder for its token."""
        for item, row in zip(out.scheduled, launched.token_rows(), strict=True):
            if row is not None:
                item.seq.reserve()

    def _finish(self, out: SchedulerOutput, launched: Launched) -> Launched:
        """Queue the sampling of a step launched before the previous step's tokens were read."""
        try:
            return self.runner.finish(launched)
        except Exception as exc:
            raise self._failed(exc, out) from exc

    def _readback(self, out: SchedulerOutput, launched: Launched) -> Readback:
        """Start the copy of a deferred step's tokens to the host."""
        try:
            return self.runner.defer(launched)
        except Exception as exc:
            raise self._failed(exc, out) from exc

    def _read(self, step: Deferred, launched_after: SchedulerOutput) -> list[Sequence]:
        """Resolve a deferred step's placeholders with its tokens; release and return the requests they
        ended. If reading fails, the step launched after it fails too: its inputs were those tokens."""
        try:
            sampled = self.runner.read(step.launched, step.readback)
        except Exception as exc:
            raise self._failed(exc, step.out, launched_after) from exc
        ended = []
        for item, got in zip(step.out.scheduled, sampled, strict=True):
            seq = item.seq
            if not got.tokens:
                continue
            if not seq.finished and seq.num_pending:  # else it ended on an earlier token
                seq.resolve(got.tokens[0], got.logprobs[0] if got.logprobs else None)
                self.generated_tokens += 1
            if seq.finished and self.scheduler.finish(seq):
                ended.append(seq)
        return ended
