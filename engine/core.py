"""The engine's step loop without threads: scheduler -> runner -> bookkeeping, one call per step."""

from __future__ import annotations

import os
import time

import torch

from engine.allocator import BlockAllocator, SlotAllocator
from engine.cache import ModelCache
from engine.graphs import DecodeGraphs, graphs_wanted
from engine.model.model import CausalLM
from engine.outputs import EngineStats
from engine.planner import CachePlan
from engine.runner import Drafter, Launched, ModelRunner
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


def async_wanted(device: torch.device) -> bool:
    """Asynchronous scheduling on CUDA (on the CPU nothing runs beside the host), unless
    ENCLAVE_ASYNC_SCHEDULING=0."""
    return device.type == "cuda" and os.environ.get("ENCLAVE_ASYNC_SCHEDULING", "1").strip() != "0"


class StepFailed(Exception):
    """The model raised during a step; the sequences in it were dropped and should fail with `cause`."""

    def __init__(self, seqs: list[Sequence], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.seqs = seqs
        self.cause = cause


class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        plan: CachePlan,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int = 0,
        max_prefixes: int = 4,
        drafter: Drafter | None = None,
        mtp_hidden: str = "normed",
        cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
    ) -> None:
        config = model.config
        # One GEMM per DeltaNet layer's input projections: after any FP8 swap, before graphs are captured.
        model.fuse_projections_()
        device = model.inv_freq.device
        dtype = model.model.embed_tokens.weight.dtype
        num_mtp = len(model.mtp.layers) if model.mtp is not None and num_speculative_tokens else 0
        self.plan = plan
        graphs = int(cuda_graphs and graphs_wanted(device))
        # With CUDA graphs one more slot and block, past the allocators' ranges, take the padding sequences.
        slots, blocks = plan.total_slots + graphs, plan.num_blocks + graphs
        self.cache = ModelCache(config, slots, blocks, plan.block_size, device, dtype, num_mtp)
        self.slots = SlotAllocator(plan.num_slots)
        self.blocks = BlockAllocator(plan.num_blocks, plan.block_size)
        self.scheduler = Scheduler(
            self.slots,
            self.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_speculative_tokens=num_speculative_tokens,
            max_prefixes=max_prefixes,
        )
        pads = (plan.total_slots, plan.num_blocks)
        decode_graphs = DecodeGraphs(model, self.cache, *pads, max_num_seqs) if graphs else None
        self.runner = ModelRunner(
            model, self.cache, plan, num_speculative_tokens, drafter, mtp_hidden, decode_graphs
        )
        if async_scheduling is None:
            async_scheduling = async_wanted(device)
        # Plan and launch step N+1 before reading step N's tokens: the host's work between steps then runs
        # while the device computes. Not with speculation: drafting needs the tokens at once.
        self.async_scheduling = bool(async_scheduling) and not num_speculative_tokens and drafter is None
        self._pending: tuple[SchedulerOutput, Launched] | None = None
        self.deferred_steps = 0
        self.steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.busy_s = 0.0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    def step(self) -> list[Sequence]:
        """Run one step; return the requests that finished in it.

        With asynchronous scheduling a step's tokens are read in the next call, after that call has
        launched its own step: the requests returned are those whose end was read in this call."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        try:
            launched = self.runner.launch(out, defer=self.async_scheduling)
        except Exception as exc:
            raise self._failed(out, exc) from exc
        # Prompt tokens count when computed, generated tokens when read (a step later, when deferred).
        self.prompt_tokens += sum(
            max(0, min(i.context + i.num_new, len(i.seq.prompt_ids)) - i.context) for i in out.scheduled
        )
        self.draft_tokens += sum(len(i.drafts) for i in out.scheduled)
        finished: list[Sequence] = []
        if launched.deferred:
            finished += self.scheduler.update(out, [0] * len(out.scheduled))
            self.deferred_steps += 1
        if self._pending is not None:  # the previous step's tokens, read while this step runs
            finished += self._read(*self._pending)
            self._pending = None
        if launched.deferred:
            self._pending = (out, launched)
        else:
            try:
                result = self.runner.finish(launched)
            except Exception as exc:
                raise self._failed(out, exc) from exc
            finished += self.scheduler.update(out, result.accepted)
            self.generated_tokens += result.num_generated
            self.accepted_tokens += sum(result.accepted)
        self.steps += 1
        self.busy_s += time.perf_counter() - start
        return finished

    def _read(self, out: SchedulerOutput, launched: Launched) -> list[Sequence]:
        """Read a deferred step's tokens; release and return the requests they ended."""
        try:
            result = self.runner.finish(launched)
        except Exception as exc:
            raise self._failed(out, exc) from exc
        self.generated_tokens += result.num_generated
        return [
            item.seq
            for item, rows in zip(out.scheduled, launched.emit_rows, strict=True)
            if rows and item.seq.finished and self.scheduler.finish(item.seq)
        ]

    def _failed(self, out: SchedulerOutput, exc: Exception) -> StepFailed:
        seqs = [item.seq for item in out.scheduled if item.seq.compute_target is None]
        for item in out.scheduled:
            self.scheduler.abort(item.seq)
        return StepFailed(seqs, exc)

    def stats(self) -> EngineStats:
        busy = self.busy_s or float("inf")
        return EngineStats(
            steps=self.steps,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            tokens_per_s=(self.prompt_tokens + self.generated_tokens) / busy,
            generated_tokens_per_s=self.generated_tokens / busy,
            num_running=self.scheduler.num_user_running,
            num_waiting=self.scheduler.num_user_waiting,
            slots_used=self.slots.num_slots - self.slots.num_free,
            slots_total=self.slots.num_slots,
            blocks_used=self.blocks.num_used,
            blocks_total=self.blocks.num_blocks,
            prefix_entries=len(self.scheduler.prefixes),
            num_preemptions=self.scheduler.num_preemptions,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )
